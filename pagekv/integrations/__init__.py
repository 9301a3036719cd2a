"""Page-EntroKV inside other libraries' pipelines.

``kvpress_press``: `PageEntroKVPress` (and `MeanPoolPagePress`), NVIDIA kvpress presses
that decide with `pagekv.maths.plan`, scoring by the last window's queries during the
prefill (``scorer="window"``) or by pagekv's reconstruction pass after it
(``scorer="reconstruct"``); see docs/kvpress.md::

    from pagekv.integrations import PageEntroKVPress

``lm_eval_model``: `PageKVLM`, the lm-evaluation-harness model type ``pagekv``
(``python -m pagekv eval``; importing the module registers it, and imports lm-eval).

Names are loaded on first use, so ``import pagekv.integrations`` imports neither kvpress
nor transformers.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "PageEntroKVPress": "kvpress_press",
    "MeanPoolPagePress": "kvpress_press",
    "HookProtocol": "kvpress_press",
    "KVPRESS_BASE": "kvpress_press",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        module = importlib.import_module(f"{__name__}.{_LAZY[name]}")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
