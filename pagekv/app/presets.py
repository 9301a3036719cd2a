"""The app's presets: settings that show a named difference, each one checked.

Presets are curated like lessons (`pagekv.app.lessons`): a preset sets the app's
controls (side B runs with side A's settings; only the policy differs, as the app's
preset picker runs it), its title names the difference the two policies show, `shows`
says it in a sentence for the page, and `checks` are the observations that measure
that difference on a live comparison (`check_preset`). Every curated preset is run on
the bundled model by `tests/test_presets_bundled.py`, which fails if a named
difference does not appear: then the preset changes, never the check.

    >>> [p["policy_a"] + " vs " + p["policy_b"] for p in load_presets()][:3]
    ['streaming vs entropy', 'head_independent vs entropy', 'entropy_nosink vs entropy']

`assets/presets.json` is written by the replay harness (`python -m pagekv replay`,
table T7: where `entropy` and `mean` differ most on the bundled model); each entry is
flat (PromptSpec fields, EvictionConfig fields with `policy`, the compared
`compare_policy`, a `title`, what was `observed`). An entry becomes a preset only when
what the replay observed shows a difference: the two policies' decoded answers differ
in correctness (one right, one wrong) on a prompt the full cache answers right. Ties
are no preset (on the bundled model every committed entry is a tie, so none is used).

`load_presets` returns both kinds in one shape: the app's control values (`FIELDS`:
`policy_a`, `policy_b`, `budget` as a fraction, ...) plus `shows` and `checks`.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from pagekv.app import lessons
from pagekv.app.lessons import Observation, Verdict, kept_overlap
from pagekv.app.run_inputs import RunInputs, parse_run
from pagekv.engine.comparison import Side
from pagekv.engine.study import PromptSpec
from pagekv.paths import PRESETS_PATH  # noqa: E402

#: Keys of a preset that the app's controls take.
FIELDS = (
    "title", "task", "curated", "context", "depth", "seed", "needles", "mode",
    "budget", "page_size", "n_sink", "window", "tau", "policy_a", "policy_b", "model",
)  # fmt: skip
#: The preset's keys that make its prompt (a `PromptSpec`; each side asks at its mode).
PROMPT_FIELDS = ("task", "curated", "context", "depth", "seed", "needles")
#: The key of the sentence that says what a preset shows (for the page).
SHOWS = "shows"
#: The key of a preset's checks: a tuple of `{"kind": ..., **arguments}` (`observation_of`).
CHECKS = "checks"
#: The view a preset opens (a tab id of app.py, `pagekv.app.lessons.VIEWS`) and the
#: layer its head-weights view shows: the view where what it shows can be seen.
VIEW, LAYER = "view", "layer"
#: Every key of a normalised preset.
KEYS = FIELDS + (SHOWS, CHECKS, VIEW, LAYER)

_DEFAULTS = dict(
    task="needle", curated=None, context=1500, depth=0.5, seed=0, needles=1, mode="after",
    budget=0.1, page_size=16, n_sink=4, window=32, tau=1.0, policy_a="mean", policy_b="entropy",
    model=None,  # None: the model the app has chosen; a name: the model it was measured on
    view="frame", layer=0,
)  # fmt: skip

#: One prompt for the curated presets (the full cache answers it right, MARLIN-86), so
#: that from one preset to the next only the policies change.
_PROMPT = dict(task="needle", context=1500, depth=0.3, seed=1, needles=1, mode="inside")

#: The curated presets: each measured on the bundled model and checked by
#: `tests/test_presets_bundled.py`; `shows` states only what its checks require (the
#: figures measured come from the check, on the page after each run).
CURATED = [
    dict(
        _PROMPT,
        title="Sinks and recent tokens lose the needle: streaming wrong, entropy right at 10 %",
        policy_a="streaming",
        policy_b="entropy",
        budget=0.1,
        view="retention",
        shows=(
            "Both sides keep 10 % of the prompt, with the question inside it. Streaming keeps "
            "the attention sinks and the most recent tokens, so none of the needle's tokens "
            "survive and side A answers wrongly; entropy pooling keeps the pages its heads "
            "attend to, among them part of the needle, and side B answers right."
        ),
        checks=(
            {"kind": "answers", "full": True, "a": False, "b": True},
            {"kind": "needle_kept", "side": "A", "at_most": 0.0},
            {"kind": "needle_kept", "side": "B", "at_least": 0.1},
        ),
    ),
    dict(
        _PROMPT,
        title="Per-head eviction stores the union: head_independent over 2x the budget, "
        "entropy within it (10 %)",
        policy_a="head_independent",
        policy_b="entropy",
        budget=0.1,
        view="uor",
        shows=(
            "Both sides get the same budget and both answer right. Head-independent eviction "
            "lets each of a group's r query heads pick its own pages, but the heads share one "
            "KV cache, so the group must store the union of their picks: over 2x the budget "
            "in some (layer, group). Entropy pooling picks once per group and stores at most "
            "the budget."
        ),
        checks=(
            {"kind": "answers", "full": True, "a": True, "b": True},
            {"kind": "union_over_budget", "side": "A", "factor": 2.0},
            {"kind": "within_budget", "side": "B"},
        ),
    ),
    dict(
        _PROMPT,
        title="Attention sinks masquerade as focused heads: entropy_nosink vs entropy (layer 28)",
        policy_a="entropy_nosink",
        policy_b="entropy",
        budget=0.1,
        view="weights",
        layer=28,
        shows=(
            "Both sides weight a group's heads by their collision entropy; side A takes the "
            "entropy over the whole row, side B (Page-EntroKV) leaves the sink tokens out "
            "first. A head that parks its attention on the sinks looks focused to side A: in "
            "layer 28 a group's sink heads weigh at least 2x its other heads without isolation "
            "and under 1.5x with it, and in some (layer, group) the two sides share under 80 % "
            "of their kept tokens. Both answer right."
        ),
        checks=(
            {"kind": "sink_masquerade", "layer": 28, "raw_at_least": 2.0, "isolated_below": 1.5},
            {"kind": "kept_differ", "overlap_below": 0.8},
            {"kind": "answers", "full": True, "a": True, "b": True},
        ),
    ),
]


#: Presets measured on the second bundled model (r = 7), where mean and entropy pooling
#: give different verdicts (`python experiments/pooling_search.py`,
#: docs/research.md): one where mean pooling wins and one where entropy pooling
#: wins, both question inside and the window scorer. Choosing one switches the model.
#: Checked on that model by `tests/test_qwen_coder.py` (opt-in).
QWEN_CODER_PRESETS = [
    dict(
        task="needle", context=1000, depth=0.7, seed=307, needles=1, mode="inside",
        title="qwen-coder-0.5b (r = 7): mean right, entropy wrong at 10 %, pages of 16",
        policy_a="mean", policy_b="entropy", budget=0.1, model="qwen-coder-0.5b",
        shows=(
            "On qwen-coder-0.5b, where a group has 7 query heads, both sides keep 10 % of a "
            "1000-token prompt in pages of 16 with the question inside. Mean pooling answers "
            "right and entropy pooling wrong: on this model the settings where the two differ "
            "mostly go to mean (docs/research.md has the counts)."
        ),
        checks=({"kind": "answers", "full": True, "a": True, "b": False},),
    ),
    dict(
        task="code", curated="code_sample_interval", mode="inside",
        title="qwen-coder-0.5b (r = 7): entropy right, mean wrong at 10 %, token-level pages",
        policy_a="mean", policy_b="entropy", budget=0.1, page_size=1, model="qwen-coder-0.5b",
        shows=(
            "On qwen-coder-0.5b both sides keep 10 % of a curated code task, token by token "
            "(pages of 1), with the question inside. Here entropy pooling answers right and "
            "mean pooling wrong: one of the few settings of the search where entropy wins "
            "(docs/research.md)."
        ),
        checks=({"kind": "answers", "full": True, "a": False, "b": True},),
    ),
]  # fmt: skip


# ------------------------------------------------------------------ shape


def normalize(entry: dict) -> dict:
    """One preset in the app's shape (`KEYS`); accepts the curated and the replay's
    format. A replay entry gets a title, `shows` and `checks` from what it observed
    (`checks` is empty when it observed no difference)."""
    p = dict(_DEFAULTS)
    p.update({k: v for k, v in entry.items() if k in FIELDS + (VIEW, LAYER) and v is not None})
    if "policy" in entry:  # the replay's format: policy (B) against compare_policy (A)
        p["policy_b"] = entry["policy"]
        p["policy_a"] = entry.get("compare_policy", "mean")
    title = entry.get("title")
    shows, checks = entry.get(SHOWS) or "", tuple(entry.get(CHECKS) or ())
    if "observed" in entry:
        title = _measured_title(p, entry)
        shows, checks = _measured_difference(p, entry)
    p["title"] = str(title or f"{p['task']} at {100 * p['budget']:.0f}%")
    p[SHOWS], p[CHECKS] = shows, checks
    return {k: p[k] for k in KEYS}


def _answered(p: dict, entry: dict) -> tuple[bool | None, bool | None]:
    """Whether the replay observed side A's and side B's policy answering right."""
    obs = entry.get("observed") or {}

    def correct(policy):
        c = (obs.get(policy) or {}).get("correct")
        return c if isinstance(c, bool) else None

    return correct(p["policy_a"]), correct(p["policy_b"])


def _measured_title(p: dict, entry: dict) -> str:
    """A readable title for a replay preset, naming what the replay observed."""
    what = p["task"]
    if what == "needle" and p["needles"] > 1:
        what = f"{p['needles']} needles"
    head = (
        f"Measured: {what}, {p['context']} tokens, depth {p['depth']:g}, question "
        f"{p['mode']}, {100 * p['budget']:g}%, page {p['page_size']}"
    )
    a, b = _answered(p, entry)
    if a is not None and b is not None and a != b:
        head += (
            f": {p['policy_b']} {'right' if b else 'wrong'}, "
            f"{p['policy_a']} {'right' if a else 'wrong'}"
        )
    obs = entry.get("observed") or {}
    ra, rb = obs.get(p["policy_a"]), obs.get(p["policy_b"])
    if ra and rb and None not in (ra.get("needle_retention"), rb.get("needle_retention")):
        head += (
            f" ({p['policy_b']} keeps {rb['needle_retention']:.2f} of the needle, "
            f"{p['policy_a']} {ra['needle_retention']:.2f})"
        )
    return head


def _measured_difference(p: dict, entry: dict) -> tuple[str, tuple]:
    """`shows` and `checks` of a replay entry: its answers, when one policy answered
    right and the other wrong (else no checks: the entry shows no difference)."""
    a, b = _answered(p, entry)
    if a is None or b is None or a == b or p["policy_a"] == p["policy_b"]:
        return "", ()
    shows = (
        f"The replay decoded this prompt at the same settings for both policies: "
        f"{p['policy_b']} answered {'right' if b else 'wrong'}, {p['policy_a']} "
        f"{'right' if a else 'wrong'}, and the full cache right. The check decodes both again."
    )
    return shows, ({"kind": "answers", "full": True, "a": a, "b": b},)


def _full_cache_right(entry: dict) -> bool:
    """False when the replay observed the full cache answering this prompt wrongly."""
    full = (entry.get("observed") or {}).get("full") or {}
    return full.get("correct", True) is not False


def load_presets(path: Path | str | None = None) -> list[dict]:
    """The replay's measured presets that show a difference (when the file holds any),
    then the curated ones."""
    src = Path(path) if path is not None else PRESETS_PATH
    measured = []
    with contextlib.suppress(OSError, ValueError, TypeError):
        raw = json.loads(src.read_text(encoding="utf-8"))
        # A preset compares policies against the full cache, so a prompt the full cache
        # answers wrongly (as the replay observed it) is no baseline: left out. So is a
        # tie: an entry whose policies answered alike shows no difference.
        measured = [
            normalize(e)
            for e in raw
            if isinstance(e, dict) and "task" in e and _full_cache_right(e)
        ]
        measured = [p for p in measured if p[CHECKS]]
    by_title: dict = {}  # titles key the app's dropdown: the first of a title stays
    for p in measured + [normalize(e) for e in CURATED + QWEN_CODER_PRESETS]:
        by_title.setdefault(p["title"], p)
    return list(by_title.values())


# ------------------------------------------------------------------ checks


def needle_kept(side: str, at_least: float | None = None, at_most: float | None = None):
    """Side `side` keeps at least `at_least` / at most `at_most` of the needle's tokens,
    on average over (layer, group)."""
    limits = {"at least": at_least, "at most": at_most}
    bounds = [f"{word} {x:g}" for word, x in limits.items() if x is not None]

    def check(comp) -> Verdict:
        needle = comp.needle_positions_of(side)
        if not needle:
            return Verdict(False, f"side {side}: the prompt has no needle")
        kept = comp.plan_of(side).needle_retention(needle)  # [L, G]
        mean, low, high = float(kept.mean()), float(kept.min()), float(kept.max())
        holds = (at_least is None or mean >= at_least) and (at_most is None or mean <= at_most)
        measured = (
            f"side {side} keeps {mean:.3f} of the needle's {len(needle)} tokens on average "
            f"(per (layer, group) from {low:.3f} to {high:.3f})"
        )
        return Verdict(holds, measured, {f"needle_kept_{side}": mean})

    return Observation(
        f"side {side} keeps {' and '.join(bounds)} of the needle's tokens on average", check
    )


def within_budget(side: str):
    """Side `side` stores at most its budget in every (layer, group)."""

    def check(comp) -> Verdict:
        rec = comp.records[side]
        most, k = max(max(row) for row in rec.union_tokens), rec.budget_tokens
        return Verdict(
            most <= k,
            f"side {side} stores at most {most} tokens in a (layer, group) for a budget of {k}",
            {f"stored_max_{side}": most, "budget_tokens": k},
        )

    return Observation(f"side {side} stores at most the budget in every (layer, group)", check)


def kept_differ(overlap_below: float):
    """In some (layer, group), under `overlap_below` of A's kept tokens are kept by B."""

    def check(comp) -> Verdict:
        shared = kept_overlap(comp.plan_of("A"), comp.plan_of("B"))  # [L, G]
        low, mean = float(shared.min()), float(shared.mean())
        layer, group = divmod(int(shared.argmin()), shared.shape[1])
        measured = (
            f"kept-set overlap {mean:.3f} on average, lowest {low:.3f} (layer {layer}, "
            f"group {group})"
        )
        return Verdict(low < overlap_below, measured, {"overlap": mean, "overlap_min": low})

    return Observation(
        f"in some (layer, group) under {overlap_below:.0%} of A's kept tokens are kept by B",
        check,
    )


