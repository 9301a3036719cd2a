"""Two policies side by side on one prefilled prompt: the comparison engine.

    comp = compare(study, spec, Side.of("mean"), Side.of("entropy", mode="after"))
    comp.records["A"].answer, comp.records["B"].correct, comp.records["full"].answer
    summary(comp)                          # its numbers, JSON-ready
    paths = export_data(comp, folder)      # pagekv_run.json and pagekv_run.csv

Planning (`preview_comparison`: the prefill, both sides' plans, the UOR curve and the memory
rows, each configuration planned once through the study's plan memo) and decoding
(`Decoding`: full, A and B as worker jobs, streamed) live here, below the views, which
only draw them (`pagekv.app.run_figures`) and handle the page's events. Only the
prefill is expensive; a new budget, page size or tau re-runs plan, compaction and
decoding (`Study.prepare` memoises the prefill, and the full-cache answer is memoised
per prompt).
"""

from __future__ import annotations

import csv
import json
import os
from dataclasses import dataclass, field, replace

from pagekv.engine.study import MODES, Prompt, PromptSpec, Study, served_copy
from pagekv.maths.config import POLICIES, EvictionConfig
from pagekv.maths.metrics import sink_advantage, summarize_sink_advantage
from pagekv.maths.paging import BudgetError
from pagekv.maths.plan import Plan
from pagekv.maths.policies import get_policy

#: Budgets of the UOR-across-budgets view.
CURVE_BUDGETS = (0.02, 0.05, 0.1, 0.2, 0.3, 0.5)


@dataclass(frozen=True)
class Side:
    """One side of a comparison: what it keeps (an `EvictionConfig`) and where its
    question sits ("inside" the prompt, or asked "after" compression: `MODES`).

    The app, the lessons, the presets, share links and the API all describe a side with
    this one type. The page's controls are its values at the page's edge
    (`pagekv.app.run_inputs.RunInputs`: a budget in % there, a fraction here).

        >>> a = Side.of("entropy", budget=0.1, mode="after")
        >>> a.config.budget, a.mode
        (0.1, 'after')
        >>> a.replace(policy="mean").config.policy, a.replace(mode="inside").mode
        ('mean', 'inside')
    """

    config: EvictionConfig = EvictionConfig()
    mode: str = "inside"

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be 'inside' or 'after'; got {self.mode!r}")

    @classmethod
    def of(cls, policy: str, mode: str = "inside", **settings) -> Side:
        """The side of policy `policy` with the `EvictionConfig` fields `settings`."""
        return cls(EvictionConfig(policy=policy, **settings), mode)

    def replace(self, mode: str | None = None, **settings) -> Side:
        """A copy with its question position and any `EvictionConfig` fields changed."""
        config = self.config.replace(**settings) if settings else self.config
        return Side(config, self.mode if mode is None else mode)


