"""Figures memoised by what they draw: the same inputs give the same figure object.

A budget release re-plans and re-decodes, but the views of head weights and sink mass
draw tensors that the budget does not change (they come from the prefill's profiles,
tau, n_sink and the window). Drawing a plotly figure costs tens of milliseconds of
Python, on the thread that shares the CPU with the decode; drawing it once per content
saves that on every release.

    fig = memo_figure("weights", (plan.weights_isolated, layer), lambda: draw(plan, layer))

The key is the builder's name and a digest of its inputs' values (tensors by dtype,
shape and bytes; numbers, strings and tuples by value), so a memoised figure is the
one the builder would draw now. A figure is shared by every request that draws the
same content: nothing may change a figure after it is drawn (none of our code does;
Gradio only serialises it).
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from pagekv.app.memo import ByteLRU

#: Cap of the memo: the views it holds are small (a few thousand values each).
FIGURE_MEMO_BYTES = 16 * 2**20
#: Bytes per value a memoised figure is counted at (plotly objects of numbers and
#: strings, as `pagekv.app.view_memo.view_size` counts them).
BYTES_PER_VALUE = 64

figure_memo = ByteLRU(FIGURE_MEMO_BYTES, size_of=lambda v: v[1])


def content_key(name: str, inputs: tuple) -> tuple:
    """`(name, digest)`: a digest of `inputs`' values (see the module docstring)."""
    h = hashlib.blake2b(digest_size=20)
    _feed(h, inputs)
    return name, h.hexdigest()


def _feed(h, value) -> None:
    if isinstance(value, torch.Tensor):
        t = value.detach().to("cpu").contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(value, (tuple, list)):
        h.update(f"({len(value)}".encode())
        for v in value:
            _feed(h, v)
        h.update(b")")
    elif value is None or isinstance(value, (bool, int, float, str)):
        h.update(f"{type(value).__name__}:{value!r};".encode())
    else:
        raise TypeError(f"content_key: cannot key a {type(value).__name__}")


def memo_figure(name: str, inputs: tuple, build):
    """The figure `build()` draws for `inputs`, drawn once per content (see the module
    docstring). `inputs` must hold everything `build` reads."""
    key = content_key(name, inputs)
    hit = figure_memo.get(key)
    if hit is not None:
        return hit[0]
    fig = build()
    figure_memo.put(key, (fig, BYTES_PER_VALUE * max(1, figure_values(fig))))
    return fig


def figure_values(fig) -> int:
    """How many values a figure's traces hold (z, x, y, text, customdata)."""
    n = 0
    for trace in fig.data:
        for name in ("z", "x", "y", "text", "customdata"):
            v = trace[name] if name in trace else None
            if v is not None and not isinstance(v, str):
                n += int(np.size(v)) if isinstance(v, np.ndarray) else _count(v)
    return n


def _count(v) -> int:
    return sum(_count(x) for x in v) if isinstance(v, (list, tuple)) else 1
