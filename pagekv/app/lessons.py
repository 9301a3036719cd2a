"""Lessons: what the bundled model really shows, each one checked on the model.

A lesson is data: an id, its words (kept apart, in lessons.md: a title, a short text
for a student who knows attention but not GQA, and a credit), the settings of both
sides (each a full eviction configuration with its question position), the views to
open, and an **observation**: a statement the code can check against what the live
model (or, for two lessons, the constructed mechanism or the replay's committed
tables) shows for those settings. The text says only what the observation checks or
what the replay measured (and cites the table).

    >>> [lesson.id for lesson in LESSONS][:3]
    ['gqa-cost', 'pages-vs-tokens', 'sink-masquerade']

`python -m pagekv lessons --check` runs every lesson on the bundled model and exits 1
if an observation does not hold: then the lesson changes, never the check.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from pagekv.app.run_figures import measured, pool_rows
from pagekv.engine.comparison import Side
from pagekv.engine.study import PromptSpec
from pagekv.maths.metrics import isolation_gain, sink_advantage
from pagekv.maths.policies import POOLING_POLICIES
from pagekv.paths import (
    POOLING_SEARCH_PATH,
    REPLAY_RESULTS_PATH,
    RULER_MEMORY_PATH,
    RULER_RESULTS_PATH,
)
from pagekv.runtime.result import mean_retention

#: The app's views a lesson can open (tab ids of app.py).
VIEWS = ("frame", "retention", "weights", "sinks", "uor", "capacity", "mechanism", "replay")
#: The lessons' words, apart from what they run and check (`read_words`).
WORDS_FILE = Path(__file__).with_name("lessons.md")
#: What each lesson's section of `WORDS_FILE` holds, in this order.
WORD_FIELDS = ("title", "text", "credit")


def read_words(text: str) -> dict[str, dict[str, str]]:
    """`{lesson id: {"title", "text", "credit"}}` from lessons.md's form: a section
    `## <id>` per lesson, holding `### title`, `### text` and `### credit` in that
    order, each one paragraph (its line breaks read as spaces). What comes before the
    first section is the file's own preamble. ValueError naming the lesson for a
    missing, repeated, unknown or empty field."""
    words: dict[str, dict[str, list[str]]] = {}
    entry = field_lines = None
    for line in text.splitlines():
        if line.startswith("## "):
            lesson_id = line[3:].strip()
            if lesson_id in words:
                raise ValueError(f"lesson {lesson_id}: two sections")
            entry = words[lesson_id] = {}
            field_lines = None
        elif line.startswith("### ") and entry is not None:
            name = line[4:].strip()
            if name not in WORD_FIELDS or name in entry:
                raise ValueError(f"lesson {lesson_id}: unexpected field {name!r}")
            field_lines = entry[name] = []
        elif field_lines is not None:
            field_lines.append(line)
        elif entry is not None and line.strip():
            raise ValueError(f"lesson {lesson_id}: text outside {WORD_FIELDS}: {line!r}")
    out = {}
    for lesson_id, entry in words.items():
        if tuple(entry) != WORD_FIELDS:
            raise ValueError(
                f"lesson {lesson_id}: needs {WORD_FIELDS} in order; got {tuple(entry)}"
            )
        out[lesson_id] = {name: " ".join(" ".join(entry[name]).split()) for name in WORD_FIELDS}
        empty = [name for name, value in out[lesson_id].items() if not value]
        if empty:
            raise ValueError(f"lesson {lesson_id}: empty {', '.join(empty)}")
    return out


WORDS = read_words(WORDS_FILE.read_text(encoding="utf-8"))


# ------------------------------------------------------------------ settings


@dataclass(frozen=True)
class MechanismSettings:
    """Settings of the constructed mechanism view (`pagekv.maths.mechanism.mechanism_view`)."""

    heads: int = 3
    retrieval: float = 0.9
    distractors: int = 2
    distractor_strength: float = 0.48
    sink_head: bool = False
    n: int = 64
    budget: float = 0.19

    def inputs(self) -> tuple:
        """The mechanism controls' values, in `handlers.MECH_CONTROLS` order (budget in %)."""
        s = self
        return (s.heads, s.retrieval, s.distractors, s.distractor_strength, s.sink_head, s.n,
                round(100 * s.budget))  # fmt: skip


# ------------------------------------------------------------------ observations and verdicts


@dataclass(frozen=True)
class Verdict:
    """Whether an observation holds, and the figures measured to decide it."""

    holds: bool
    measured: str  # one line for people
    values: dict = field(default_factory=dict)  # the same figures, for JSON


@dataclass(frozen=True)
class Observation:
    """A machine-checkable statement: `check(ran) -> Verdict`, where `ran` is what the
    lesson ran: a `pagekv.engine.comparison.Comparison` (live lessons), a
    `pagekv.maths.mechanism.MechanismView` (the constructed group) or the committed
    replay results (cited lessons)."""

    statement: str
    check: Callable[[object], Verdict]


# ------------------------------------------------------------------ observations


def answers(full: bool | None = True, a: bool | None = None, b: bool | None = None):
    """The decoded answers are right or wrong as stated (None: not part of the claim)."""
    want = {"full": full, "A": a, "B": b}
    said = [
        f"{'the full cache' if k == 'full' else k} {'right' if v else 'wrong'}"
        for k, v in want.items()
        if v is not None
    ]

    def check(comp) -> Verdict:
        recs = comp.records
        got = {k: bool(recs[k].correct) for k in want}
        holds = all(v is None or got[k] == v for k, v in want.items())
        measured = "; ".join(
            f"{k}: {'right' if got[k] else 'wrong'} ({recs[k].answer[:120]!r})" for k in want
        )
        return Verdict(holds, measured, {"correct": got})

    return Observation(" and ".join(said), check)


