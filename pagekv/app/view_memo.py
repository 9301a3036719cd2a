"""Finished runs' views kept for every session, bounded by bytes.

A class running one lesson draws its figures once: the detached comparison, its
figures and its answers table are kept under the model and every setting of the run
(`view_key`); a preview's plan views are kept too, so that the run its slider release
sends draws only what decoding adds. Nothing here touches the model.
"""

from __future__ import annotations

from pagekv.app.figure_memo import BYTES_PER_VALUE, figure_values
from pagekv.app.memo import ByteLRU, nbytes
from pagekv.app.run_figures import comparison_figures

#: Views that planning alone draws (a dragged slider updates these, without decoding).
PLAN_VIEWS = ("frame", "retention", "uor", "stored", "memory", "glance")
#: Plan views that decoding leaves as they are (retention is redrawn: the decoded records
#: measure what the compacted cache stores, padding included).
SAME_AFTER_DECODING = ("frame", "uor", "stored", "memory", "glance")
#: Cap of the memo of finished runs' views.
VIEW_MEMO_BYTES = 96 * 2**20
#: How long a run waits for the same run started by another session before doing it.
SAME_RUN_WAIT_S = 600

#: Finished runs: {"comp", "figs", "table", "layer", "n_layers", "nbytes"} by `view_key`.
view_memo = ByteLRU(VIEW_MEMO_BYTES, size_of=lambda v: v["nbytes"])
#: Plan views drawn by a preview (a dragged slider), reused by the run its release
#: sends with the same settings (the run then draws only what decoding adds).
plan_views_memo = ByteLRU(32 * 2**20, size_of=lambda v: v["nbytes"])


def plan_views(comp, key, layer) -> dict:
    """The plan views of `comp` (`PLAN_VIEWS`), drawn or from `plan_views_memo`."""
    hit = plan_views_memo.get(key)
    if hit is not None:
        return hit["figs"]
    figs = comparison_figures(comp, layer=layer, only=PLAN_VIEWS)
    plan_views_memo.put(key, {"figs": figs, "nbytes": view_size(None, figs)})
    return figs


def view_key(study, spec, a, b, layer) -> tuple:
    """What identifies a run's views: the model, the prompt, both `Side`s, the layer."""
    loaded = study.loaded
    return (loaded.name, loaded.origin, spec, a, b, layer)


def view_size(comp, figs: dict) -> int:
    """Bytes a finished run's views hold (about): the comparison's tensors and records,
    and the figures' data arrays at 64 bytes a value (plotly objects of numbers and
    hover strings; measuring their JSON instead would cost as much as drawing them)."""
    held = 0 if comp is None else nbytes(comp)
    return held + BYTES_PER_VALUE * sum(figure_values(f) for f in figs.values() if f is not None)