@dataclass
class Comparison:
    """Two sides (and the full cache) on one prompt.

    Each side is a `Side`: its `EvictionConfig` (`configs`) and its question position
    (`modes`); sides with the same position share one prefill. `prep` is side A's
    prompt (the full cache runs on it); `preps["B"]` is side B's.
    """

    prep: Prompt
    configs: dict  # "A", "B" -> EvictionConfig
    plans: dict  # "full", "A", "B" -> Plan (planning: the views draw them at once)
    curve: list  # UOR of head_independent across budgets
    memory: list  # cache kept per policy
    notes: list = field(default_factory=list)
    preps: dict = field(default_factory=dict)  # "A", "B" -> Prompt
    labels: dict = field(default_factory=dict)  # "A", "B" -> "A: entropy, page 16"
    model: str = ""  # the model that ran (`LoadedModel.name`; "bundled" when one fell back)
    #: "full", "A", "B" -> `RunResult`, each as its decode finishes (`Decoding`).
    records: dict = field(default_factory=dict)

    @property
    def modes(self) -> dict:
        return {k: p.spec.mode for k, p in self.preps.items()}

    def side(self, key: str) -> Side:
        """Side `key` ("A" or "B") as it ran."""
        return Side(self.configs[key], self.modes[key])

    def ran(self, spec: PromptSpec, a: Side, b: Side) -> bool:
        """Whether this comparison ran exactly the prompt `spec` (each side asked at
        its own position) and the sides `a` and `b`."""
        same_prompt = self.prep.spec == spec.replace(mode=a.mode)
        return same_prompt and (self.side("A"), self.side("B")) == (a, b)

    def needle_positions_of(self, key: str) -> list[int]:
        prep = self.preps.get(key, self.prep) if key != "full" else self.prep
        return list(prep.needle_positions)

    @property
    def n_groups(self) -> int:
        return self.prep.prefill.n_groups

    def plan_of(self, key: str) -> Plan:
        return self.plans[key]

    def needle_retention_of(self, key: str) -> list | None:
        """`[L][G]` the needle's share that `key` keeps: what its decoded cache stored
        once it is decoded, what its plan keeps before; None without a needle."""
        if key in self.records:
            return self.records[key].needle_retention
        needle = self.needle_positions_of(key)
        return self.plans[key].needle_retention(needle).tolist() if needle else None

    def detached(self) -> Comparison:
        """A copy for keeping after decoding (a session's last run, a finished run's
        views in the study's result memo): each prompt's `Prefill` (its KV cache: about
        100 MB at 2000 tokens) is replaced by its `PrefillShape`, so that what the views
        keep never holds a prefill the prefill memo has let go. Views, `summary` and
        `export` work on it; planning and decoding need the full comparison."""
        shapes = {}

        def light(prep: Prompt) -> Prompt:
            if id(prep) not in shapes:
                pre = prep.prefill
                shape = PrefillShape(
                    n=int(pre.n), n_groups=int(pre.n_groups), n_layers=int(pre.n_layers),
                    token_bytes=int(pre.token_bytes),
                    question_ids=None if pre.question_ids is None else tuple(pre.question_ids),
                )  # fmt: skip
                shapes[id(prep)] = replace(prep, prefill=shape)
            return shapes[id(prep)]

        return replace(
            self,
            prep=light(self.prep),
            preps={k: light(p) for k, p in self.preps.items()},
            notes=list(self.notes),
        )


@dataclass(frozen=True)
class PrefillShape:
    """What the views need of a prefill once decoding is done: its length, its layers,
    KV groups and bytes a token (`Prefill.token_bytes`), and its question's ids
    (`Comparison.detached`)."""

    n: int
    n_groups: int
    n_layers: int
    token_bytes: int
    question_ids: tuple | None


#: What a side's label names when it differs between A and B (field, how to show it);
#: the first `METHOD_FIELDS` of them are, with the policy, each side's own method (the
#: app's "Same settings as A" links the rest).
SIDE_FIELDS = (
    ("scorer", lambda c, m: f"{c.scorer} scorer"),
    ("allocation", lambda c, m: f"{c.allocation} budget"),
    ("page_size", lambda c, m: f"page {c.page_size}"),
    ("budget", lambda c, m: f"budget {100 * c.budget:g}%"),
    ("mode", lambda c, m: f"question {m}"),
    ("tau", lambda c, m: f"tau {c.tau:g}"),
    ("n_sink", lambda c, m: f"n_sink {c.n_sink}"),
    ("window", lambda c, m: f"window {c.window}"),
    ("smoothing", lambda c, m: f"smoothing {c.smoothing}"),
    ("page_reduction", lambda c, m: f"page {c.page_reduction}"),
)
METHOD_FIELDS = ("scorer", "allocation")


def side_labels(a: Side, b: Side) -> dict:
    """Column titles that say what differs: the policy always, then every setting in
    which the two sides differ, e.g. `{"A": "A: entropy, page 16", "B": "B: entropy,
    page 1"}`."""
    return {
        key: f"{key}: " + ", ".join([side.config.policy] + differing(side, other))
        for key, side, other in (("A", a, b), ("B", b, a))
    }