def beside_ruler(observation: Observation) -> Observation:
    """`observation`, its measured line followed by what RULER shows of pages against
    tokens at equal memory (`pages_numbers`, from the committed results): one prompt
    is checked live, and the line says where the rule across prompts differs."""

    def check(comp) -> Verdict:
        got = observation.check(comp)
        n = pages_numbers()
        ruler = (f"on RULER ({n['pg_model']}, committed), pages of 16 against pages of 1: "
                 f"gathered, {n['pg_gathered']}; in place, {n['pg_in_place']}")  # fmt: skip
        return Verdict(got.holds, f"{got.measured}. {ruler}", got.values)

    return Observation(observation.statement, check)


def shared_budget_answers(a: bool, b: bool):
    """The answers are as stated (the full cache right), and side B, whose budget is
    shared across the (layer, group)s, keeps in all no more than the budget of every
    (layer, group) together, `L G k` tokens: the allocated pages, which B's paged decode
    cache stores exactly, each (layer, group) at its own length (no padding). Side A,
    `k` in each, keeps whole pages, so up to a page less per (layer, group). Its
    measured line names the totals and B's largest and smallest (layer, group)."""
    said = answers(full=True, a=a, b=b)

    def check(comp) -> Verdict:
        first = said.check(comp)
        recs = comp.records
        tot = {k: int(sum(map(sum, recs[k].union_tokens))) for k in ("A", "B")}
        flat = [u for row in recs["B"].union_tokens for u in row]
        budget = len(flat) * int(recs["B"].budget_tokens)
        stored_b = int(sum(map(sum, recs["B"].stored_tokens)))
        holds = first.holds and tot["B"] <= budget and stored_b == tot["B"]
        needle = all(recs[k].needle_retention for k in ("A", "B"))
        kept = {k: mean_retention(recs[k]) for k in ("A", "B")}  # the table's "needle kept"
        whole = {k: _whole_needle(recs[k]) if needle else [] for k in ("A", "B")}
        measured = (
            f"{first.measured}. Kept in all: A {tot['A']} tokens, B {tot['B']} of the "
            f"{budget} the budget allows (B's (layer, group)s keep {min(flat)} to "
            f"{max(flat)}; its decode cache stores {stored_b}, each (layer, group) at its "
            "own length)"
        )
        if needle:
            measured += (
                f". Needle kept, the mean over every (layer, group): A {kept['A']:.2f}, "
                f"B {kept['B']:.2f}; the whole needle is kept by {len(whole['A'])} (layer, "
                f"group)s of A ({_layer_span(whole['A'])}) and {len(whole['B'])} of B "
                f"({_layer_span(whole['B'])})"
            )
        values = first.values | {
            "kept_a": tot["A"],
            "kept_b": tot["B"],
            "budget_total": budget,
            "stored_b": stored_b,
            "needle_kept": kept,
            "whole_needle": {k: len(v) for k, v in whole.items()},
        }
        return Verdict(holds, measured, values)

    return Observation(
        f"{said.statement}, with B keeping no more tokens in all than the budget of every "
        "(layer, group) together",
        check,
    )


def _whole_needle(rec) -> list[int]:
    """The layers of the (layer, group)s of a `RunResult` that keep every token of the
    needle, one entry per such (layer, group)."""
    return [i for i, row in enumerate(rec.needle_retention) for v in row if v >= 1.0 - 1e-9]


def _layer_span(layers: list[int]) -> str:
    if not layers:
        return "none"
    return f"layers {min(layers)}-{max(layers)}" if len(set(layers)) > 1 else f"layer {layers[0]}"


def union_over_budget(side: str, factor: float):
    """Head-independent selection stores at least `factor` x the budget in some (layer,
    group), never more than `r` x. Its measured line names every figure the screen
    shows for it: the largest (layer, group)'s stored tokens (the answers table's
    "stored max"), the mean over the (layer, group)s (the memory chart's tokens) and
    the worst case r."""

    def check(comp) -> Verdict:
        rec = comp.records[side]
        p = comp.plan_of(side)
        union = torch.tensor(rec.union_tokens, dtype=torch.float64)  # [L, G]
        k = rec.budget_tokens
        ratio = union / k
        layer, group = divmod(int(ratio.argmax()), union.shape[1])
        r = p.head_weights.shape[1] // p.n_groups
        top, mean = float(ratio.max()), float(ratio.mean())
        holds = top >= factor and top <= r + 1e-9
        uor_max = float(rec.uor["max"])
        measured = (
            f"side {side}: the (layer, group) that stores the most (layer {layer}, group "
            f"{group}) holds {int(union.max())} tokens (the table's stored max), {top:.2f}x "
            f"the budget of {k} tokens; over the {union.numel()} (layer, group)s it stores "
            f"{float(union.mean()):.0f} tokens on average (the number on the "
            f"{rec.policy} bar of the memory chart, UOR & memory), {mean:.2f}x the budget; "
            f"worst case r = {r}x. The table's UOR max ({uor_max:.2f}) divides a union by the "
            "tokens one head keeps, not by the budget"
        )
        values = {
            "max_ratio": top,
            "mean_ratio": mean,
            "max_tokens": int(union.max()),
            "mean_tokens": float(union.mean()),
            "budget_tokens": k,
            "r": r,
            "layer": layer,
            "group": group,
            "uor_max": uor_max,
        }
        return Verdict(holds, measured, values)

    return Observation(
        f"side {side} stores at least {factor:g}x the budget in some (layer, group), "
        "and never more than r x",
        check,
    )


