"""Lessons: what the bundled model really shows, each one checked on the model.

A lesson is data: an id, a title, a short text for a student who knows attention
but not GQA, the settings of both sides (each a full eviction configuration with
its question position), the views to open, and an **observation**: a statement the
code can check against what the live model (or, for two lessons, the constructed
mechanism or the replay's committed tables) shows for those settings. The text
says only what the observation checks or what the replay measured (and cites the
table).

    >>> [lesson.id for lesson in LESSONS][:3]
    ['gqa-cost', 'pages-vs-tokens', 'sink-masquerade']

`python -m pagekv lessons --check` runs every lesson on the bundled model and exits 1
if an observation does not hold: then the lesson changes, never the check.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pagekv.maths.config import EvictionConfig
from pagekv.maths.metrics import sink_advantage
from pagekv.paths import ROOT

#: The replay run the lessons cite (docs/results.md reads it too).
REPLAY_RESULTS = ROOT / "docs" / "results" / "full" / "results.json"
#: The app's views a lesson can open (tab ids of app.py).
VIEWS = ("frame", "retention", "weights", "sinks", "uor", "mechanism")


# ------------------------------------------------------------------ settings


@dataclass(frozen=True)
class Side:
    """One side of a lesson: an eviction configuration and where the question is."""

    policy: str
    budget: float = 0.2
    page_size: int = 16
    n_sink: int = 4
    window: int = 32
    tau: float = 1.0
    mode: str = "inside"

    def config(self) -> EvictionConfig:
        return EvictionConfig(
            policy=self.policy,
            budget=self.budget,
            page_size=self.page_size,
            n_sink=self.n_sink,
            window=self.window,
            tau=self.tau,
        )


@dataclass(frozen=True)
class Prompt:
    """The prompt both sides read (the question position is per side)."""

    task: str = "needle"
    context_tokens: int = 2000
    depth: float = 0.5
    seed: int = 0
    n_needles: int = 1
    name: str | None = None

    def spec(self, mode: str = "inside"):
        from pagekv.serving.study import PromptSpec

        return PromptSpec(
            task=self.task,
            context_tokens=self.context_tokens,
            depth=self.depth,
            seed=self.seed,
            n_needles=self.n_needles,
            name=self.name,
            mode=mode,
        )


@dataclass(frozen=True)
class Mechanism:
    """Settings of the constructed mechanism view (`pagekv.views.comparison.mechanism_view`)."""

    heads: int = 3
    retrieval: float = 0.9
    distractors: int = 2
    distractor_strength: float = 0.48
    sink_head: bool = False
    n: int = 64
    budget: float = 0.19


# ------------------------------------------------------------------ evidence and findings


@dataclass
class Evidence:
    """What a lesson's observation is checked against (one of the three is set)."""

    comparison: object | None = None  # pagekv.views.comparison.Comparison (live lessons)
    mechanism: object | None = None  # pagekv.views.comparison.MechanismView (constructed)
    replay: dict | None = None  # the committed replay results (cited lessons)


@dataclass(frozen=True)
class Finding:
    """Whether an observation holds, and the figures measured to decide it."""

    holds: bool
    measured: str  # one line for people
    values: dict = field(default_factory=dict)  # the same figures, for JSON


@dataclass(frozen=True)
class Observation:
    """A machine-checkable statement: `check(Evidence) -> Finding`."""

    statement: str
    check: Callable[[Evidence], Finding]


# ------------------------------------------------------------------ observations


def answers(full: bool | None = True, a: bool | None = None, b: bool | None = None):
    """The decoded answers are right or wrong as stated (None: not part of the claim)."""
    want = {"full": full, "A": a, "B": b}
    said = [
        f"{'the full cache' if k == 'full' else k} {'right' if v else 'wrong'}"
        for k, v in want.items()
        if v is not None
    ]

    def check(ev: Evidence) -> Finding:
        recs = ev.comparison.records
        got = {k: bool(recs[k]["correct"]) for k in want}
        holds = all(v is None or got[k] == v for k, v in want.items())
        measured = "; ".join(
            f"{k}: {'right' if got[k] else 'wrong'} ({recs[k]['answer'][:120]!r})" for k in want
        )
        return Finding(holds, measured, {"correct": got})

    return Observation(" and ".join(said), check)