def differing(side: Side, other: Side, skip=()) -> list[str]:
    """How `side` shows each `SIDE_FIELDS` setting in which it differs from `other`,
    leaving out the fields named in `skip`."""
    out = []
    for name, show in SIDE_FIELDS:
        mine = side.mode if name == "mode" else getattr(side.config, name)
        theirs = other.mode if name == "mode" else getattr(other.config, name)
        if name not in skip and mine != theirs:
            out.append(show(side.config, side.mode))
    return out


def preview_comparison(
    study: Study,
    spec: PromptSpec,
    a: Side,
    b: Side,
    cached_only: bool = False,
) -> Comparison:
    """Everything but decoding: prefill (memoised), then plan both sides.

    The prompt is `spec`, each side asked at its own position (`Side.mode`); sides
    asked alike share one prefill. Its `plans` are what planning alone knows (the
    budget, the union tokens, the needle retention of the kept sets), so every plan
    view can be drawn at once, e.g. while a slider is dragged; `Decoding` then fills in
    `records`, the answers. Raises BudgetError when a side's protected pages exceed its
    budget (from its plan: `plan` checks the budget before any work on the device, the
    one check). With
    `cached_only`, only prefills already in memory are used (LookupError otherwise):
    planning then never waits for the model.
    """
    modes = {"A": a.mode, "B": b.mode}
    prepare = study.prepared if cached_only else study.prepare
    preps = {k: prepare(spec.replace(mode=m)) for k, m in modes.items()}
    configs = {"A": a.config, "B": b.config}
    full = EvictionConfig(policy="full")
    sides = (("full", preps["A"], full), *((k, preps[k], configs[k]) for k in "AB"))
    # On the model worker, once per prompt and configuration.
    plans = {key: study.plan(prep, cfg) for key, prep, cfg in sides}
    return Comparison(
        prep=preps["A"],
        configs=configs,
        plans=plans,
        curve=uor_rows(study, preps["B"], b.config),
        memory=memory_rows(study, preps["B"], b.config),
        notes=mode_notes(modes) + answer_notes(spec),
        preps=preps,
        labels=side_labels(a, b),
        model=study.loaded.name,
    )


def answer_notes(spec: PromptSpec) -> list[str]:
    """A custom prompt whose expected answer is not in its needle sentence: the run goes
    on, and the status says what that means for the verdict and the needle figures."""
    if spec.task != "custom" or not spec.needle or not spec.answer:
        return []
    if spec.answer.strip().lower() in spec.needle.lower():
        return []
    return [
        "The expected answer does not appear in the needle sentence: the verdict checks the "
        "answer, while 'needle kept' and 'needle pages' follow the needle sentence, so the "
        "two may disagree."
    ]


def mode_notes(modes: dict) -> list[str]:
    """What the status says about where each side asks its question: nothing when both
    ask after compression (the strict test); which side asks inside otherwise."""
    inside = [k for k in ("A", "B") if modes[k] == "inside"]
    head_start = "the first answer token comes from the prefill, which saw the whole prompt"
    if len(inside) == 2:
        return [f"Question inside the prompt: {head_start}; choose 'after' for the strict test."]
    if len(inside) == 1:
        side, other = inside[0], "B" if inside[0] == "A" else "A"
        return [
            f"Side {side} asks the question inside the prompt ({head_start}); side {other} "
            "asks it after compression, the strict test."
        ]
    return []