def sink_masquerade(layer: int | str, raw_at_least: float, isolated_below: float):
    """In `layer` (negative: counted from the model's last layer, -1 the last; "sink":
    the layer whose group has the largest sink advantage without isolation, the
    masquerade at its strongest, `sink_layer`), the sink heads of some group outweigh
    its other heads by at least `raw_at_least` without sink isolation and by less than
    `isolated_below` with it. The measured line also counts, over every layer, the
    groups with sink and other heads that isolation brings under `isolated_below`."""
    where = {-1: "the last layer", "sink": "the layer where it is strongest"}.get(
        layer, f"layer {layer}"
    )

    def check(comp) -> Verdict:
        p = comp.plan_of("B")
        G = p.n_groups
        L = p.weights_nosink.shape[0]
        raw_all = sink_advantage(p.weights_nosink, p.sink_heads, G)  # [L, G], NaN: no mix
        iso_all = sink_advantage(p.weights_isolated, p.sink_heads, G)
        at = _strongest_layer(raw_all) if layer == "sink" else layer_index(layer, L)
        raw, iso = raw_all[at], iso_all[at]
        mixed = ~torch.isnan(raw)
        if not bool(mixed.any()):
            return Verdict(False, f"layer {at} has no group with sink and other heads")
        g = int(torch.where(mixed, raw, torch.full_like(raw, -1.0)).argmax())
        r_raw, r_iso = float(raw[g]), float(iso[g])
        holds = r_raw >= raw_at_least and r_iso < isolated_below
        n_mixed = int((~torch.isnan(raw_all)).sum())
        n_fixed = int((iso_all < isolated_below).sum())  # NaN compares False
        # Among the layer's other heads (group g mixes sink and other heads: there is one).
        h, _ = isolation_gain(p.weights_isolated[at], p.weights_nosink[at], p.sink_heads[at])
        r = p.weights_isolated.shape[1] // G
        measured = (
            f"layer {at} (of layers 0-{L - 1}), group {g}: sink heads weigh {r_raw:.2f}x the "
            f"others without isolation, {r_iso:.2f}x with it; over every layer, isolation "
            f"brings {n_fixed} of the {n_mixed} groups with sink and other heads under "
            f"{isolated_below:g}x. The weight isolation takes from the sink heads goes to "
            f"the others: in this layer head g{h // r} h{h} gains most, "
            f"{float(p.weights_nosink[at, h]):.2f} to {float(p.weights_isolated[at, h]):.2f} "
            "(marked in the view)"
        )
        values = {"layer": at, "group": g, "raw": r_raw, "isolated": r_iso, "gains_most": h}
        return Verdict(holds, measured, values | {"mixed": n_mixed, "fixed": n_fixed})

    return Observation(
        f"in {where} a group's sink heads weigh at least {raw_at_least:g}x its other heads "
        f"without sink isolation, under {isolated_below:g}x with it",
        check,
    )


def pool_holds(a_times: float, b_times: float):
    """A pool of fixed bytes (`pagekv.app.run_figures.pool_rows`: two full caches of the
    prompt) holds at least `a_times` as many prompts like this one at side A's budget as with
    the full cache, and at least `b_times` as many at side B's: counted from the plans'
    kept pages, as `Runner.serve` reserves them."""

    def check(comp) -> Verdict:
        live = pool_rows(comp)
        held = {r["side"]: r["held"] for r in live["rows"]}
        size = {r["side"]: r["bytes"] / 2**20 for r in live["rows"]}
        full = held["full"]
        holds = full >= 1 and held["A"] >= a_times * full and held["B"] >= b_times * full
        measured = (
            f"a pool of {live['pool_bytes'] / 2**20:.0f} MiB holds {full} of these "
            f"{live['prompt_tokens']}-token prompts with the full cache ({size['full']:.1f} MiB "
            f"each), {held['A']} at side A's budget ({size['A']:.1f} MiB each) and "
            f"{held['B']} at side B's ({size['B']:.1f} MiB each)"
        )
        return Verdict(holds, measured, {"held": held, "pool_bytes": live["pool_bytes"]})

    return Observation(
        f"a pool that holds this prompt twice with the full cache holds it at least "
        f"{a_times:g}x as often at side A's budget, and at least {b_times:g}x at side B's",
        check,
    )


def kept_overlap(pa, pb) -> torch.Tensor:
    """Float64 `[L, G]`: the share of plan `pa`'s kept tokens that plan `pb` keeps too."""
    return (pa.keep & pb.keep).sum(-1).double() / pa.keep.sum(-1).double()


