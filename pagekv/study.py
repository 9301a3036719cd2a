"""One model, many prompts, many eviction configurations: the engine of the CLI,
the app and the replay harness.

    study = Study.load("bundled")
    prep = study.prepare(PromptSpec(task="needle", context_tokens=2000, depth=0.5))
    out = study.run(prep, EvictionConfig(policy="entropy", budget=0.2))
    out["answer"], out["correct"]

`prepare` tokenizes and prefills once (memoised per spec); `run` only plans,
compacts a copy of the cache and decodes (DESIGN.md section 3).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, replace

from .config import EvictionConfig
from .models import LoadedModel, load_model
from .result import RunResult
from .runner import Prefill, Runner
from .tasks import (
    Task,
    TaskError,
    check_custom_prompt,
    get_task,
    make_custom_task,
    make_multi_needle_task,
    make_needle_task,
    score,
)

PROMPT_TASKS = ("needle", "qa", "code", "custom")
MODES = ("inside", "after")
#: Window queries captured at prefill: every config.window up to this reuses it.
WINDOW_MAX = 128


@dataclass(frozen=True)
class PromptSpec:
    """What prompt to build.

    task: "needle" (generated haystack), "qa" / "code" (curated; `name` picks one,
    default the first), or "custom" (`haystack`, `needle`, `question`, `answer`;
    with `depth` the needle is inserted, with `depth=None` it must already be in
    the haystack). `n_needles > 1` adds distractor needles of the same form.
    `mode`: "inside" (question in the prompt) or "after" (asked after compression).
    """

    task: str = "needle"
    context_tokens: int = 2000
    depth: float | None = 0.5
    seed: int = 0
    n_needles: int = 1
    name: str | None = None
    haystack: str | None = None
    needle: str | None = None
    question: str | None = None
    answer: str | None = None
    mode: str = "inside"

    def __post_init__(self):
        if self.task not in PROMPT_TASKS:
            raise ValueError(f"task must be one of {', '.join(PROMPT_TASKS)}; got {self.task!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be 'inside' or 'after'; got {self.mode!r}")
        if self.task == "needle":
            if not isinstance(self.context_tokens, int) or self.context_tokens < 64:
                raise ValueError(f"context must be at least 64 tokens; got {self.context_tokens}")
            if self.depth is None or not 0.0 <= self.depth <= 1.0:
                raise ValueError(f"depth must be in [0, 1]; got {self.depth}")
            if not 1 <= self.n_needles <= 4:
                raise ValueError(f"needles must be 1 to 4; got {self.n_needles}")
            check_custom_prompt(None, self.needle, self.question, self.answer, need_haystack=False)
        if self.task == "custom":
            check_custom_prompt(self.haystack, self.needle, self.question, self.answer)

    def replace(self, **kw) -> PromptSpec:
        return replace(self, **kw)


@dataclass
class Prepared:
    """A tokenized, prefilled prompt, reusable for any number of `Study.run` calls."""

    spec: PromptSpec
    task: Task
    prompt: dict  # Task.build_prompt_ids output
    prefill: Prefill
    needle_positions: list[int]
    prepare_s: float

    @property
    def n(self) -> int:
        return self.prefill.n


class Study:
    """A loaded model with its runner and a small memo of prefilled prompts."""

    def __init__(self, loaded: LoadedModel, backend: str = "auto", memo_size: int = 4):
        self.loaded = loaded
        self.runner = Runner(loaded.model, loaded.tokenizer, backend=backend)
        self._memo: OrderedDict[PromptSpec, Prepared] = OrderedDict()
        self._full: OrderedDict[tuple, dict] = OrderedDict()
        self.memo_size = memo_size

    @classmethod
    def load(
        cls, model: str = "bundled", backend: str = "auto", allow_fallback: bool = True, **kw
    ) -> Study:
        return cls(load_model(model, allow_fallback=allow_fallback, **kw), backend=backend)

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    @property
    def max_prompt_tokens(self) -> int:
        return int(self.loaded.max_context)

    def make_task(self, spec: PromptSpec) -> Task:
        tok = self.tokenizer
        if spec.task == "needle":
            if spec.n_needles > 1:
                return make_multi_needle_task(
                    tok,
                    n_needles=spec.n_needles,
                    context_tokens=spec.context_tokens,
                    seed=spec.seed,
                    question_position=spec.mode,
                )
            return make_needle_task(
                tok,
                context_tokens=spec.context_tokens,
                depth=spec.depth,
                seed=spec.seed,
                needle=spec.needle,
                question=spec.question,
                answer=spec.answer,
                haystack=spec.haystack,
                question_position=spec.mode,
            )
        if spec.task in ("qa", "code"):
            from .tasks import task_names

            names = task_names(spec.task)
            name = spec.name or names[0]
            if name not in names:
                choices = ", ".join(names)
                raise TaskError(f"unknown {spec.task} task {name!r}; choose from {choices}")
            task = get_task(name)
            task.meta["question_position"] = spec.mode
            return task
        task = make_custom_task(
            spec.haystack, spec.needle, spec.question, spec.answer, depth=spec.depth
        )
        task.meta["question_position"] = spec.mode
        return task

    def prepare(self, spec: PromptSpec) -> Prepared:
        """Tokenize and prefill `spec` once (memoised: the same spec reuses the prefill)."""
        if spec in self._memo:
            self._memo.move_to_end(spec)
            return self._memo[spec]
        t0 = time.perf_counter()
        task = self.make_task(spec)
        prompt = task.build_prompt_ids(self.tokenizer, mode=spec.mode)
        total = len(prompt["input_ids"])
        if total > self.max_prompt_tokens:
            raise TaskError(
                f"the prompt has {total} tokens, more than the model's context of "
                f"{self.max_prompt_tokens}; shorten it"
            )
        if spec.mode == "after":
            pre = self.runner.prefill(
                prompt["context_ids"], window_max=WINDOW_MAX, question_ids=prompt["question_ids"]
            )
        else:
            pre = self.runner.prefill(prompt["input_ids"], window_max=WINDOW_MAX)
        prep = Prepared(
            spec=spec,
            task=task,
            prompt=prompt,
            prefill=pre,
            needle_positions=list(prompt.get("needle_token_positions") or []),
            prepare_s=time.perf_counter() - t0,
        )
        self._memo[spec] = prep
        while len(self._memo) > self.memo_size:
            self._memo.popitem(last=False)
        return prep

    def run(self, prep: Prepared, config: EvictionConfig, max_new_tokens: int = 24) -> dict:
        """Evict under `config`, decode, score. Returns a JSON-ready dict (plus `plan`)."""
        if config.window > WINDOW_MAX and config.window < prep.n:
            raise ValueError(f"window must be at most {WINDOW_MAX} tokens; got {config.window}")
        res = self.runner.evaluate(
            prep.prefill,
            config,
            max_new_tokens=max_new_tokens,
            needle_positions=prep.needle_positions or None,
        )
        return result_record(res, prep, self.loaded)

    def run_full(self, prep: Prepared, max_new_tokens: int = 24) -> dict:
        """`run` with the full cache, memoised per prompt (it ignores every budget knob)."""
        key = (prep.spec, max_new_tokens)
        if key not in self._full:
            self._full[key] = self.run(prep, EvictionConfig(policy="full"), max_new_tokens)
            while len(self._full) > 2 * self.memo_size:
                self._full.popitem(last=False)
        return self._full[key]


def result_record(res: RunResult, prep: Prepared, loaded: LoadedModel) -> dict:
    """Complete `res` with the task and its score, and return its JSON object
    (`RunResult.to_dict()`, the schema of docs/schema.md) with the `Plan` under the
    key `plan` for the views."""
    s = score(res.answer, prep.task)
    res.model = loaded.name
    res.task = prep.task.name
    res.task_kind = prep.task.kind
    res.question = prep.task.question
    res.expected = prep.task.answer
    res.correct = bool(s["correct"])
    res.score = s
    res.needle_positions = list(prep.needle_positions)
    res.spec = asdict(prep.spec) | {"haystack": None}
    res.timings = dict(res.timings, load_s=float(loaded.load_s))
    d = res.to_dict()
    d["plan"] = res.plan
    return d