class Decoding:
    """The decoding of a planned comparison, queued on the model worker at once (the
    model decodes while the caller draws the plan views): the full cache, then A and B
    (one batched pass where they share a prompt and a shape). `stream` waits for it,
    filling `comp.records` in place. Nothing here holds a lock or starts a thread."""

    def __init__(self, study: Study, comp: Comparison, max_new_tokens: int | None = None):
        self.study, self.comp = study, comp
        cfg_a, cfg_b = comp.configs["A"], comp.configs["B"]
        self.full = study.submit_run(comp.prep, EvictionConfig(policy="full"), max_new_tokens)
        self.pair = self.sides = None
        if comp.preps["A"].spec == comp.preps["B"].spec:
            self.pair = study.submit_pair(comp.prep, cfg_a, cfg_b, max_new_tokens)
        else:
            self.sides = (
                study.submit_run(comp.preps["A"], cfg_a, max_new_tokens),
                study.submit_run(comp.preps["B"], cfg_b, max_new_tokens),
            )

    def stream(self, poll_s: float = 0.25):
        """Yield `(tokens_a, tokens_b)` at most every `poll_s` seconds while a shared
        pass decodes; return once every record is in `comp.records`. Errors of the
        jobs are raised here."""
        wait, records = self.study.worker.wait, self.comp.records
        wait(self.full)
        records["full"] = served_copy(self.full.result()[0])
        if self.pair is None:
            for key, job in zip("AB", self.sides, strict=True):
                wait(job)
                records[key] = served_copy(job.result()[0])
            return
        yield from self.study.worker.progress(self.pair, poll_s)
        rec_a, rec_b = self.pair.result()
        records["A"], records["B"] = served_copy(rec_a), served_copy(rec_b)


def compare(
    study: Study, spec: PromptSpec, a: Side, b: Side, max_new_tokens: int | None = None
) -> Comparison:
    """Prefill the prompt (memoised), then decode the full cache, side A and side B.

    Each side asks at its own position (`Side.mode`); sides asked the same way share
    one prefill; the full cache runs on side A's prompt. Sides on one prompt decode
    together in one batched pass when their kept caches have the same shape
    (`Decoding`).
    """
    comp = preview_comparison(study, spec, a, b)
    for _ in Decoding(study, comp, max_new_tokens).stream(poll_s=0.1):
        pass
    return comp


def uor_rows(study: Study, prep: Prompt, base: EvictionConfig) -> list[dict]:
    """Head-independent UOR at `CURVE_BUDGETS` (plan only: no decoding), planned on the
    model worker with `base`'s scorer and geometry (per-head selection has no global
    allocation: always uniform). It does not depend on `base`'s budget or policy: kept
    in the plan memo (`Study.derive`: a dragged budget slider plans it once)."""
    first = _head_independent(base, CURVE_BUDGETS[0])
    rows = study.derive(prep, ("uor_rows", first), lambda p: _uor_rows(study, p, base))
    return [dict(row) for row in rows]


def _plan_summary(study: Study, prep: Prompt, cfg: EvictionConfig) -> dict:
    """What the derived rows read of a plan (its UOR and stored tokens, `[L, G]` each),
    planned once per prompt and configuration: from the plan memo where a side planned
    it (`Study.plan(..., keep=False)`), else planned and its summary kept in the plan memo
    (`Study.derive`), so that the curve and the memory rows share the configurations they
    both need."""

    def summary(p: Prompt) -> dict:
        planned = study.plan(p, cfg, keep=False)
        return {"uor": planned.uor, "union_tokens": planned.union_tokens}

    return study.derive(prep, ("plan-summary", cfg), summary)


def _head_independent(base: EvictionConfig, budget: float) -> EvictionConfig:
    return base.replace(policy="head_independent", budget=budget, allocation="uniform")


def _uor_rows(study: Study, prep: Prompt, base: EvictionConfig) -> list[dict]:
    rows = []
    for b in CURVE_BUDGETS:
        try:
            uor = _plan_summary(study, prep, _head_independent(base, b))["uor"]
        except BudgetError:  # infeasible at this budget: a row without numbers
            uor = None
        rows.append(
            {
                "budget": b,
                "feasible": uor is not None,
                "uor_mean": None if uor is None else float(uor.mean()),
                "uor_max": None if uor is None else float(uor.max()),
            }
        )
    return rows