def tie(min_overlap: float, mean_top_weight_below_r: float):
    """Entropy and mean pooling keep nearly the same tokens, the largest head weight of a
    group is on average close to 1/r (below `mean_top_weight_below_r / r`, for the `r` of
    the model that ran: a fixed bound would hold trivially for large r), and the two
    answers are equal: a tie, which the check says does not hold on a model whose heads
    differ more."""

    def check(comp) -> Verdict:
        pa, pb = comp.plan_of("A"), comp.plan_of("B")
        shared = kept_overlap(pa, pb)  # [L, G]
        overlap = float(shared.mean())
        L, H = pb.weights_isolated.shape
        G = pb.n_groups
        r = H // G
        bound = mean_top_weight_below_r / r
        top = pb.weights_isolated.view(L, G, r).amax(-1)  # [L, G] largest weight
        mean_top, max_top = float(top.mean()), float(top.max())
        at_layer, at_group = divmod(int(top.argmax()), G)
        same = comp.records["A"].answer == comp.records["B"].answer
        holds = overlap >= min_overlap and mean_top < bound and same
        measured = (
            f"kept-set overlap {overlap:.3f} on average over the {L * G} (layer, group)s "
            f"(lowest {float(shared.min()):.3f}); the largest head weight of a group is "
            f"{mean_top:.2f} on average against 1/r = {1 / r:.2f} (r = {r}; the bound "
            f"{mean_top_weight_below_r:g}/r = {bound:.2f}), highest {max_top:.2f} "
            f"(layer {at_layer}, group {at_group}: the layer the weights view opens on); answers "
            f"{'equal' if same else 'differ'}"
        )
        values = {
            "overlap": overlap,
            "mean_top_weight": mean_top,
            "bound": bound,
            "max_top_weight": max_top,
            "layer": at_layer,
            "group": at_group,
            "same": same,
        }
        return Verdict(holds, measured, values)

    return Observation(
        f"a tie: A and B keep at least {min_overlap:.0%} of the same tokens on average, the "
        f"largest head weight of a group averages under {mean_top_weight_below_r:g}/r (the "
        "heads of a group are alike), and the answers are equal",
        check,
    )


def constructed_bound():
    """The constructed group: entropy pooling keeps the needle page, mean pooling evicts
    it, and `w* s*` exceeds `s* / r`."""

    def check(view) -> Verdict:
        kept = {row[0]: row[1] for row in view.rows}
        r = view.mech.profiles.shape[1]
        holds = (
            kept.get("entropy") == "kept"
            and kept.get("mean") == "evicted"
            and view.w_star > 1.0 / r
        )
        measured = (
            f"entropy: {kept.get('entropy')}, mean: {kept.get('mean')}; retrieval weight "
            f"w* = {view.w_star:.3f} against 1/r = {1 / r:.3f} (s* = {view.s_star:.3f})"
        )
        return Verdict(holds, measured, {"kept": kept, "w_star": view.w_star})

    return Observation(
        "on the constructed group, entropy pooling keeps the needle page and mean pooling "
        "evicts it, because the retrieval head's weight w* exceeds 1/r",
        check,
    )


@dataclass(frozen=True)
class ReplayNumber:
    """A number of the replay's committed tables (`REPLAY_RESULTS_PATH`, printed in
    docs/results.md): the `column` of the one `table` row where `where` holds, or
    (`total=True`) its sum over the rows where `where` holds. Lesson texts and
    observations read these, so the numbers on screen are the file's, never a second
    copy."""

    table: str
    column: str
    where: tuple = ()  # ((key, value), ...)
    total: bool = False

    def read(self, tables: dict) -> float | None:
        rows = [r for r in tables.get(self.table, []) if all(r.get(k) == v for k, v in self.where)]
        values = [r.get(self.column) for r in rows]
        if not values or any(v is None for v in values):
            return None
        if self.total:
            return sum(values)
        return values[0] if len(values) == 1 else None

    @property
    def label(self) -> str:
        where = ", ".join(f"{k}={v}" for k, v in self.where)
        return f"{'sum of ' if self.total else ''}{self.table}[{where}].{self.column}"


def number(table: str, column: str, total: bool = False, **where) -> ReplayNumber:
    return ReplayNumber(table, column, tuple(where.items()), total)


def read_numbers(numbers: dict, tables: dict) -> dict:
    """`{name: value}` of `numbers` (name -> ReplayNumber); ValueError names a missing one."""
    got = {name: n.read(tables) for name, n in numbers.items()}
    missing = [numbers[k].label for k, v in got.items() if v is None]
    if missing:
        raise ValueError(f"the replay's results lack {', '.join(missing)}")
    return got


def replay_claim(
    statement: str,
    numbers: dict,
    claim: Callable[[dict], bool],
    describe: Callable[[dict], str],
):
    """A statement about numbers of the replay's committed tables, checked on the file:
    `claim(values)` decides it, `describe(values)` says what was read, in words."""

    def check(replay: dict) -> Verdict:
        try:
            values = read_numbers(numbers, replay["tables"])
        except ValueError as e:
            return Verdict(False, str(e))
        return Verdict(bool(claim(values)), describe(values), values)

    return Observation(statement, check)


def _pct(x: float) -> str:
    return f"{x:.0%}"  # as the lesson texts write it ("{name:.0%}")


# ------------------------------------------------------------------ the lessons


#: How a lesson names the layer its head-weights view opens on, besides a fixed index:
#: "last" (the model's last layer), "strongest" (the layer of the group whose largest
#: head weight is the highest, where pooling matters most) or "sink" (the layer where
#: sink heads outweigh the others most without isolation, `sink_layer`). Resolved on
#: the model that ran (`layer_for`).
LAYER_RULES = ("last", "strongest", "sink")


