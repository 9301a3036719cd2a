"""One result schema: what a run (one eviction configuration on one prompt) produced.

`RunResult` is filled by `pagekv.runtime.runner.Runner.evaluate` (the eviction and the
answer) and completed by `pagekv.engine.study.Study.run` (the task and its score). Its
`to_dict()` is the JSON object of the CLI (`python -m pagekv run --json`), and the
app's table, its export and the replay harness read the same keys. docs/schema.md
lists every key (a test keeps the two in step).

Token counts, each with one name (per (layer, group) lists are `[L][G]`):

- `budget_tokens`: `k = floor(beta * n)`, what each (layer, group) may keep.
- `union_tokens`: what the policy keeps per (layer, group) (`Plan.union_tokens`):
  for `head_independent` the union of the heads' picks, else the pooled set.
- `head_tokens`: `k'`, what each head keeps alone (`head_independent` only); the
  union overhead is `union_tokens / head_tokens`.
- `stored_tokens`: what the decode cache stores per (layer, group);
  `padding_tokens = stored_tokens - union_tokens` is the padding a layer's groups get
  when their unions differ (`head_independent` only; 0 else: a global plan's groups
  each store their own allocation).
- `kept_tokens` (JSON only, kept for the CLI's first users): the largest group's
  `stored_tokens` per layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from pagekv.maths.plan import Plan


@dataclass
class RunResult:
    """One configuration's eviction, greedy answer and (from `Study.run`) its score."""

    # the answer
    answer: str
    tokens: list[int]
    stop_reason: str  # "eos" or "max_new_tokens"
    first_token_from_full_prefill: bool  # question inside: token 1 saw the full prompt
    # the configuration
    policy: str
    config: dict  # EvictionConfig.to_dict()
    mode: str  # "inside" or "after"
    # sizes (see the module docstring)
    prompt_tokens: int  # n, plus the question's length in "after" mode
    context_tokens: int  # n, the prefilled (and evicted) tokens
    budget_tokens: int  # k = floor(budget * n) (n for `full`)
    union_tokens: list  # [L][G] what the policy keeps
    stored_tokens: list  # [L][G] what the decode cache stores
    padding_tokens: list  # [L][G] stored - union
    head_tokens: int | None  # k' per head (head_independent), else None
    uor: dict  # {"mean", "max"} of union_tokens / head_tokens (1.0 when pooled)
    uor_per_group: list  # [L][G]
    cache_bytes_before: int  # the full prompt cache
    cache_bytes_after: int  # the stored tokens' keys and values (before any decode)
    # where and how long
    backend: str  # the runner's backend, "torch" or "triton"
    backends: dict  # per step: score, weights, pool, select, compact -> backend; device
    device: str
    timings: dict  # prefill_s, score_s, evict_s (None for `full`), decode_s, load_s
    #: The decode-time cache of this row: its kept pages with room for the question and
    #: the answer (`PagedCache.row_nbytes`).
    cache_bytes_decode: int | None = None
    # the needle (needle tasks)
    needle_positions: list | None = None  # prompt indices of the needle's answer tokens
    needle_retention: list | None = None  # [L][G] fraction of the needle stored
    needle_kept_all: bool | None = None  # every (layer, group) stores the whole needle
    needle_retention_union: list | None = None  # head_independent: over the unions
    # the task (filled by Study.run)
    model: str | None = None
    task: str | None = None
    task_kind: str | None = None
    question: str | None = None
    expected: str | None = None
    correct: bool | None = None
    score: dict | None = None
    spec: dict | None = None
    # not serialised
    plan: Plan | None = field(default=None, repr=False)
    logits: torch.Tensor | None = field(default=None, repr=False)  # [T, V] if asked

    #: Fields `to_dict` leaves out (tensors).
    NOT_SERIALISED = ("plan", "logits")

    @property
    def kept_tokens(self) -> list[int]:
        """The largest group's stored tokens per layer (the JSON key `kept_tokens`)."""
        return [max(row) if row else 0 for row in self.stored_tokens]

    def to_dict(self) -> dict:
        """The JSON object: every field but `NOT_SERIALISED`, plus `kept_tokens`."""
        return {key: getattr(self, key) for key in json_keys()}


def json_keys() -> list[str]:
    """Every key of `RunResult.to_dict()`, in order (docs/schema.md lists them)."""
    names = [f.name for f in fields(RunResult) if f.name not in RunResult.NOT_SERIALISED]
    return [*names, "kept_tokens"]


def mean_retention(rec) -> float | None:
    """The needle fraction a `RunResult` kept, averaged over (layer, group); None
    without a needle."""
    ret = rec.needle_retention
    if not ret:
        return None
    vals = [v for row in ret for v in row]
    return sum(vals) / len(vals)


def run_cells(rec) -> dict:
    """What a finished run shows, one row of the app's answers table and of the CLI's:
    `verdict`, `answer`, `stored` (tokens stored per (layer, group), the largest),
    `needle` (mean fraction kept, None without a needle), `uor` (max), `evict_s` (None
    for the full cache), `decode_s`."""
    return {
        "verdict": "✓ right" if rec.correct else "✗ wrong",
        "answer": rec.answer,
        "stored": max(rec.kept_tokens, default=0),
        "needle": mean_retention(rec),
        "uor": float(rec.uor["max"]),
        "evict_s": rec.timings["evict_s"],
        "decode_s": rec.timings["decode_s"],
    }
