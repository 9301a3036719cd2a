"""The run's inputs, as one dataclass: the API's and the page's, in the API's order.

`RunInputs` is the one place they are written. The `/run` handler's signature is made
from its fields (`takes_run_inputs`), so Gradio lists them by name and passes them by
position; a lesson, a preset and a link each build one (`RunInputs.for_sides`,
`RunInputs.replace`) instead of a dict of their own. The values are raw, as a control
sends them: `pagekv.app.inputs.parse_run` reads them and names a wrong one.

    >>> RunInputs().budget_pct, RunInputs().replace(budget_pct=30).budget_pct
    (20.0, 30)
    >>> list(RUN_DEFAULTS)[:3]
    ['model', 'task', 'context']
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

from pagekv.app.comparison import METHOD_FIELDS
from pagekv.app.side import Side
from pagekv.app.study import PromptSpec

__all__ = ["RUN_DEFAULTS", "RUN_INPUTS", "RunInputs", "takes_run_inputs"]

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
        return {name: getattr(self, name) for name in RUN_INPUTS}

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
            model=model, task=prompt.task, context=prompt.context_tokens, depth=prompt.depth,
            seed=prompt.seed, needles=prompt.n_needles, mode=a.mode, curated=prompt.name,
            budget_pct=round(100 * ca.budget, 1), page_size=ca.page_size, n_sink=ca.n_sink,
            window=ca.window, tau=ca.tau, policy_a=ca.policy, policy_b=cb.policy, link_b=linked,
            mode_b=b.mode, budget_b=round(100 * cb.budget, 1), page_size_b=cb.page_size,
            n_sink_b=cb.n_sink, window_b=cb.window, tau_b=cb.tau, layer=layer, lesson=lesson,
            scorer_a=ca.scorer, allocation_a=ca.allocation, scorer_b=cb.scorer,
            allocation_b=cb.allocation,
        )  # fmt: skip


#: The run's inputs in order, and their defaults (the API's too).
RUN_DEFAULTS = {f.name: f.default for f in dataclasses.fields(RunInputs)}
RUN_INPUTS = tuple(RUN_DEFAULTS)


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