@dataclass(frozen=True)
class Lesson:
    id: str
    title: str
    text: str  # may name replay numbers as {name} (with a format spec): see `lesson_text`
    observation: Observation
    views: tuple[str, ...]
    kind: str = "live"  # "live" (decoded now), "constructed" or "replay" (measured earlier)
    prompt: PromptSpec | None = None  # each side asks at its own `mode`
    a: Side | None = None
    b: Side | None = None
    layer: int | str = 0  # the layer the head-weights view shows: an index or a LAYER_RULES
    mechanism: MechanismSettings | None = None
    cites: str | None = None  # where the replay's numbers are
    numbers: tuple = ()  # ((name, ReplayNumber), ...): the replay numbers `text` names
    #: Which part of the method the lesson's result belongs to (shared by mean pooling,
    #: Page-EntroKV's own, or not reproduced here): shown under its text. May name the
    #: same numbers as `text`.
    credit: str = ""

    def __post_init__(self):
        bad = [v for v in self.views if v not in VIEWS]
        if bad:
            raise ValueError(f"lesson {self.id}: unknown views {bad}; choose from {VIEWS}")
        if self.kind == "live" and (self.prompt is None or self.a is None or self.b is None):
            raise ValueError(f"lesson {self.id}: a live lesson needs a prompt and two sides")
        if self.kind not in ("live", "constructed", "replay"):
            raise ValueError(f"lesson {self.id}: unknown kind {self.kind!r}")
        if isinstance(self.layer, str) and self.layer not in LAYER_RULES:
            raise ValueError(f"lesson {self.id}: layer {self.layer!r}; choose from {LAYER_RULES}")
        if not self.credit:
            raise ValueError(f"lesson {self.id}: say which part of the method it credits")


def layer_index(layer: int, n_layers: int) -> int:
    """`layer` of a model with `n_layers` layers; negative counts from the end."""
    at = layer + n_layers if layer < 0 else layer
    if not 0 <= at < n_layers:
        raise ValueError(f"layer {layer} does not exist in a model of {n_layers} layers")
    return at


def sink_layer(plan) -> int:
    """The layer of the group whose sink heads outweigh its other heads the most without
    sink isolation (the masquerade at its strongest); 0 if no group mixes sink and
    other heads."""
    return _strongest_layer(sink_advantage(plan.weights_nosink, plan.sink_heads, plan.n_groups))


def _strongest_layer(raw: torch.Tensor) -> int:
    """The layer of the largest entry of `raw` ([L, G] sink advantages, NaN where a group
    lacks sink or other heads); 0 when every entry is NaN."""
    raw = torch.nan_to_num(raw, nan=-1.0)
    return int(raw.argmax()) // raw.shape[1] if bool((raw >= 0).any()) else 0