#: The checks a preset may name (its `CHECKS` entries' "kind"), and what builds each.
CHECK_BUILDERS = {
    "answers": lessons.answers,
    "union_over_budget": lessons.union_over_budget,
    "sink_masquerade": lessons.sink_masquerade,
    "needle_kept": needle_kept,
    "within_budget": within_budget,
    "kept_differ": kept_differ,
}
CHECK_KINDS = tuple(CHECK_BUILDERS)


def observation_of(preset: dict):
    """The preset's checks as one `Observation` (all of them must hold)."""
    parts = [
        CHECK_BUILDERS[c["kind"]](**{k: v for k, v in c.items() if k != "kind"})
        for c in preset[CHECKS]
    ]
    if not parts:
        raise ValueError(f"preset {preset['title']!r} has no checks: it shows no difference")

    def check(comp) -> Verdict:
        found = [o.check(comp) for o in parts]
        values = {k: v for f in found for k, v in f.values.items()}
        return Verdict(all(f.holds for f in found), "; ".join(f.measured for f in found), values)

    return Observation("; ".join(o.statement for o in parts), check)


def preset_sides(preset: dict):
    """A preset's `(PromptSpec, Side A, Side B)`: B has A's settings and its own method
    (the defaults, window and uniform, where the preset names none)."""
    p = preset
    prompt = PromptSpec(**{name: p[name] for name in PROMPT_FIELDS})
    defaults = (("scorer", "window"), ("allocation", "uniform"))
    method = {side: {m: p.get(f"{m}_{side}", d) for m, d in defaults} for side in ("a", "b")}
    a = Side.of(
        p["policy_a"], budget=p["budget"], page_size=p["page_size"], n_sink=p["n_sink"],
        window=p["window"], tau=p["tau"], mode=p["mode"], **method["a"],
    )  # fmt: skip
    return prompt, a, a.replace(policy=p["policy_b"], **method["b"])