def union_over_budget(side: str, factor: float):
    """Head-independent selection stores at least `factor` x the budget in some (layer,
    group), never more than `r` x."""

    def check(ev: Evidence) -> Finding:
        rec = ev.comparison.records[side]
        p = ev.comparison.plan_of(side)
        union = torch.tensor(rec["union_tokens"], dtype=torch.float64)  # [L, G]
        k = rec["budget_tokens"]
        ratio = union / k
        worst = int(ratio.argmax())
        layer, group = divmod(worst, union.shape[1])
        r = p.head_weights.shape[1] // p.n_groups
        top = float(ratio.max())
        holds = top >= factor and top <= r + 1e-9
        measured = (
            f"largest union {int(union.max())} tokens = {top:.2f}x the budget of {k} "
            f"(layer {layer}, group {group}); mean {float(ratio.mean()):.2f}x; worst case r = {r}"
        )
        return Finding(holds, measured, {"max_ratio": top, "mean_ratio": float(ratio.mean())})

    return Observation(
        f"side {side} stores at least {factor:g}x the budget in some (layer, group), "
        "and never more than r x",
        check,
    )


def sink_masquerade(layer: int, raw_at_least: float, isolated_below: float):
    """In `layer`, the sink heads of some group outweigh its other heads by at least
    `raw_at_least` without sink isolation and by less than `isolated_below` with it."""

    def check(ev: Evidence) -> Finding:
        p = ev.comparison.plan_of("B")
        G = p.n_groups
        raw = sink_advantage(p.weights_nosink, p.sink_heads, G)[layer]  # [G], NaN: no mix
        iso = sink_advantage(p.weights_isolated, p.sink_heads, G)[layer]
        mixed = ~torch.isnan(raw)
        if not bool(mixed.any()):
            return Finding(False, f"layer {layer} has no group with sink and other heads")
        g = int(torch.where(mixed, raw, torch.full_like(raw, -1.0)).argmax())
        r_raw, r_iso = float(raw[g]), float(iso[g])
        holds = r_raw >= raw_at_least and r_iso < isolated_below
        measured = (
            f"layer {layer}, group {g}: sink heads weigh {r_raw:.2f}x the others without "
            f"isolation, {r_iso:.2f}x with it"
        )
        return Finding(holds, measured, {"group": g, "raw": r_raw, "isolated": r_iso})

    return Observation(
        f"in layer {layer} a group's sink heads weigh at least {raw_at_least:g}x its other heads "
        f"without sink isolation, under {isolated_below:g}x with it",
        check,
    )