def layer_for(lesson: Lesson, plan) -> int:
    """The layer `lesson`'s head-weights view opens on, for the plan of the model that
    ran (side B's: the pooled side of every live lesson)."""
    L, H = plan.weights_isolated.shape
    if lesson.layer == "last":
        return L - 1
    if lesson.layer == "sink":
        return sink_layer(plan)
    if lesson.layer == "strongest":
        G = plan.n_groups
        top = plan.weights_isolated.view(L, G, H // G).amax(-1)  # [L, G]
        return int(top.argmax()) // G
    return min(int(lesson.layer), L - 1)


def lesson_text(
    lesson: Lesson, tables: dict | None = None, search: dict | None = None, field: str = "text"
) -> str:
    """The lesson's text (or its `credit`, `field="credit"`) with its replay numbers read
    from the committed results (`tables`: the results file's "tables", read when not
    given) and, where it names them ({search_...}), the pooling search's totals
    (`search`: its summary's "total", read from `POOLING_SEARCH_PATH` when not given)."""
    text = getattr(lesson, field)
    words = lesson.text + lesson.credit
    values: dict = {}
    if lesson.numbers:
        tables = load_replay()["tables"] if tables is None else tables
        values |= read_numbers(dict(lesson.numbers), tables)
    if "{search_" in words:
        values |= search_numbers(search)
    if "{ruler_" in words:
        values |= ruler_numbers()
    if "{mem_" in words:
        values |= memory_numbers()
    if "{pg_" in words:
        values |= pages_numbers()
    if "{cap_" in words:
        values |= capacity_numbers()
    return text.format(**values) if values else text


def ruler_numbers(rows: list[dict] | None = None) -> dict:
    """RULER's figures the lessons quote (`RULER_RESULTS_PATH`, the bundled model, 2,048
    tokens), each the mean over its tasks of each task's mean score. Lesson 6's, with the
    question inside: `ruler_{mean,entropy}{10,20}` and `ruler_samples`, the fewest
    samples behind a task's mean. Lesson 8's, with the question after, on the prompts
    both kvpress presses answered (`ruler_press_prompts`, as docs/ruler.md's second
    table): `ruler_press_{kvzip,snapkv,entropy,mean}` at 10 %, `ruler_press_full` and
    `ruler_press_kvzip1` (KVzip at 1 %); and `ruler_kvzip_pages` (`ruler_kvzip1_pages`),
    the least share (%) of a prompt's 16-token pages that KVzip's kept tokens at 10 % (1
    %) touch in their fullest (layer, KV head)."""
    if rows is None:
        rows = [json.loads(x) for x in RULER_RESULTS_PATH.read_text().splitlines() if x.strip()]
    rows = [r for r in rows if (r["model"], r["length"]) == ("bundled", 2048)]
    inside = [r for r in rows if r["mode"] == "inside"]
    after = [r for r in rows if r["mode"] == "after"]
    out: dict = {}
    counts = []
    for policy in ("mean", "entropy"):
        for pct in (10, 20):
            out[f"ruler_{policy}{pct}"], n = _task_means(inside, f"{policy} {pct}%")
            counts += n
    out["ruler_samples"] = min(counts)
    asked = {(r["task"], r["index"]) for r in after if r["method"].startswith("kvzip ")}
    asked &= {(r["task"], r["index"]) for r in after if r["method"].startswith("snapkv ")}
    shared = [r for r in after if (r["task"], r["index"]) in asked]
    out["ruler_press_prompts"] = len(asked)
    for name in ("kvzip", "snapkv", "entropy", "mean"):
        out[f"ruler_press_{name}"] = _task_means(shared, f"{name} 10%")[0]
    out["ruler_press_full"] = _task_means(shared, "full")[0]
    out["ruler_press_kvzip1"] = _task_means(shared, "kvzip 1%")[0]
    for key, method in (("ruler_kvzip_pages", "kvzip 10%"), ("ruler_kvzip1_pages", "kvzip 1%")):
        kvzip = [r for r in rows if r["method"] == method]
        out[key] = int(100 * min(r["pages_16"] / -(-r["prompt_tokens"] // 16) for r in kvzip))
    return out


#: Lessons 2 and 8 read the comparison at equal memory on RULER (`RULER_MEMORY_PATH`): our
#: reference row (entropy, reconstruction scorer, shared budget, pages of 16) at each
#: budget, against each rival family; the names the lessons give them.
MEMORY_OURS = "entropy reconstruct/global {pct}%"
RIVAL_NAMES = {"kvzip": "KVzip", "chunkkv": "ChunkKV",
               "entropy reconstruct/global (pages of 1)": "pages of 1"}  # fmt: skip
#: The layouts, each with the cache that holds memory so (experiments/ruler_memory.py).
LAYOUT_NAMES = {
    "gathered": "gathered (compacts what it keeps: this app's pool, KVzip's)",
    "in_place": "in place (frees whole pages, never moves a token)",
    "uniform": "uniform (each KV head of a layer gets the fullest one's pages)",
}


def read_memory_summary() -> dict:
    return json.loads(RULER_MEMORY_PATH.read_text())


def said(c: dict | None, rival: str, ours: str = "ours") -> str:
    """One comparison at equal memory in words (`c`: an entry of the summary's `leads`):
    who leads and by how much, with the lead's 95 % interval, or a tie."""
    if c is None:
        return "not measured"
    if c["leader"] == "none":
        return f"no {rival} run within 10 % of ours' memory"
    if c["leader"] == "tie":
        return f"a tie ({rival} {c['diff']:+.2f}, interval {c['low']:+.2f} to {c['high']:+.2f})"
    if c["leader"] == "rival":
        return f"{rival} leads by {c['diff']:.2f} ({c['low']:.2f} to {c['high']:.2f})"
    return f"{ours} leads by {-c['diff']:.2f} ({-c['high']:.2f} to {-c['low']:.2f})"


def _leads(summary: dict) -> dict:
    return {(c["layout"], c["budget"], c["rival"]): c for c in summary["leads"]}


def memory_numbers(summary: dict | None = None) -> dict:
    """Lesson 8's and the README's figures of the comparison at equal memory
    (`RULER_MEMORY_PATH`): `mem_model`; `mem_gathered`, `mem_in_place` and `mem_uniform`,
    KVzip against ours in that layout at 10 and 20 % in words (`said`); and
    `mem_table`, a Markdown table (its own paragraph) of every layout and rival at both
    budgets."""
    summary = read_memory_summary() if summary is None else summary
    leads = _leads(summary)
    out = {"mem_model": summary["block"][0]}
    for layout in LAYOUT_NAMES:
        at = [said(leads.get((layout, pct, "kvzip")), "KVzip") for pct in (10, 20)]
        out[f"mem_{layout}"] = f"at 10 % of the tokens {at[0]}, at 20 % {at[1]}"
    lines = ["| layout | rival | ours at 10 % | ours at 20 % |", "|---|---|---|---|"]
    for layout, where in LAYOUT_NAMES.items():
        for rival, name in RIVAL_NAMES.items():
            cells = []
            for pct in (10, 20):
                c = leads.get((layout, pct, rival))
                n = "" if c is None or c["leader"] == "none" else f", {c['prompts']} prompts"
                cells.append(said(c, name) + n)
            lines.append(f"| {where} | {name} | " + " | ".join(cells) + " |")
    return out | {"mem_table": "\n\n" + "\n".join(lines) + "\n\n"}


def pages_numbers(summary: dict | None = None) -> dict:
    """Lesson 2's figures: ours in pages of 16 against ours in pages of 1 at equal memory
    on RULER (`RULER_MEMORY_PATH`), at 10 and 20 % in words (`said`), in the gathered and the
    in-place layouts (`pg_gathered`, `pg_in_place`), and `pg_model`."""
    summary = read_memory_summary() if summary is None else summary
    leads = _leads(summary)
    rival = "entropy reconstruct/global (pages of 1)"
    out = {"pg_model": summary["block"][0]}
    for layout in ("gathered", "in_place"):
        at = [said(leads.get((layout, pct, rival)), "pages of 1", "pages of 16")
              for pct in (10, 20)]  # fmt: skip
        out[f"pg_{layout}"] = f"at 10 % of the tokens {at[0]}, at 20 % {at[1]}"
    return out


def capacity_numbers(model: str = "bundled", data: dict | None = None) -> dict:
    """The figures the lesson "What a budget buys" quotes from the benchmark: `cap_cpu`,
    `cap_prompts`, `cap_shortest` and `cap_tokens` (the prompts' fewest and most
    tokens), `cap_fits_e10` (the prompts the pool fits at 10 %); per side (`full`, `e20`,
    `e10`, `cb`) the sequences held at once (`cap_held_*`), and for ours the decode's
    tokens per second (`cap_tps_*`); the ratios of entropy to the full cache
    (`cap_held_x*`, `cap_tps_x*`, and of the whole run's tokens per second, prefills
    included, `cap_run_x*`), and the share of answers correct (`cap_ok_*`)."""
    m = measured(model, data)
    if m is None:
        raise ValueError(f"the capacity benchmark has no block for {model!r}")
    s = m["sides"]
    names = {"full": "full", "e20": "entropy 20%", "e10": "entropy 10%", "cb": "transformers CB"}
    out = {"cap_cpu": m["cpu"], "cap_prompts": m["prompts"],
           "cap_shortest": m["prompt_tokens"][0], "cap_tokens": m["prompt_tokens"][1],
           "cap_fits_e10": s[names["e10"]]["fits"]}  # fmt: skip
    for short, name in names.items():
        side = s[name]
        out[f"cap_held_{short}"] = side["held"]
        out[f"cap_ok_{short}"] = f"{side['correct']:.2f}"
        if side["decode_tok_s"] is not None:
            out[f"cap_tps_{short}"] = f"{side['decode_tok_s']:.1f}"
    for short in ("e20", "e10"):
        side, full = s[names[short]], s["full"]
        out[f"cap_held_x{short[1:]}"] = f"{side['held'] / full['held']:.1f}"
        out[f"cap_tps_x{short[1:]}"] = f"{side['decode_tok_s'] / full['decode_tok_s']:.1f}"
        out[f"cap_run_x{short[1:]}"] = f"{side['tok_s'] / full['tok_s']:.2f}"
    return out


def _task_means(rows: list[dict], method: str) -> tuple[str, list[int]]:
    """The mean over tasks of `method`'s mean score per task in `rows` (two decimals),
    and the samples behind each task's mean."""
    per_task: dict[str, list[float]] = {}
    for r in rows:
        if r["method"] == method:
            per_task.setdefault(r["task"], []).append(r["score"])
    means = [sum(v) / len(v) for v in per_task.values()]
    return f"{sum(means) / len(means):.2f}", [len(v) for v in per_task.values()]


def search_numbers(total: dict | None = None) -> dict:
    """`{search_measured, search_differ, search_mean, search_entropy}` of the pooling
    search's totals (`total`, else read from `POOLING_SEARCH_PATH`)."""
    if total is None:
        total = json.loads(POOLING_SEARCH_PATH.read_text())["total"]
    return {
        "search_measured": total["measured"],
        "search_differ": total["only_mean"] + total["only_entropy"],
        "search_mean": total["only_mean"],
        "search_entropy": total["only_entropy"],
    }


T4 = "docs/results.md, table T4 (python -m pagekv replay --model bundled, full grid)"
T7 = "docs/results.md, table T7"

#: Lesson 6's replay numbers: T7's answer-level comparison of entropy and mean, summed
#: over its settings (a tie is the same right/wrong verdict; the texts are not compared).
T7_NUMBERS = (
    ("pairs", number("T7_answers", "prompts", total=True)),
    ("ties", number("T7_answers", "ties", total=True)),
    ("both_right", number("T7_answers", "ties_both_right", total=True)),
    ("beats", number("T7_answers", "entropy_beats", total=True)),
    ("loses", number("T7_answers", "entropy_loses", total=True)),
)
#: Lesson 8's replay numbers: T4 at 20 %, question inside and after.
T4_NUMBERS = (
    ("prompts", number("T4_peer", "prompts", press="snapkv", mode="inside", budget=0.2)),
    ("snap_inside", number("T4_peer", "recall", press="snapkv", mode="inside", budget=0.2)),
    ("snap_after", number("T4_peer", "recall", press="snapkv", mode="after", budget=0.2)),
    ("ours_inside", number("T4_recall", "recall", policy="entropy", mode="inside", budget=0.2)),
    ("ours_after", number("T4_recall", "recall", policy="entropy", mode="after", budget=0.2)),
    ("mean_inside", number("T4_recall", "recall", policy="mean", mode="inside", budget=0.2)),
    ("mean_after", number("T4_recall", "recall", policy="mean", mode="after", budget=0.2)),
)
#: The pooled policies lesson 8 says recalled alike, every one that pools the heads by
#: attention (tests/test_lessons.py checks the replay's file gives them one recall per
#: question position at 20 %).
T4_POOLED = POOLING_POLICIES

#: The prompt every live lesson reads: a needle in 2,000 tokens of haystack, at half depth
#: (each side asks its question at its own `Side.mode`).
PROMPT = PromptSpec(context=2000, depth=0.5, seed=0)

LESSONS: tuple[Lesson, ...] = (
    Lesson(
        id="gqa-cost",
        **WORDS["gqa-cost"],
        observation=union_over_budget("A", 2.0),
        views=("uor", "frame"),
        prompt=PROMPT,
        a=Side.of("head_independent", budget=0.1),
        b=Side.of("entropy", budget=0.1),
    ),
    Lesson(
        id="pages-vs-tokens",
        **WORDS["pages-vs-tokens"],
        observation=beside_ruler(answers(full=True, a=True, b=False)),
        views=("frame", "retention"),
        prompt=PROMPT,
        a=Side.of("entropy", budget=0.1, page_size=16),
        b=Side.of("entropy", budget=0.1, page_size=1),
    ),
    Lesson(
        id="sink-masquerade",
        **WORDS["sink-masquerade"],
        observation=sink_masquerade(layer="sink", raw_at_least=2.0, isolated_below=1.5),
        views=("weights", "sinks"),
        prompt=PROMPT,
        a=Side.of("entropy_nosink", budget=0.2),
        b=Side.of("entropy", budget=0.2),
        layer="sink",
    ),
    Lesson(
        id="strict-test",
        **WORDS["strict-test"],
        observation=answers(full=True, a=True, b=False),
        views=("retention", "frame"),
        prompt=PROMPT,
        a=Side.of("entropy", budget=0.2, mode="inside"),
        b=Side.of("entropy", budget=0.2, mode="after"),
    ),
    Lesson(
        id="reconstruct",
        **WORDS["reconstruct"],
        observation=shared_budget_answers(a=False, b=True),
        views=("frame", "retention"),
        prompt=PROMPT,
        a=Side.of("entropy", budget=0.2, mode="after"),
        b=Side.of("entropy", budget=0.2, mode="after", scorer="reconstruct", allocation="global"),
    ),
    Lesson(
        id="entropy-vs-mean",
        **WORDS["entropy-vs-mean"],
        observation=tie(min_overlap=0.9, mean_top_weight_below_r=1.5),
        views=("weights", "frame"),
        prompt=PROMPT,
        a=Side.of("mean", budget=0.2),
        b=Side.of("entropy", budget=0.2),
        layer="strongest",
        cites=T7,
        numbers=T7_NUMBERS,
    ),
    Lesson(
        id="constructed-win",
        **WORDS["constructed-win"],
        kind="constructed",
        observation=constructed_bound(),
        views=("mechanism",),
        mechanism=MechanismSettings(),
    ),
    Lesson(
        id="kvpress-same-memory",
        **WORDS["kvpress-same-memory"],
        kind="replay",
        observation=replay_claim(
            "in the replay's table T4 at 20%, kvpress SnapKV and Page-EntroKV both recall "
            "the needle less often with the question asked after compression than inside",
            dict(T4_NUMBERS),
            lambda v: v["snap_after"] < v["snap_inside"] and v["ours_after"] < v["ours_inside"],
            lambda v: (
                f"table T4, 20%, {v['prompts']:.0f} prompts: Page-EntroKV (entropy) recalled "
                f"{_pct(v['ours_inside'])} inside, {_pct(v['ours_after'])} after; kvpress "
                f"SnapKV {_pct(v['snap_inside'])} inside, {_pct(v['snap_after'])} after"
            ),
        ),
        views=("replay",),
        cites=T4,
        numbers=T4_NUMBERS,
    ),
    Lesson(
        id="what-a-budget-buys",
        **WORDS["what-a-budget-buys"],
        observation=pool_holds(a_times=4, b_times=8),
        views=("capacity", "frame"),
        prompt=PROMPT,
        a=Side.of("entropy", budget=0.2),
        b=Side.of("entropy", budget=0.1),
    ),
)


_ORPHANS = set(WORDS) - {lesson.id for lesson in LESSONS}
if _ORPHANS:  # words for no lesson: a renamed lesson whose words were left behind
    raise ValueError(f"{WORDS_FILE.name} has words for no lesson: {sorted(_ORPHANS)}")


def lesson_prompts() -> frozenset:
    """The prompt specs the live lessons run (each side's question position): the
    prompts whose prefills, plans and results a `Study` keeps apart from exploration
    (`Study.keep_prompts`)."""
    return frozenset(
        lesson.prompt.replace(mode=side.mode)
        for lesson in LESSONS
        if lesson.kind == "live"
        for side in (lesson.a, lesson.b)
    )


def get_lesson(lesson_id: str) -> Lesson:
    for lesson in LESSONS:
        if lesson.id == lesson_id:
            return lesson
    raise ValueError(f"no lesson {lesson_id!r}; choose from {', '.join(x.id for x in LESSONS)}")


# ------------------------------------------------------------------ running


@dataclass
class LessonRun:
    lesson: Lesson
    ran: object  # what the observation was checked on (`Observation`)
    verdict: Verdict

    def to_dict(self) -> dict:
        return {
            "id": self.lesson.id,
            "title": self.lesson.title,
            "kind": self.lesson.kind,
            "observation": self.lesson.observation.statement,
            "holds": self.verdict.holds,
            "measured": self.verdict.measured,
            "values": self.verdict.values,
        }


def load_replay() -> dict:
    return json.loads(REPLAY_RESULTS_PATH.read_text())


def run_lesson(study, lesson: Lesson, max_new_tokens: int | None = None) -> LessonRun:
    """Run `lesson` (live on `study`'s model, or on the constructed group / the committed
    replay) and check its observation."""
    if lesson.kind == "live":
        from pagekv.engine.comparison import compare

        ran = compare(study, lesson.prompt, lesson.a, lesson.b, max_new_tokens=max_new_tokens)
    elif lesson.kind == "constructed":
        from pagekv.maths.mechanism import mechanism_view

        ran = mechanism_view(**asdict(lesson.mechanism))
    else:
        ran = load_replay()
    return LessonRun(lesson, ran, lesson.observation.check(ran))