def memory_rows(study: Study, prep: Prompt, base: EvictionConfig) -> list[dict]:
    """KV tokens and bytes each policy keeps at `base`'s budget (plan only, on the model
    worker, kept with the prefill).

    Bytes = stored (layer, group) tokens x head_dim x 2 (K and V) x the cache's element
    size: what the runner's decode cache stores for the prompt, each (layer, group) at
    its own length (`Runner.decode_cache`). Head-independent counts its unions: what a
    server must hold. Under `base`'s global allocation (pooled policies; per-head ones
    stay uniform) each (layer, group) stores its own share of the shared budget.
    """
    rows = study.derive(
        prep,
        ("memory", base.replace(policy="full")),
        lambda p: _memory_rows(study, p, base),
    )
    return [dict(row) for row in rows]


def _memory_rows(study: Study, prep: Prompt, base: EvictionConfig) -> list[dict]:
    pre = prep.prefill
    per_token = pre.head_dim * 2 * pre.cache.layers[0].keys.element_size()
    rows = []
    for policy in POLICIES:
        per_head = get_policy(policy).per_head
        cfg = base.replace(policy=policy, allocation="uniform" if per_head else base.allocation)
        try:
            p = _plan_summary(study, prep, cfg)
        except BudgetError:
            continue
        stored = p["union_tokens"]
        rows.append(
            {
                "policy": policy,
                "label": policy  # the full cache is not planned: no scorer, no allocation
                if policy == "full"
                else f"{policy}<br>{cfg.scorer}, {cfg.allocation}",
                "tokens": int(stored.float().mean().round()),
                "bytes": int(stored.sum()) * per_token,
            }
        )
    return rows


def summary(comp: Comparison) -> dict:
    """The run's numbers, JSON-ready (what the Export button writes)."""
    out = {
        "spec": comp.records["full"].spec,
        "task": comp.prep.task.name,
        "question": comp.prep.task.question,
        "expected": comp.prep.task.answer,
        "prompt_tokens": comp.prep.n,
        "needle_positions": comp.prep.needle_positions,
        "notes": comp.notes,
        "runs": {key: rec.to_dict() for key, rec in comp.records.items()},
        "uor_curve": comp.curve,
        "memory": comp.memory,
    }
    pb = comp.plan_of("B")
    out["sink_advantage"] = {
        name: summarize_sink_advantage(sink_advantage(w, pb.sink_heads, comp.n_groups))
        for name, w in (("isolated", pb.weights_isolated), ("no_isolation", pb.weights_nosink))
    }
    out["head_weights"] = {
        "isolated": pb.weights_isolated.tolist(),
        "no_isolation": pb.weights_nosink.tolist(),
        "sink_mass": pb.sink_mass.tolist(),
    }
    return out


#: The columns of `pagekv_run.csv`, and the result's `[L][G]` lists its middle four read.
CSV_COLUMNS = (
    "run policy layer group budget_tokens union_tokens stored_tokens padding_tokens uor "
    "needle_retention"
).split()
CSV_PER_GROUP = ("union_tokens", "stored_tokens", "padding_tokens", "uor_per_group")


def export_data(comp: Comparison, folder: str) -> list[str]:
    """Write `pagekv_run.json` (`summary`) and `pagekv_run.csv` (one row per run x layer
    x group) into `folder`; their paths. (The app's Export adds the figures:
    `pagekv.app.run_figures.export`.)"""
    os.makedirs(folder, exist_ok=True)
    js = os.path.join(folder, "pagekv_run.json")
    with open(js, "w") as f:
        json.dump(summary(comp), f, indent=1)
    cs = os.path.join(folder, "pagekv_run.csv")
    with open(cs, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_COLUMNS)
        for key, rec in comp.records.items():
            p: Plan = rec.plan
            ret = rec.needle_retention
            for layer in range(p.keep.shape[0]):
                for g in range(p.keep.shape[1]):
                    per_group = [getattr(rec, k)[layer][g] for k in CSV_PER_GROUP]
                    needle = "" if ret is None else ret[layer][g]
                    w.writerow([key, rec.policy, layer, g, rec.budget_tokens, *per_group, needle])
    return [js, cs]
