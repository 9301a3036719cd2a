"""The app's one memo of drawn views, for every session, bounded by bytes.

It holds three kinds of entry, each a dict with its `nbytes`, under keys that say which:

- **finished runs** (`view_key`, `("run", ...)`): the detached comparison, its figures and
  its answers table, under the model and every setting of the run. A class running one
  lesson draws its figures once; a request for a run another request is computing waits
  for it (`ByteLRU.get_or_wait`, `SAME_RUN_WAIT_S`).
- **a preview's plan views** (`("plan", ...)`, `pagekv.app.run_figures.plan_views`): a
  dragged slider draws them, and the run its release sends with the same settings draws
  only what decoding adds.
- **single figures by content** (`memo_figure`, `("figure", name, digest)`): the views of
  head weights and sink mass draw tensors that the budget does not change (they come
  from the prefill's profiles, tau, n_sink and the window). Drawing a plotly figure costs
  tens of milliseconds of Python, on the thread that shares the CPU with the decode;
  drawing it once per content saves that on every release.

      fig = memo_figure("weights", (plan.weights_isolated, layer), lambda: draw(plan, layer))

  The key is the builder's name and a digest of its inputs' values (tensors by dtype,
  shape and bytes; numbers, strings and tuples by value), so a memoised figure is the
  one the builder would draw now.

A figure is shared by every request that draws the same content: nothing may change a
figure after it is drawn (none of our code does; Gradio only serialises it). Nothing
here touches the model.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from pagekv.app.memo import ByteLRU, nbytes

#: Cap of the memo: finished runs (a detached comparison and its figures, a few MiB at
#: 2000 tokens), previews' plan views and single figures (a few thousand values each).
VIEW_MEMO_BYTES = 144 * 2**20
#: Bytes per value a figure is counted at (plotly objects of numbers and hover strings;
#: measuring their JSON instead would cost as much as drawing them).
BYTES_PER_VALUE = 64
#: How long a run waits for the same run started by another session before doing it.
SAME_RUN_WAIT_S = 600

view_memo = ByteLRU(VIEW_MEMO_BYTES, size_of=lambda v: v["nbytes"])


def view_key(study, spec, a, b, layer) -> tuple:
    """What identifies a finished run's views: the model, the prompt, both `Side`s, the
    layer."""
    loaded = study.loaded
    return ("run", loaded.name, loaded.origin, spec, a, b, layer)


def view_size(comp, figs: dict) -> int:
    """Bytes a run's views hold (about): the comparison's tensors and records (none for
    `comp=None`), and the figures' data arrays at `BYTES_PER_VALUE` a value."""
    held = 0 if comp is None else nbytes(comp)
    return held + BYTES_PER_VALUE * sum(figure_values(f) for f in figs.values() if f is not None)


def content_key(name: str, inputs: tuple) -> tuple:
    """`("figure", name, digest)`: a digest of `inputs`' values (module docstring)."""
    h = hashlib.blake2b(digest_size=20)
    _feed(h, inputs)
    return "figure", name, h.hexdigest()


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
    """The figure `build()` draws for `inputs`, drawn once per content (module
    docstring). `inputs` must hold everything `build` reads."""
    key = content_key(name, inputs)
    hit = view_memo.get(key)
    if hit is not None:
        return hit["fig"]
    fig = build()
    view_memo.put(key, {"fig": fig, "nbytes": BYTES_PER_VALUE * max(1, figure_values(fig))})
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