def preset_inputs(preset: dict):
    """`(spec, a, b)` as the app runs the preset (its run inputs through
    `pagekv.app.run_inputs.parse_run`)."""
    return parse_run(RunInputs.for_sides(*preset_sides(preset), model="bundled"))[:3]


def preset_matches(preset: dict, comp) -> bool:
    """Whether the comparison `comp` ran exactly the preset's prompt and two sides (on
    the preset's model, where it names one: not on a model that stood in for it)."""
    if comp is None or preset.get("model") not in (None, comp.model):
        return False
    return comp.ran(*preset_inputs(preset))


def compare_preset(study, preset: dict, max_new_tokens: int | None = None):
    """Run the preset's comparison on `study`'s model, as the app runs it."""
    from pagekv.engine.comparison import compare

    return compare(study, *preset_inputs(preset), max_new_tokens=max_new_tokens)


def check_preset(preset: dict, comparison):
    """The preset's checks on a comparison of its settings: a `Verdict`."""
    return observation_of(preset).check(comparison)


def run_presets(study, presets: list[dict] | None = None) -> list[tuple[dict, object]]:
    """Run every preset (default: those of `load_presets()` measured on `study`'s model
    or on any) on `study` and check it: `[(preset, Verdict), ...]`."""
    if presets is None:
        presets = [p for p in load_presets() if p["model"] in (None, study.loaded.name)]
    return [(p, check_preset(p, compare_preset(study, p))) for p in presets]
