"""The run's inputs at the page's edge: what they are, their ranges, and how they are
read into a prompt and two sides, for the page and the API alike.

`RunInputs` is the one place they are written, as one dataclass in the API's order.
The `/run` handler's signature is made from its fields (`takes_run_inputs`), so Gradio
lists them by name and passes them by position; a lesson, a preset and a link each
build one (`RunInputs.for_sides`, `RunInputs.replace`) instead of a dict of their own.
The values are raw, as a control sends them (budgets in %).

    >>> RunInputs().budget_pct, RunInputs().replace(budget_pct=30).budget_pct
    (20.0, 30)
    >>> list(RUN_DEFAULTS)[:3]
    ['model', 'task', 'context']

`parse_run` checks every value in plain words (`InputError` names the control and the
range), so that a request with a wrong value becomes a message, never a traceback, and
reads them back into the prompt and two `pagekv.engine.comparison.Side`s (budgets as fractions):

    spec, a, b, layer = parse_run(values)

A budget has one rule, on the page and in the API alike: a number from the smallest
budget whose protected pages fit the prompt (`min_budget_pct`, which needs the
prompt's length) up to 100. `parse_run` refuses what is not a number in (0, 100];
`check_budgets` refuses what is below the prompt's floor once its length is known.
Both raise `BudgetInputError`, whose `for_prompt(n)` says the rule in one sentence
with that floor (`budget_rule`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math

from pagekv.engine.comparison import METHOD_FIELDS, MODES, Side
from pagekv.engine.study import PROMPT_TASKS, WINDOW_MAX, PromptSpec
from pagekv.maths.config import ALLOCATIONS, POLICIES, SCORERS, EvictionConfig
from pagekv.maths.paging import min_feasible_budget
from pagekv.tasks import needle_depth, task_names

__all__ = [
    "ALLOCATIONS", "LIMITS", "MODES", "PAGE_SIZES", "RUN_DEFAULTS", "SCORERS",
    "TASKS", "BudgetInputError", "InputError", "RunInputs",
    "as_number", "budget_pct", "budget_rule", "check_budgets", "nearest_in_range", "parse_run",
    "takes_run_inputs",
]  # fmt: skip

#: What makes a side's method: its policy and the comparison's own method fields.
METHODS = ("policy", *METHOD_FIELDS)


@dataclasses.dataclass(frozen=True)
class RunInputs:
    """Every run input, with its default. Side A is the shared controls with policy,
    scorer and allocation A; side B its own method and, unless `link_b`, its own
    settings (`mode_b`, `budget_b`, ...). Budgets are in % of the prompt. The scorer
    and allocation come last, so a caller listing the inputs by position from before
    they existed still gets the defaults."""

    model: str = "bundled"
    task: str = "needle"
    context: int = 2000
    depth: float = 0.5
    seed: int = 0
    needles: int = 1
    mode: str = "inside"
    curated: str | None = None
    haystack: str = ""
    needle: str = ""
    question: str = ""
    answer: str = ""
    budget_pct: float = 20.0
    page_size: int = 16
    n_sink: int = 4
    window: int = 32
    tau: float = 1.0
    policy_a: str = "mean"
    policy_b: str = "entropy"
    link_b: bool = True
    mode_b: str = "inside"
    budget_b: float = 20.0
    page_size_b: int = 16
    n_sink_b: int = 4
    window_b: int = 32
    tau_b: float = 1.0
    layer: int = 0
    lesson: str | None = None
    scorer_a: str = "window"
    allocation_a: str = "uniform"
    scorer_b: str = "window"
    allocation_b: str = "uniform"

    def replace(self, **changes) -> RunInputs:
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def for_sides(
        cls, prompt: PromptSpec, a: Side, b: Side, *, model: str, layer: int = 0, lesson=None
    ) -> RunInputs:
        """The inputs that run `prompt` with sides `a` and `b`, budgets in % as the page
        shows them. B follows A ("Same settings as A") when the two differ only in their
        method, so that moving A's controls moves B's too."""
        ca, cb = a.config, b.config
        linked = a.replace(**{m: getattr(cb, m) for m in METHODS}) == b
        return cls(
            model=model, task=prompt.task, context=prompt.context, depth=prompt.depth,
            seed=prompt.seed, needles=prompt.needles, mode=a.mode, curated=prompt.curated,
            budget_pct=round(100 * ca.budget, 1), page_size=ca.page_size, n_sink=ca.n_sink,
            window=ca.window, tau=ca.tau, policy_a=ca.policy, policy_b=cb.policy, link_b=linked,
            mode_b=b.mode, budget_b=round(100 * cb.budget, 1), page_size_b=cb.page_size,
            n_sink_b=cb.n_sink, window_b=cb.window, tau_b=cb.tau, layer=layer, lesson=lesson,
            scorer_a=ca.scorer, allocation_a=ca.allocation, scorer_b=cb.scorer,
            allocation_b=cb.allocation,
        )  # fmt: skip


#: The run's inputs in the API's order, with their defaults.
RUN_DEFAULTS = {f.name: f.default for f in dataclasses.fields(RunInputs)}


def takes_run_inputs(request_type, name: str):
    """A decorator: the generator `fn(inputs: RunInputs, request)` is called as Gradio
    calls it, with every run input by name or position and then `request` (annotated
    `request_type`, so Gradio passes its request there), under the function name
    `name` (what Gradio's queue and logs call it)."""
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    params = [inspect.Parameter(n, kind, default=d) for n, d in RUN_DEFAULTS.items()]
    params.append(inspect.Parameter("request", kind, default=None, annotation=request_type))
    signature = inspect.Signature(params)

    def decorate(fn):
        def handler(*args, **kwargs):  # a generator, as fn: Gradio streams its steps
            bound = signature.bind(*args, **kwargs)
            request = bound.arguments.pop("request", None)
            yield from fn(RunInputs(**bound.arguments), request)

        functools.update_wrapper(handler, fn)
        del handler.__wrapped__  # the signature is the inputs', not fn's
        handler.__name__ = handler.__qualname__ = name
        handler.__signature__ = signature
        handler.__annotations__ = {"request": request_type}
        return handler

    return decorate


# ------------------------------------------------------------------ read and checked

#: Page sizes offered by the page and accepted by the API.
PAGE_SIZES = [1, 4, 8, 16, 32, 64]
#: The longest needle context the page offers (tokens).
MAX_CONTEXT = 8000
TASKS = PROMPT_TASKS
#: Every numeric control's range and step, for the page's sliders and the API alike
#: (one place: a typed value, a slider and a request accept the same values). The
#: budget's lower limit on the page is raised after each run to the smallest feasible
#: budget of that prompt and those settings (`min_budget_pct`); below it a request gets
#: a message naming that limit (`budget_rule`). The shortest context is one whose
#: prompt the default budget fits (20 %, pages of 16, 4 sinks, a 32-token window: its
#: protected pages need 16 %); the lessons' 10 % needs a context of at least 600
#: (tests/test_run_inputs.py checks both, as README.md says them).
LIMITS = {
    "context": (300, MAX_CONTEXT, 100),
    "depth": (0.0, 1.0, 0.05),
    "seed": (0, 2**31 - 1, 1),
    "needles": (1, 4, 1),
    "budget": (0.5, 100.0, 0.5),
    "n_sink": (0, 64, 1),
    "window": (1, WINDOW_MAX, 1),
    "tau": (0.1, 10.0, 0.1),
    "layer": (0, 1024, 1),
}


class InputError(ValueError):
    """A control's value has the wrong type or is out of range (API callers)."""


class BudgetInputError(InputError):
    """A budget outside its rule (`budget_rule`): `side` ("A" or "B"), the value `got`,
    the side's settings `cfg` (its budget aside) and the prompt `spec` it was for."""

    def __init__(self, side: str, got, cfg: EvictionConfig, spec: PromptSpec, n: int | None = None):
        self.side, self.got, self.cfg, self.spec, self.n = side, got, cfg, spec, n
        super().__init__(budget_rule(side, got, cfg, n))

    def for_prompt(self, n: int) -> BudgetInputError:
        """The same refusal, said with the floor of an `n`-token prompt."""
        return BudgetInputError(self.side, self.got, self.cfg, self.spec, n)


def shown_value(value) -> str:
    """A refused value as the message quotes it: numbers as typed (whole numbers in
    full), no number as "no number", a number too long to be read exactly (a browser
    keeps 15-17 digits) said so instead of echoed rounded."""
    if value is None or value == "":
        return "no number"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return repr(value)
    if value != value:
        return "no number"
    if abs(value) >= 2**53:
        return "a number too long to read exactly"
    return _bound(value)


def budget_rule(side: str, got, cfg: EvictionConfig, n: int | None = None) -> str:
    """The budget's one rule, in one sentence: a number from the smallest feasible
    budget of an `n`-token prompt at `cfg`'s pages, sinks and window up to 100 (% of
    the prompt); without `n`, the floor in words. The reason given is the limit `got`
    is past: the protected pages below the floor, the whole prompt above 100."""
    tail = f"; got {shown_value(got)}."
    if as_number(got) > 100:  # the upper limit's reason, not the floor's
        lowest = "the smallest budget whose protected pages fit the prompt"
        if n is not None:
            lowest = _bound(min_budget_pct(n, cfg))
        prompt = "the prompt" if n is None else f"this {n}-token prompt"
        return (
            f"Budget {side} must be a number from {lowest} to 100 (% of the prompt): 100 % "
            f"keeps the whole of {prompt}, and no budget keeps more{tail}"
        )
    if n is None:
        return (
            f"Budget {side} must be a number from the smallest budget whose protected pages "
            f"fit the prompt up to 100 (% of the prompt){tail}"
        )
    floor = min_budget_pct(n, cfg)
    return (
        f"Budget {side} must be a number from {_bound(floor)} to 100 (% of the prompt): below "
        f"{_bound(floor)} % the protected pages (the first {cfg.n_sink} tokens and the last "
        f"{cfg.window}, in pages of {cfg.page_size}) do not fit in this {n}-token "
        f"prompt{tail}"
    )


def _bound(v: float) -> str:
    """A range limit as a person writes it: whole numbers in full (2147483647, never
    2.14748e+09), others as short as they read."""
    return str(int(v)) if float(v).is_integer() else f"{v:g}"


def as_number(value) -> float:
    """`value` read as a number (a number, or text that reads as one); NaN for anything
    else (None, a flag, other text)."""
    if isinstance(value, bool) or value is None:
        return math.nan
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def nearest_in_range(value, lo: float, hi: float) -> tuple[float, str | None]:
    """`value` in `[lo, hi]`, as a slider's box leaves it once the box loses focus: the
    number itself, or the nearest end (`lo` for no number), with where it was: None
    (inside), "no number", "below" or "above"."""
    x = as_number(value)
    if x != x:
        return lo, "no number"
    if x < lo:
        return lo, "below"
    if x > hi:
        return hi, "above"
    return x, None


def _num(name: str, value, lo: float, hi: float, integer: bool = False):
    """`value` as a number in [lo, hi], or an InputError that names the control."""
    x = as_number(value)
    if x != x or not lo <= x <= hi or (integer and x != int(x)):
        kind = "a whole number" if integer else "a number"
        span = f"from {_bound(lo)} to {_bound(hi)}"
        raise InputError(f"{name} must be {kind} {span}; got {shown_value(value)}")
    return int(x) if integer else x


def _choice(name: str, value, choices):
    if value not in choices:
        raise InputError(f"{name} must be one of {', '.join(map(str, choices))}; got {value!r}")
    return value


def _text(name: str, value) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise InputError(f"{name} must be text; got {value!r}")
    return value


def _flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise InputError(f"{name} must be true or false; got {value!r}")
    return value


def _page_size(name: str, value) -> int:
    return _choice(name, _num(name, value, 1, max(PAGE_SIZES), integer=True), PAGE_SIZES)


def parse_run(v: RunInputs):
    """The run's raw inputs (the API's and the page's alike) -> `(spec, a, b, layer)`:
    the prompt (asked as side A asks), the two `Side`s and the layer shown; InputError
    names the control that is wrong."""
    task = _choice("task", v.task, TASKS)
    mode = _choice("question position", v.mode, MODES)
    kw = dict(
        task=task,
        context=_num("context length", v.context, *_span("context"), integer=True),
        depth=_num("needle depth", v.depth, *_span("depth")),
        seed=_num("seed", v.seed, *_span("seed"), integer=True),
        needles=_num("needles", v.needles, *_span("needles"), integer=True),
        mode=mode,
    )
    if task in ("qa", "code"):
        curated = v.curated or None
        if curated is not None:
            _choice(f"curated {task} task", curated, task_names(task))
        kw["curated"] = curated
    if task == "custom":
        texts = {k: _text(k, getattr(v, k)) for k in ("haystack", "needle", "question", "answer")}
        kw.update(texts)
        kw["depth"] = needle_depth(texts["haystack"], texts["needle"], kw["depth"])
    spec = PromptSpec(**kw)
    cfg_a, refused_a = _side_config(v, "")
    if _flag("same settings as A", v.link_b):
        (cfg_b, mode_b), refused_b = (_method(cfg_a, v, "B"), mode), False
    else:
        cfg_b, refused_b = _side_config(v, "_b")
        mode_b = _choice("question position B", v.mode_b, MODES)
    layer = _num("layer", v.layer, *_span("layer"), integer=True)
    # The budgets last: their message needs the side's other settings and the prompt.
    if refused_a:
        raise BudgetInputError("A", v.budget_pct, cfg_a, spec.replace(mode=mode))
    if refused_b:
        raise BudgetInputError("B", v.budget_b, cfg_b, spec.replace(mode=mode_b))
    return spec, Side(cfg_a, mode), Side(cfg_b, mode_b), layer


def check_budgets(sides) -> None:
    """`sides`: `(side, cfg, spec, n)` per side ("A" or "B", its `EvictionConfig`, its
    prompt, its length); BudgetInputError (with the floor of that prompt) for the first
    whose budget is below `min_budget_pct(n, cfg)`."""
    for side, cfg, spec, n in sides:
        if budget_pct(cfg) < min_budget_pct(n, cfg) - 1e-9:
            raise BudgetInputError(side, budget_pct(cfg), cfg, spec, n)


def budget_pct(cfg: EvictionConfig) -> float:
    """A side's budget as its box and its messages show it (% of the prompt)."""
    return round(100 * cfg.budget, 6)


def _method(cfg: EvictionConfig, v: RunInputs, side: str) -> EvictionConfig:
    """`cfg` with side `side`'s own method: its policy, scorer and allocation."""
    s = side.lower()
    policy = _choice(f"policy {side}", getattr(v, f"policy_{s}"), POLICIES)
    scorer = _choice(f"scorer {side}", getattr(v, f"scorer_{s}"), SCORERS)
    allocation = _choice(f"allocation {side}", getattr(v, f"allocation_{s}"), ALLOCATIONS)
    try:
        return cfg.replace(policy=policy, scorer=scorer, allocation=allocation)
    except ValueError as e:  # e.g. a global budget for a per-head policy
        raise InputError(f"side {side}: {e}") from None


def _budget(value) -> float | None:
    """A budget in % as a fraction, or None when it is no number in (0, 100]."""
    x = as_number(value)
    return x / 100.0 if 0 < x <= 100 else None


def _side_config(v: RunInputs, suffix: str) -> tuple[EvictionConfig, bool]:
    """A side's settings with its method (`_method`), and whether its budget is refused
    (1.0 then stands in, and `parse_run` raises for it once everything else is read)."""
    side = "B" if suffix else "A"
    budget = _budget(v.budget_b if suffix else v.budget_pct)

    def whole(name):
        return _num(f"{name} {side}", getattr(v, name + suffix), *_span(name), integer=True)

    cfg = EvictionConfig(
        budget=1.0 if budget is None else budget,
        page_size=_page_size(f"page size {side}", getattr(v, "page_size" + suffix)),
        n_sink=whole("n_sink"),
        window=whole("window"),
        tau=_num(f"tau {side}", getattr(v, "tau" + suffix), *_span("tau")),
    )
    return _method(cfg, v, side), budget is None


def _span(name: str) -> tuple:
    return LIMITS[name][:2]  # (lowest, highest): not the step


def min_budget_pct(n: int, cfg: EvictionConfig) -> float:
    """The smallest budget (in %, on the page's step) whose `floor(beta n)` tokens hold
    the protected pages of an `n`-token prompt under `cfg` (sinks and window)."""
    lo, hi, step = LIMITS["budget"]
    need = min_feasible_budget(n, cfg.page_size, cfg.n_sink, cfg.window) * 100
    return min(hi, max(lo, math.ceil(need / step - 1e-9) * step))
