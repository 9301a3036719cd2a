"""The app's presets: settings that show something on first load.

`assets/presets.json` is written by the replay harness (`python -m pagekv replay`,
table T7: where `entropy` and `mean` differ most on the bundled model); each entry
is flat (PromptSpec fields, EvictionConfig fields with `policy`, the compared
`compare_policy`, a `title`, what was observed). Without that file the built-in
presets below are used. `load_presets` returns both kinds in one shape:
the app's control values (`policy_a`, `policy_b`, `budget` as a fraction, ...).
"""

from __future__ import annotations

import json
from pathlib import Path

from pagekv.paths import PRESETS_PATH  # noqa: E402

#: Keys of a normalised preset (what the app's controls take).
FIELDS = (
    "title", "task", "name", "context_tokens", "depth", "seed", "n_needles", "mode",
    "budget", "page_size", "n_sink", "window", "tau", "policy_a", "policy_b",
)  # fmt: skip

_DEFAULTS = dict(
    task="needle", name=None, context_tokens=1500, depth=0.5, seed=0, n_needles=1, mode="after",
    budget=0.1, page_size=16, n_sink=4, window=32, tau=1.0, policy_a="mean", policy_b="entropy",
)  # fmt: skip

BUILTIN = [
    {"title": "Needle, question after compression, 10% budget"},
    {"title": "Needle, question inside the prompt, 20% budget", "mode": "inside",
     "budget": 0.2, "depth": 0.3, "seed": 1},
    {"title": "Three needles, 5% budget, page size 8", "n_needles": 3, "context_tokens": 2000,
     "budget": 0.05, "page_size": 8, "window": 16, "seed": 2},
    {"title": "Sink isolation on and off", "policy_a": "entropy_nosink", "depth": 0.6,
     "seed": 3},
    {"title": "Code question at 20%", "task": "code", "budget": 0.2},
]  # fmt: skip


def normalize(entry: dict) -> dict:
    """One preset in the app's shape; accepts the built-in and the replay's format."""
    p = dict(_DEFAULTS)
    p.update({k: v for k, v in entry.items() if k in FIELDS and v is not None})
    if "policy" in entry:  # the replay's format: policy (B) against compare_policy (A)
        p["policy_b"] = entry["policy"]
        p["policy_a"] = entry.get("compare_policy", "mean")
    if p.get("depth") is None:
        p["depth"] = _DEFAULTS["depth"]
    title = entry.get("title")
    if "observed" in entry:
        title = _measured_title(p, entry)
    p["title"] = str(title or f"{p['task']} at {100 * p['budget']:.0f}%")
    return {k: p[k] for k in FIELDS}


def _measured_title(p: dict, entry: dict) -> str:
    """A readable title for a replay preset, with what the replay observed."""
    what = "needle" if p["task"] == "needle" else p["task"]
    if p["task"] == "needle" and p["n_needles"] > 1:
        what = f"{p['n_needles']} needles"
    head = (
        f"Measured: {what}, {p['context_tokens']} tokens, depth {p['depth']:g}, question "
        f"{p['mode']}, {100 * p['budget']:g}%, page {p['page_size']}"
    )
    obs = entry.get("observed") or {}
    a, b = obs.get(p["policy_a"]), obs.get(p["policy_b"])
    if a and b and a.get("needle_retention") is not None and b.get("needle_retention") is not None:
        head += (
            f" ({p['policy_b']} keeps {b['needle_retention']:.2f} of the needle, "
            f"{p['policy_a']} {a['needle_retention']:.2f})"
        )
    return head


def _full_cache_right(entry: dict) -> bool:
    """False when the replay observed the full cache answering this prompt wrongly."""
    full = (entry.get("observed") or {}).get("full") or {}
    return full.get("correct", True) is not False


def load_presets(path: Path | str | None = None) -> list[dict]:
    """The replay's measured presets (when the file holds valid ones), then the built-ins."""
    src = Path(path) if path is not None else PRESETS_PATH
    measured = []
    try:
        raw = json.loads(src.read_text(encoding="utf-8"))
        # A preset compares policies against the full cache, so a prompt the full cache
        # answers wrongly (as the replay observed it) is no baseline: left out.
        measured = [
            normalize(e)
            for e in raw
            if isinstance(e, dict) and "task" in e and _full_cache_right(e)
        ]
    except (OSError, ValueError, TypeError):
        pass
    out, seen = [], set()
    for p in measured + [normalize(e) for e in BUILTIN]:
        if p["title"] not in seen:  # titles key the app's dropdown
            seen.add(p["title"])
            out.append(p)
    return out
