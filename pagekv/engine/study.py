"""One model, many prompts, many eviction configurations: the engine of the CLI,
the app and the replay harness.

    study = Study.load("bundled")
    prep = study.prepare(PromptSpec(task="needle", context=2000, depth=0.5))
    out = study.run(prep, EvictionConfig(policy="entropy", budget=0.2))
    out.answer, out.correct, out.to_dict()  # a RunResult; its JSON object

`prepare` tokenizes and prefills once (memoised per spec); `run` only plans,
compacts a copy of the cache and decodes (docs/design.md, "The data path"). Every
computation is a job on the model worker (`pagekv.engine.worker`; docs/design.md,
"One model worker").

Three memos, each bounded by bytes with least-recently-used eviction
(`pagekv.engine.memo.ByteLRU`), so that a shared server stays bounded and a class running
the same lesson costs one computation:

- prefills (`Study.prefills`, keyed by `PromptSpec`): sized by the prefill's KV cache,
  its window queries and its memoised scores (100 MiB for a 2000-token prompt of
  the bundled model in float32, about 370 MiB for 8000); default cap
  `PREFILL_MEMO_BYTES` (512 MiB);
- plans (`Study.plans`, keyed by the prompt and the `EvictionConfig`): what the
  views draw while a slider moves and what the run then compacts, so each run is
  planned once. The rows derived from many plans (a UOR curve, memory rows) read
  it and plan what it lacks without keeping it (`plan(..., keep=False)`), so they
  never crowd a run's own plans out; the rows themselves, and the small summaries of
  the plans they read, are kept here (`Study.derive`). The views drawn from plans live
  here too: a
  preview's plan views and the figures drawn once per content
  (`pagekv.app.run_figures`). Default cap `PLAN_MEMO_BYTES` (80 MiB);
- finished runs (`Study.results`): each side's `RunResult`, keyed by the prompt, the
  `EvictionConfig` and `max_new_tokens` (identical settings on an identical prompt
  are decoded once, and a comparison whose B changes reuses A's decode), about
  0.3 MiB each at 2000 tokens (mostly the plan's masks); and the app's drawn views
  of a finished comparison (`run_figures.view_key`: the detached comparison, its
  figures and its answers table, a few MiB at 2000 tokens), so a class running one
  lesson draws its figures once. Default cap `RESULT_MEMO_BYTES` (160 MiB).
  `run_full` goes through the same memo.

An entry that is a dict (the drawn views) is counted at its own `nbytes` (measuring a
plotly figure's objects would cost as much as drawing it); any other by `nbytes`.

Each memo has a kept part besides (`ByteLRU`'s `kept_bytes`): the prompts that
`keep_prompts` names (the app names the lessons' two) store their prefill, plans and
results there (not the views drawn from them), and no other prompt evicts them, so a
class opening a lesson after exploring long prompts gets it from memory. Its caps:
`KEPT_PREFILL_BYTES` (256 MiB, two 2000-token prompts of the bundled model with the
reconstruction pass's scores), `KEPT_PLAN_BYTES` and `KEPT_RESULT_BYTES` (32 MiB
each).

The defaults aim at an app under about 2.5 GB resident with the bundled model
(0.5 GiB once loaded): with a 640 MiB prefill cap, ten varied runs on 1000-8000-token
prompts left 2.24 GiB resident (peak 2.45 GiB, during an 8000-token prefill), hence
512 MiB (measured on the engine alone; the app adds Gradio and its requests).
`Study(..., prefill_memo_bytes=0, result_memo_bytes=0, plan_memo_bytes=0)` turns all
three off (benchmarks that time repeated runs).

Every `run` logs one INFO line (logger `pagekv.engine.study`) with its settings, the
backend and the timings, and whether it was computed or served from memory.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import logging
import time
from array import array
from collections.abc import Hashable
from dataclasses import asdict, dataclass, replace

from pagekv.engine.memo import ByteLRU, nbytes
from pagekv.engine.worker import WORKER, Job, ModelWorker
from pagekv.maths.config import EvictionConfig
from pagekv.maths.plan import Plan
from pagekv.runtime.models import LoadedModel, load_model
from pagekv.runtime.prefill import Prefill
from pagekv.runtime.result import RunResult
from pagekv.runtime.runner import Runner
from pagekv.tasks import (
    Task,
    TaskError,
    check_custom_prompt,
    curated_name,
    default_max_new_tokens,
    get_task,
    make_custom_task,
    make_multi_needle_task,
    make_needle_task,
    score,
)

log = logging.getLogger(__name__)

PROMPT_TASKS = ("needle", "qa", "code", "custom")
#: Where a prompt's question is: in the prompt, or asked after compression.
MODES = ("inside", "after")
#: Window queries captured at prefill: every config.window up to this reuses it.
WINDOW_MAX = 128
#: Default cap of the prefill memo: five 2000-token prompts of the bundled model.
PREFILL_MEMO_BYTES = 512 * 2**20
#: Default cap of the result memo: about two hundred results at 2000 tokens, and the
#: drawn views of a few dozen comparisons.
RESULT_MEMO_BYTES = 160 * 2**20
#: Default cap of the plan memo: plans, previews' plan views, figures by content.
PLAN_MEMO_BYTES = 80 * 2**20
#: Caps of the memos' kept parts (the prompts `Study.keep_prompts` names).
KEPT_PREFILL_BYTES = 256 * 2**20
KEPT_PLAN_BYTES = 32 * 2**20
KEPT_RESULT_BYTES = 32 * 2**20
#: Measured steps `Study.estimate` reads, per kind.
RATES_KEPT = 8
_STUDY_IDS = itertools.count()


@dataclass(frozen=True)
class PromptSpec:
    """What prompt to build.

    task: "needle" (generated haystack), "qa" / "code" (curated; `curated` names one,
    default the first), or "custom" (`haystack`, `needle`, `question`, `answer`;
    with `depth` the needle is inserted, with `depth=None` it must already be in
    the haystack). `needles > 1` adds distractor needles of the same form.
    `mode`: "inside" (question in the prompt) or "after" (asked after compression).
    """

    task: str = "needle"
    context: int = 2000  # about this many tokens of haystack and needles
    depth: float | None = 0.5
    seed: int = 0
    needles: int = 1
    curated: str | None = None
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
            if not isinstance(self.context, int) or self.context < 64:
                raise ValueError(f"context must be at least 64 tokens; got {self.context}")
            if self.depth is None or not 0.0 <= self.depth <= 1.0:
                raise ValueError(f"depth must be in [0, 1]; got {self.depth}")
            if not 1 <= self.needles <= 4:
                raise ValueError(f"needles must be 1 to 4; got {self.needles}")
            check_custom_prompt(None, self.needle, self.question, self.answer, need_haystack=False)
        if self.task == "custom":
            check_custom_prompt(self.haystack, self.needle, self.question, self.answer)

    def replace(self, **kw) -> PromptSpec:
        return replace(self, **kw)


@dataclass
class Prompt:
    """A prompt built from its `PromptSpec` (`Study.prepare`): its task, its token ids
    and its `Prefill`, reusable for any number of `Study.run` calls."""

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
    """A loaded model with its runner and three byte-bounded memos (prefills, plans,
    results: the module docstring), whose computations all run on the model worker.

    Args:
        loaded: the model (`pagekv.runtime.models.load_model`).
        backend: the runner's backend ("auto", "torch" or "triton").
        memo_size: at most this many prefills kept (None: bounded by bytes only).
        prefill_memo_bytes, result_memo_bytes, plan_memo_bytes: the memos' caps in
            bytes (0: no memo).
        worker: the model worker (default: the process's `WORKER`).
        decode_dtype: how answers decode (`Runner(decode_dtype=)`).

    Safe to share between threads. Every call reads as: a memo lookup, else a job on
    the worker (identical jobs run once and their callers share the value), else a
    wait on that job, holding nothing (docs/design.md, "One model worker").

    What is served is immutable: a `RunResult` is a fresh copy of the memo's, and its
    `plan` is the memo's own `Plan`, shared and never mutated (nothing in `pagekv`
    writes into a plan's tensors; callers must not either).
    """

    def __init__(
        self,
        loaded: LoadedModel,
        backend: str = "auto",
        memo_size: int | None = None,
        prefill_memo_bytes: int = PREFILL_MEMO_BYTES,
        result_memo_bytes: int = RESULT_MEMO_BYTES,
        worker: ModelWorker | None = None,
        decode_dtype: str = "auto",
        plan_memo_bytes: int = PLAN_MEMO_BYTES,
    ):
        self.loaded = loaded
        self.worker = worker or WORKER
        self.runner = Runner(
            loaded.model, loaded.tokenizer, backend=backend, decode_dtype=decode_dtype
        )
        self._tag = next(_STUDY_IDS)  # jobs of different studies never share a key
        # Timings of the first real run are warm (eviction time is not its first call).
        self.warm_up_s = self.worker.run(
            ("warm_up", self._tag), self.runner.warm_up, owner=self._tag
        )
        #: The memos (module docstring), public so that tools and tests can look at them.
        self.prefills = ByteLRU(
            prefill_memo_bytes,
            max_entries=memo_size,
            kept_bytes=KEPT_PREFILL_BYTES if prefill_memo_bytes else 0,
        )
        self.plans = ByteLRU(
            plan_memo_bytes, _entry_bytes, kept_bytes=KEPT_PLAN_BYTES if plan_memo_bytes else 0
        )
        self.results = ByteLRU(
            result_memo_bytes,
            _entry_bytes,
            kept_bytes=KEPT_RESULT_BYTES if result_memo_bytes else 0,
        )
        #: Seconds per token of the last prefills and reconstruction passes (`estimate`).
        self._rates: dict[str, list[float]] = {}
        #: The prompts whose memo entries go to the kept parts (`keep_prompts`).
        self.kept_prompts: frozenset = frozenset()
        self.prefills.keep_if = lambda spec: spec in self.kept_prompts
        for memo in (self.plans, self.results):  # keyed by (_prompt_key, ...); views not
            memo.keep_if = lambda key: isinstance(key[0], tuple) and key[0][0] in self.kept_prompts

    def _record(self, step: str, tokens: int, seconds: float) -> None:
        """One measured step (`estimate`): its seconds per token, the last few kept."""
        rates = self._rates.setdefault(step, [])
        rates.append(seconds / max(int(tokens), 1))
        del rates[:-RATES_KEPT]

    def estimate(self, step: str, tokens: int) -> float | None:
        """The seconds `step` ("prefill" or "reconstruct") should take on `tokens` tokens
        of this model, from the median seconds per token of its last measured runs
        (linear in the tokens: a guide, not a promise); None before the first."""
        rates = sorted(self._rates.get(step, ()))
        return rates[len(rates) // 2] * int(tokens) if rates else None

    def keep_prompts(self, specs) -> None:
        """Keep these prompts' prefills, plans and results in the memos' kept parts
        (the module docstring), those already in memory included; others are let go to
        the ordinary parts. Cheap when nothing changes (a request may call it)."""
        specs = frozenset(specs)
        if specs == self.kept_prompts:
            return
        self.kept_prompts = specs
        for memo in (self.prefills, self.plans, self.results):
            memo.keep_now()

    @classmethod
    def load(
        cls,
        model: str = "bundled",
        backend: str = "auto",
        allow_fallback: bool = True,
        decode_dtype: str = "auto",
        **kw,
    ) -> Study:
        loaded = load_model(model, allow_fallback=allow_fallback, **kw)
        return cls(loaded, backend=backend, decode_dtype=decode_dtype)

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    @property
    def max_prompt_tokens(self) -> int:
        return int(self.loaded.max_context)

    def make_task(self, spec: PromptSpec) -> Task:
        if spec.task == "needle":
            shared = dict(context_tokens=spec.context, seed=spec.seed, question_position=spec.mode)
            if spec.needles > 1:
                return make_multi_needle_task(self.tokenizer, n_needles=spec.needles, **shared)
            return make_needle_task(
                self.tokenizer,
                depth=spec.depth,
                needle=spec.needle,
                question=spec.question,
                answer=spec.answer,
                haystack=spec.haystack,
                **shared,
            )
        if spec.task in ("qa", "code"):
            task = get_task(curated_name(spec.task, spec.curated))
        else:
            task = make_custom_task(
                spec.haystack, spec.needle, spec.question, spec.answer, depth=spec.depth
            )
        task.meta["question_position"] = spec.mode
        return task

    # ------------------------------------------------------------------ prefill

    def prepare(self, spec: PromptSpec) -> Prompt:
        """Tokenize and prefill `spec` once (memoised: the same spec reuses the prefill)."""
        prep = self.prefills.get(spec)
        if prep is not None:
            return prep
        return self.worker.run(
            ("prefill", self._tag, spec), lambda: self._prepare_job(spec), owner=self._tag
        )

    def prepared(self, spec: PromptSpec) -> Prompt:
        """The memoised prefill of `spec`; LookupError if it is not in memory (nothing
        is computed)."""
        prep = self.prefills.get(spec)
        if prep is None:
            raise LookupError(f"not prefilled yet: {_spec_text(spec)} ({spec.mode})")
        return prep

    def _prepare_job(self, spec: PromptSpec) -> Prompt:
        """On the worker: the prefill of `spec` (from the memo if a job stored it)."""
        prep = self.prefills.get(spec)
        if prep is not None:
            return prep
        t0 = time.perf_counter()
        task = self.make_task(spec)
        prompt = task.build_prompt_ids(self.tokenizer, mode=spec.mode)
        total = len(prompt["input_ids"])
        if total > self.max_prompt_tokens:
            raise TaskError(
                f"the prompt has {total} tokens, more than the model's context of "
                f"{self.max_prompt_tokens}; shorten it"
            )
        after = spec.mode == "after"
        pre = self.runner.prefill(
            prompt["context_ids" if after else "input_ids"],
            window_max=WINDOW_MAX,
            question_ids=prompt["question_ids"] if after else None,
        )
        prep = Prompt(
            spec=spec,
            task=task,
            prompt=prompt,
            prefill=pre,
            needle_positions=list(prompt.get("needle_token_positions") or []),
            prepare_s=time.perf_counter() - t0,
        )
        self.prefills.put(spec, prep)
        self._record("prefill", prep.n, pre.timings["prefill_s"])
        log.info(
            "prefill %s: %d tokens (%s) in %.2f s; prefill memo %s",
            _spec_text(spec),
            prep.n,
            spec.mode,
            prep.prepare_s,
            _memo_text(self.prefills),
        )
        return prep

    # ------------------------------------------------------------------ planning

    def plan(self, prep: Prompt, config: EvictionConfig, keep: bool = True) -> Plan:
        """The plan of `config` on `prep`, scored and planned once on the worker: the run
        of the same configuration reuses it (`Runner.plan`'s `Plan`, shared: never
        mutate it). BudgetError when infeasible.

        `keep=False`: from the plan memo, else planned without storing it, for rows
        derived from many configurations (a UOR curve, memory rows), which must neither
        plan a run's configuration twice nor crowd its plans out of the memo."""
        self._check_window(prep, config)
        key = (_prompt_key(prep), config)
        hit = self.plans.get(key)
        if hit is not None:
            return hit
        return self.worker.run(
            ("plan" if keep else "plan-unkept", self._tag, key),
            lambda: self._plan_job(prep, config, keep),
            owner=self._tag,
        )

    def _plan_job(self, prep: Prompt, config: EvictionConfig, keep: bool = True) -> Plan:
        """On the worker: the plan of `config` on `prep`, from the memo or planned (and
        stored, with `keep`)."""
        key = (_prompt_key(prep), config)
        hit = self.plans.get(key)
        if hit is None:
            fresh = "reconstruct_s" not in prep.prefill.timings
            hit = self.runner.plan(prep.prefill, config)
            if fresh and "reconstruct_s" in prep.prefill.timings:
                self._record("reconstruct", prep.n, prep.prefill.timings["reconstruct_s"])
            if keep:
                self.plans.put(key, hit)
                self.prefills.refresh(prep.spec)  # its prefill may hold newly memoised scores
        return hit

    def derive(self, prep: Prompt, key: Hashable, fn):
        """`fn(prep)` computed once per prompt on the worker and kept in the plan memo
        beside the prompt's plans, e.g. a UOR curve or the memory rows of a configuration
        (without a plan memo, computed on each call). `fn` may read the prefill's
        tensors; its value must not be mutated by callers."""
        mkey = (_prompt_key(prep), ("derived", key))
        # Stored as a 1-tuple: a dict value would be sized as drawn views
        # (`_entry_bytes`), and a None value would read as a miss.
        hit = self.plans.get(mkey)
        if hit is not None:
            return hit[0]

        def job():
            found = self.plans.get(mkey)
            if found is None:
                found = (fn(prep),)
                self.plans.put(mkey, found)
            return found[0]

        return self.worker.run(("derive", self._tag, mkey), job, owner=self._tag)

    # ------------------------------------------------------------------ runs

    def run(
        self, prep: Prompt, config: EvictionConfig, max_new_tokens: int | None = None
    ) -> RunResult:
        """Evict under `config`, decode, score: the `RunResult`, its task and score
        filled in (`to_dict()` is its JSON object, docs/schema.md).

        Memoised: the same prompt, configuration and `max_new_tokens` are computed
        once; every call gets its own copy (the plan is shared, see the class
        docstring).
        """
        if max_new_tokens is None:  # the task's own: enough for its expected answer
            max_new_tokens = default_max_new_tokens(prep.task)
        t0 = time.perf_counter()
        job = self.submit_run(prep, config, max_new_tokens)  # checks the window
        self.worker.wait(job)
        stored, computed = job.result()
        took = time.perf_counter() - t0
        log.info(
            "run %s | %s | %s backend on %s | %s | %s",
            _config_text(config),
            f"{_spec_text(prep.spec)}, {prep.n} tokens ({prep.spec.mode}), {max_new_tokens} new",
            stored.backend,
            stored.device,
            _timings_text(stored.timings),
            (f"computed in {took:.2f} s" if computed else f"served from memory in {_ms(took)}")
            + f"; result memo {_memo_text(self.results)}",
        )
        return served_copy(stored)

    def submit_run(
        self, prep: Prompt, config: EvictionConfig, max_new_tokens: int | None = None
    ) -> Job:
        """The job of `run` without waiting for it: its value is `(result, computed)`,
        the memo's own `RunResult` (copy it with `served_copy` before changing it). A
        result already in memory is a finished job (the worker is not touched)."""
        if max_new_tokens is None:
            max_new_tokens = default_max_new_tokens(prep.task)
        self._check_window(prep, config)
        key = (_prompt_key(prep), config, max_new_tokens)
        stored = self.results.get(key)
        if stored is not None:
            return Job.finished((stored, False))
        return self.worker.submit(
            ("run", self._tag, key),
            lambda _job: self._run_job(prep, config, max_new_tokens),
            owner=self._tag,
        )

    def _run_job(self, prep, config, max_new_tokens) -> tuple[RunResult, bool]:
        """On the worker: `(result, computed)` for one configuration."""
        key = (_prompt_key(prep), config, max_new_tokens)
        stored = self.results.get(key)
        if stored is not None:  # a pair stored it while this job waited in the queue
            return stored, False
        res = self.runner.evaluate(
            prep.prefill,
            config,
            max_new_tokens=max_new_tokens,
            needle_positions=prep.needle_positions or None,
            planned=self._plan_job(prep, config),
        )
        completed(res, prep, self.loaded)
        self.results.put(key, res)
        return res, True

    def submit_pair(
        self,
        prep: Prompt,
        config_a: EvictionConfig,
        config_b: EvictionConfig,
        max_new_tokens: int | None = None,
    ) -> Job:
        """The job that computes `run` for two configurations on one prompt, decoded in
        ONE batched pass where their compacted caches have the same shape
        (`Runner.evaluate_pair`); a result already in memory is served from there and
        the other is computed alone. Returns at once: wait with `worker.wait(job, s)`;
        while a shared pass decodes, `job.progress` holds `(tokens_a, tokens_b)` so far
        (streaming). `job.result()` is the memo's `RunResult`s: copy them
        (`served_copy`) before changing them. A pair already in memory is a finished
        job."""
        if max_new_tokens is None:
            max_new_tokens = default_max_new_tokens(prep.task)
        for config in (config_a, config_b):
            self._check_window(prep, config)
        key_a = (_prompt_key(prep), config_a, max_new_tokens)
        key_b = (_prompt_key(prep), config_b, max_new_tokens)
        rec_a, rec_b = self.results.get(key_a), self.results.get(key_b)
        if rec_a is not None and rec_b is not None:
            return Job.finished((rec_a, rec_b))
        return self.worker.submit(
            ("pair", self._tag, key_a, key_b),
            lambda job: self._pair_job(job, prep, config_a, config_b, max_new_tokens),
            owner=self._tag,
        )

    def _pair_job(self, job: Job, prep, config_a, config_b, max_new_tokens):
        key_a = (_prompt_key(prep), config_a, max_new_tokens)
        key_b = (_prompt_key(prep), config_b, max_new_tokens)
        if key_a in self.results or key_b in self.results or config_a == config_b:
            return tuple(self._run_job(prep, c, max_new_tokens)[0] for c in (config_a, config_b))
        t0 = time.perf_counter()
        res_a, res_b = self.runner.evaluate_pair(
            prep.prefill,
            config_a,
            config_b,
            max_new_tokens=max_new_tokens,
            needle_positions=prep.needle_positions or None,
            on_token=lambda a, b: job.report((list(a), list(b))),
            planned=(self._plan_job(prep, config_a), self._plan_job(prep, config_b)),
        )
        records = tuple(completed(res, prep, self.loaded) for res in (res_a, res_b))
        for key, rec in zip((key_a, key_b), records, strict=True):
            self.results.put(key, rec)
        self.prefills.refresh(prep.spec)
        log.info(
            "run pair %s + %s | %s, %s tokens (%s) | decoded %s in %.2f s",
            _config_text(config_a),
            _config_text(config_b),
            _spec_text(prep.spec),
            prep.n,
            prep.spec.mode,
            "in one batch" if res_a.timings.get("decode_batch") == 2 else "one after the other",
            time.perf_counter() - t0,
        )
        return records

    def run_pair(
        self,
        prep: Prompt,
        config_a: EvictionConfig,
        config_b: EvictionConfig,
        max_new_tokens: int | None = None,
    ) -> tuple[RunResult, RunResult]:
        """`run` for two configurations on one prompt (`submit_pair`), memoised exactly
        as `run` memoises each."""
        job = self.submit_pair(prep, config_a, config_b, max_new_tokens)
        self.worker.wait(job)
        rec_a, rec_b = job.result()
        return served_copy(rec_a), served_copy(rec_b)

    def run_full(self, prep: Prompt, max_new_tokens: int | None = None) -> RunResult:
        """`run` with the full cache (memoised like every run; it ignores every budget knob)."""
        return self.run(prep, EvictionConfig(policy="full"), max_new_tokens)

    def _check_window(self, prep: Prompt, config: EvictionConfig) -> None:
        if config.window > WINDOW_MAX and config.window < prep.n:
            raise ValueError(f"window must be at most {WINDOW_MAX} tokens; got {config.window}")


def served_copy(result: RunResult) -> RunResult:
    """What a caller gets of a memoised `RunResult`: a copy (the caller may change it),
    its `plan` shared (never mutated: no device copy per served request)."""
    return copy.deepcopy(result, {id(result.plan): result.plan})


def _entry_bytes(value) -> int:
    """The size of a memo entry: a dict of drawn views says its own (`nbytes`)."""
    return value["nbytes"] if isinstance(value, dict) else nbytes(value)


def _prompt_key(prep: Prompt) -> tuple:
    """What identifies a prefilled prompt: its spec and a digest of the prefilled ids
    (and the question's, in question-after mode)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(array("q", prep.prefill.ids).tobytes())
    h.update(b"|")
    h.update(array("q", prep.prefill.question_ids or []).tobytes())
    return (prep.spec, h.hexdigest())


def settings_text(spec: PromptSpec, *configs: EvictionConfig) -> str:
    """One line naming a prompt and configurations, as the run log lines do:
    `"mean budget 0.2 page 16 ... + entropy ... | needle 2000 tokens, ... (after)"`."""
    return " + ".join(_config_text(c) for c in configs) + f" | {_spec_text(spec)} ({spec.mode})"


def _spec_text(spec: PromptSpec) -> str:
    if spec.task == "needle":
        text = f"needle {spec.context} tokens, depth {spec.depth}, seed {spec.seed}"
        return text + (f", {spec.needles} needles" if spec.needles > 1 else "")
    if spec.task in ("qa", "code"):
        return f"{spec.task} {spec.curated or '(first)'}"
    return "custom prompt"


def _config_text(config: EvictionConfig) -> str:
    if config.policy == "full":
        return "full"
    text = (
        f"{config.policy} budget {config.budget:g} page {config.page_size} "
        f"n_sink {config.n_sink} window {config.window} tau {config.tau:g}"
    )
    default = EvictionConfig()
    for name in ("smoothing", "smoothing_kind", "page_reduction", "sink_threshold"):
        if getattr(config, name) != getattr(default, name):
            text += f" {name} {getattr(config, name)}"
    return text


def _ms(seconds) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.0f} ms"


def _timings_text(t: dict) -> str:
    return (
        f"prefill {t.get('prefill_s') or 0:.2f} s, score {_ms(t.get('score_s'))}, "
        f"evict {_ms(t.get('evict_s'))}, decode {t.get('decode_s') or 0:.2f} s"
    )


def _memo_text(memo: ByteLRU) -> str:
    return f"{len(memo)} entries, {memo.nbytes / 2**20:.0f}/{memo.max_bytes / 2**20:.0f} MiB"


def completed(res: RunResult, prep: Prompt, loaded: LoadedModel) -> RunResult:
    """`res` with its model, task, score and prompt filled in (what `Study.run`
    serves); returned for chaining."""
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
    return res