def tie(min_overlap: float, mean_top_weight_below: float):
    """Entropy and mean pooling keep nearly the same tokens, the largest head weight of a
    group is on average close to 1/r, and the two answers are equal."""

    def check(ev: Evidence) -> Finding:
        pa, pb = ev.comparison.plan_of("A"), ev.comparison.plan_of("B")
        shared = (pa.keep & pb.keep).sum(-1).double() / pa.keep.sum(-1).double()  # [L, G]
        overlap = float(shared.mean())
        L, H = pb.weights_isolated.shape
        G = pb.n_groups
        top = pb.weights_isolated.view(L, G, H // G).amax(-1)  # [L, G] largest weight
        mean_top, max_top = float(top.mean()), float(top.max())
        same = ev.comparison.records["A"]["answer"] == ev.comparison.records["B"]["answer"]
        holds = overlap >= min_overlap and mean_top < mean_top_weight_below and same
        measured = (
            f"kept-set overlap {overlap:.3f} on average (lowest (layer, group) "
            f"{float(shared.min()):.3f}); largest head weight per group {mean_top:.2f} on "
            f"average (highest {max_top:.2f}) against 1/r = {G / H:.2f}; "
            f"answers {'equal' if same else 'differ'}"
        )
        return Finding(
            holds, measured, {"overlap": overlap, "mean_top_weight": mean_top, "same": same}
        )

    return Observation(
        f"A and B keep at least {min_overlap:.0%} of the same tokens on average, the largest "
        f"head weight of a group averages under {mean_top_weight_below:g}, and the answers "
        "are equal",
        check,
    )


def constructed_bound():
    """The constructed group: entropy pooling keeps the needle page, mean pooling evicts
    it, and `w* s*` exceeds `s* / r`."""

    def check(ev: Evidence) -> Finding:
        view = ev.mechanism
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
        return Finding(holds, measured, {"kept": kept, "w_star": view.w_star})

    return Observation(
        "on the constructed group, entropy pooling keeps the needle page and mean pooling "
        "evicts it, because the retrieval head's weight w* exceeds 1/r",
        check,
    )


@dataclass(frozen=True)
class Cite:
    """One number of the replay's committed tables: `table` row where `where` holds,
    its `column`, and the value the lesson's text states."""

    table: str
    where: tuple  # ((key, value), ...)
    column: str
    value: float

    @property
    def label(self) -> str:
        return f"{self.table}[{', '.join(f'{k}={v}' for k, v in self.where)}].{self.column}"


def cite(table: str, column: str, value: float, **where) -> Cite:
    return Cite(table, tuple(where.items()), column, value)


def replay_values(cites: tuple[Cite, ...], tol: float = 1e-6):
    """The committed replay results hold the numbers the text cites."""

    def check(ev: Evidence) -> Finding:
        tables = ev.replay["tables"]
        got, ok = {}, True
        for c in cites:
            rows = [r for r in tables[c.table] if all(r.get(k) == v for k, v in c.where)]
            value = rows[0][c.column] if len(rows) == 1 else None
            got[c.label] = value
            ok = ok and value is not None and abs(value - c.value) <= tol
        measured = "; ".join(
            f"{k} = {v:.3f}" if v is not None else f"{k} missing" for k, v in got.items()
        )
        return Finding(ok, measured, got)

    return Observation("the replay's committed tables hold the numbers the text cites", check)


# ------------------------------------------------------------------ the lessons


@dataclass(frozen=True)
class Lesson:
    id: str
    title: str
    text: str
    observation: Observation
    views: tuple[str, ...]
    kind: str = "live"  # "live" (decoded now), "constructed" or "replay" (measured earlier)
    prompt: Prompt | None = None
    a: Side | None = None
    b: Side | None = None
    layer: int = 0  # the layer the head-weights view shows
    mechanism: Mechanism | None = None
    cites: str | None = None  # where the replay's numbers are

    def __post_init__(self):
        bad = [v for v in self.views if v not in VIEWS]
        if bad:
            raise ValueError(f"lesson {self.id}: unknown views {bad}; choose from {VIEWS}")
        if self.kind == "live" and (self.prompt is None or self.a is None or self.b is None):
            raise ValueError(f"lesson {self.id}: a live lesson needs a prompt and two sides")
        if self.kind not in ("live", "constructed", "replay"):
            raise ValueError(f"lesson {self.id}: unknown kind {self.kind!r}")


T4 = "docs/results.md, table T4 (python -m pagekv replay --model bundled, full grid)"

LESSONS: tuple[Lesson, ...] = (
    Lesson(
        id="gqa-cost",
        title="GQA: why per-head eviction is expensive",
        text=(
            "Under grouped-query attention the r = 3 query heads of a group read one shared "
            "KV cache. If every head picks its own pages within the budget, the group must "
            "store the union of the three picks. Here side A lets every head choose "
            "(head_independent) and side B pools the heads first (entropy), at the same "
            "budget. The check measures the union against the budget in every (layer, "
            "group): it climbs well above 1x, toward the worst case of r = 3x, while the "
            "pooled side stores exactly the budget."
        ),
        observation=union_over_budget("A", 2.0),
        views=("uor", "frame"),
        prompt=Prompt(context_tokens=2000, depth=0.5, seed=0),
        a=Side("head_independent", budget=0.1),
        b=Side("entropy", budget=0.1),
    ),
    Lesson(
        id="pages-vs-tokens",
        title="Pages keep what tokens lose",
        text=(
            "A paged KV cache allocates whole pages, so eviction keeps or drops whole pages. "
            "Both sides use the same policy and the same token budget; side A evicts whole "
            "pages of 16 tokens, side B single tokens (page size 1). A page that holds one "
            "strongly attended token keeps its neighbours too, and on this prompt that is "
            "what keeps the needle's answer readable. The check decodes both: the paged side "
            "answers right and the token-level side wrong."
        ),
        observation=answers(full=True, a=True, b=False),
        views=("frame", "retention"),
        prompt=Prompt(context_tokens=2000, depth=0.5, seed=0),
        a=Side("entropy", budget=0.1, page_size=16),
        b=Side("entropy", budget=0.1, page_size=1),
    ),
    Lesson(
        id="sink-masquerade",
        title="Attention sinks masquerade as focused heads",
        text=(
            "Many heads park most of their attention on the first few tokens (the attention "
            "sinks). Measured by collision entropy, such a head looks sharply focused, so an "
            "entropy weighting without care would trust it most. Page-EntroKV removes the "
            "sink tokens before taking the entropy. The check reads the head weights of the "
            "last layer: without isolation a group's sink heads outweigh its other heads at "
            "least twice, with isolation by less than 1.5x. Over the replay's grid isolation "
            "fixes the average, not every group (docs/results.md, table T3)."
        ),
        observation=sink_masquerade(layer=29, raw_at_least=2.0, isolated_below=1.5),
        views=("weights", "sinks"),
        prompt=Prompt(context_tokens=2000, depth=0.5, seed=0),
        a=Side("entropy_nosink", budget=0.2),
        b=Side("entropy", budget=0.2),
        layer=29,
    ),
    Lesson(
        id="strict-test",
        title="The strict test: ask the question after compression",
        text=(
            "With the question inside the prompt, the observation window already contains "
            "the question, so the window's queries point straight at the answer, and the "
            "first answer token comes from the prefill, which saw everything. Asking after "
            "compression removes both head starts: the cache must keep the needle without "
            "knowing what will be asked. Same policy and budget on both sides; the check "
            "decodes both: right with the question inside, wrong with it asked after."
        ),
        observation=answers(full=True, a=True, b=False),
        views=("retention", "frame"),
        prompt=Prompt(context_tokens=2000, depth=0.5, seed=0),
        a=Side("entropy", budget=0.2, mode="inside"),
        b=Side("entropy", budget=0.2, mode="after"),
    ),
    Lesson(
        id="entropy-vs-mean",
        title="Entropy against mean pooling on this model: an honest tie",
        text=(
            "Page-EntroKV weights the heads of a group by how focused they are; mean pooling "
            "gives each 1/3. On SmolLM2-135M the heads of a group are alike: the largest "
            "weight of a group is under 0.5 on average, so both poolings keep nearly the same "
            "tokens (a few groups differ more). The check measures the weights, the kept-set "
            "overlap and both answers. Over the replay's full grid, entropy and mean gave the "
            "same decoded answer on all 114 prompts compared (docs/results.md, table T7); the "
            "paper's headline, entropy beating mean, needs heads that differ, as in the "
            "constructed lesson."
        ),
        observation=tie(min_overlap=0.9, mean_top_weight_below=0.5),
        views=("weights", "frame"),
        prompt=Prompt(context_tokens=2000, depth=0.5, seed=0),
        a=Side("mean", budget=0.2),
        b=Side("entropy", budget=0.2),
    ),
    Lesson(
        id="constructed-win",
        title="When entropy pooling wins: a constructed group",
        kind="constructed",
        text=(
            "This one is constructed, not a model: one retrieval head puts most of its "
            "attention on the needle, two distractor heads spread theirs. Mean pooling "
            "divides the retrieval head's score by r, entropy pooling weights it by its "
            "focus w*. The needle page is kept whenever w* s* beats the page that would "
            "otherwise be kept last (the retention bound); the check runs both poolings on "
            "the constructed profiles."
        ),
        observation=constructed_bound(),
        views=("mechanism",),
        mechanism=Mechanism(),
    ),
    Lesson(
        id="kvpress-same-memory",
        title="At the same memory as kvpress (measured earlier, not live)",
        kind="replay",
        text=(
            "NVIDIA's kvpress ran beside our policies on the same token ids and budgets in "
            "the replay (not live in this app). At 20 % of a needle prompt, kvpress's SnapKV "
            "recalled the needle on 60 % of 15 prompts with the question inside and 7 % with "
            "it asked after; Page-EntroKV recalled 87 % and 13 % (docs/results.md, table T4). "
            "Both fall sharply when the question comes after compression."
        ),
        observation=replay_values(
            (
                cite("T4_peer", "recall", 9 / 15, press="snapkv", mode="inside", budget=0.2),
                cite("T4_peer", "recall", 1 / 15, press="snapkv", mode="after", budget=0.2),
                cite("T4_recall", "recall", 13 / 15, policy="entropy", mode="inside", budget=0.2),
                cite("T4_recall", "recall", 2 / 15, policy="entropy", mode="after", budget=0.2),
            )
        ),
        views=("retention",),
        cites=T4,
    ),
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
    evidence: Evidence
    finding: Finding

    def to_dict(self) -> dict:
        return {
            "id": self.lesson.id,
            "title": self.lesson.title,
            "kind": self.lesson.kind,
            "observation": self.lesson.observation.statement,
            "holds": self.finding.holds,
            "measured": self.finding.measured,
            "values": self.finding.values,
        }


def load_replay() -> dict:
    return json.loads(REPLAY_RESULTS.read_text())


def run_lesson(
    study, lesson: Lesson, max_new_tokens: int | None = None, progress=None
) -> LessonRun:
    """Run `lesson` (live on `study`'s model, or on the constructed group / the committed
    replay) and check its observation."""
    if lesson.kind == "live":
        from pagekv.views.comparison import compare

        evidence = Evidence(
            comparison=compare(
                study,
                lesson.prompt.spec(lesson.a.mode),
                lesson.a.config(),
                lesson.b.config(),
                max_new_tokens=max_new_tokens,
                progress=progress,
                mode_a=lesson.a.mode,
                mode_b=lesson.b.mode,
            )
        )
    elif lesson.kind == "constructed":
        from pagekv.views.comparison import mechanism_view

        m = lesson.mechanism
        evidence = Evidence(
            mechanism=mechanism_view(
                heads=m.heads,
                retrieval=m.retrieval,
                distractors=m.distractors,
                distractor_strength=m.distractor_strength,
                sink_head=m.sink_head,
                n=m.n,
                budget=m.budget,
            )
        )
    else:
        evidence = Evidence(replay=load_replay())
    return LessonRun(lesson, evidence, lesson.observation.check(evidence))
