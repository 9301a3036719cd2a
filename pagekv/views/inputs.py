"""The run's inputs checked and turned into settings, for the page and the API alike.

Every control's value is checked in plain words (`InputError` names the control and
the range), so that a request with a wrong value becomes a message, never a traceback.

    spec, cfg_a, cfg_b, mode_a, mode_b, layer = parse_run(values)
"""

from __future__ import annotations

import math

from pagekv.maths.config import ALLOCATIONS, POLICIES, SCORERS, EvictionConfig
from pagekv.maths.paging import min_feasible_budget
from pagekv.serving.study import MODES, PROMPT_TASKS, WINDOW_MAX, PromptSpec
from pagekv.tasks import needle_depth, task_names

__all__ = ["ALLOCATIONS", "LIMITS", "MODES", "PAGE_SIZES", "SCORERS", "TASKS", "parse_run"]

#: Page sizes offered by the page and accepted by the API.
PAGE_SIZES = [1, 4, 8, 16, 32, 64]
#: The longest needle context the page offers (tokens).
MAX_CONTEXT = 8000
TASKS = PROMPT_TASKS
#: Every numeric control's range and step, for the page's sliders and the API alike
#: (one place: a typed value, a slider and a request accept the same values). The
#: budget's lower limit on the page is raised after each run to the smallest feasible
#: budget of that prompt and those settings (`min_budget_pct`); below it a request gets
#: a message naming that limit.
LIMITS = {
    "context": (100, MAX_CONTEXT, 100),
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


def _bound(v: float) -> str:
    """A range limit as a person writes it: whole numbers in full (2147483647, never
    2.14748e+09), others as short as they read."""
    return str(int(v)) if float(v).is_integer() else f"{v:g}"


def _num(name: str, value, lo: float, hi: float, integer: bool = False):
    """`value` as a number in [lo, hi], or an InputError that names the control."""
    span = f"from {_bound(lo)} to {_bound(hi)}"
    if isinstance(value, bool) or value is None:
        raise InputError(f"{name} must be a number {span}; got {value!r}")
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise InputError(f"{name} must be a number {span}; got {value!r}") from None
    if x != x or not lo <= x <= hi or (integer and x != int(x)):
        kind = "a whole number" if integer else "a number"
        raise InputError(f"{name} must be {kind} {span}; got {value!r}")
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


def parse_run(v: dict):
    """The run's raw inputs (the API's and the page's alike) -> `(spec, cfg_a, cfg_b,
    mode_a, mode_b, layer)`; InputError names the control that is wrong."""
    task = _choice("task", v["task"], TASKS)
    mode = _choice("question position", v["mode"], MODES)
    kw = dict(
        task=task,
        context_tokens=_num("context length", v["context"], *_span("context"), integer=True),
        depth=_num("needle depth", v["depth"], *_span("depth")),
        seed=_num("seed", v["seed"], *_span("seed"), integer=True),
        n_needles=_num("needles", v["needles"], *_span("needles"), integer=True),
        mode=mode,
    )
    if task in ("qa", "code"):
        name = v["curated"] or None
        if name is not None:
            _choice(f"curated {task} task", name, task_names(task))
        kw["name"] = name
    if task == "custom":
        texts = {k: _text(k, v[k]) for k in ("haystack", "needle", "question", "answer")}
        kw.update(texts)
        kw["depth"] = needle_depth(texts["haystack"], texts["needle"], kw["depth"])
    spec = PromptSpec(**kw)
    cfg_a = _method(_side_config(v, ""), v, "A")
    if _flag("same settings as A", v["link_b"]):
        cfg_b, mode_b = _method(cfg_a, v, "B"), mode
    else:
        cfg_b = _method(_side_config(v, "_b"), v, "B")
        mode_b = _choice("question position B", v["mode_b"], MODES)
    layer = _num("layer", v["layer"], *_span("layer"), integer=True)
    return spec, cfg_a, cfg_b, mode, mode_b, layer


def _method(cfg: EvictionConfig, v: dict, side: str) -> EvictionConfig:
    """`cfg` with side `side`'s own method: its policy, scorer and allocation."""
    s = side.lower()
    policy = _choice(f"policy {side}", v[f"policy_{s}"], POLICIES)
    scorer = _choice(f"scorer {side}", v[f"scorer_{s}"], SCORERS)
    allocation = _choice(f"allocation {side}", v[f"allocation_{s}"], ALLOCATIONS)
    try:
        return cfg.replace(policy=policy, scorer=scorer, allocation=allocation)
    except ValueError as e:  # e.g. a global budget for a per-head policy
        raise InputError(f"side {side}: {e}") from None


def _side_config(v: dict, suffix: str) -> EvictionConfig:
    side = "B" if suffix else "A"
    return EvictionConfig(
        budget=_num(
            f"budget {side} (%)", v["budget_b" if suffix else "budget_pct"], *_span("budget")
        )
        / 100.0,
        page_size=_page_size(f"page size {side}", v["page_size" + suffix]),
        n_sink=_num(f"n_sink {side}", v["n_sink" + suffix], *_span("n_sink"), integer=True),
        window=_num(f"window {side}", v["window" + suffix], *_span("window"), integer=True),
        tau=_num(f"tau {side}", v["tau" + suffix], *_span("tau")),
    )


def _span(name: str) -> tuple:
    lo, hi, _step = LIMITS[name]
    return lo, hi


def min_budget_pct(n: int, cfg: EvictionConfig) -> float:
    """The smallest budget (in %, on the page's step) whose `floor(beta n)` tokens hold
    the protected pages of an `n`-token prompt under `cfg` (sinks and window)."""
    lo, hi, step = LIMITS["budget"]
    need = min_feasible_budget(n, cfg.page_size, cfg.n_sink, cfg.window) * 100
    return min(hi, max(lo, math.ceil(need / step - 1e-9) * step))
