"""Many prompts in one fixed pool, decoded together: what a budget buys
(`Runner.serve`).

Eviction exists to make room. Here the room is a `BlockPool`
(`pagekv.runtime.block_pool`) of a fixed number of bytes, and the prompts wait in a
queue. The loop:

1. the first waiting prompt is prefilled and evicted under the configuration (its
   kept tokens and counts, `Runner.evict`), once;
2. it is admitted when the blocks for its kept pages, its question and its answer
   are free: its kept tokens are copied into them and its first answer token is made
   (the prefill's argmax, or in question-after mode the question's forward over its
   kept tokens); admission repeats while prompts fit;
3. one decode step serves every live row (`LeanDecoder.step` over a `PoolBatch`, each
   row at its own position);
4. a row that reaches EOS or `max_new_tokens` returns its blocks, and the next
   waiting prompt takes them.

Every row decodes as it would alone: each depends only on its own tokens (no row
reads another's blocks), with the same positions, so its greedy tokens are those of
`Runner.evaluate` under the same configuration (tests/test_capacity.py checks it in
float32 on the bundled model, with rows of different lengths admitted mid-decode).

The record (`PoolRun`) says what the pool bought: the rows decoded at each step, the
blocks in use, and the tokens per second of the batched decode and of the whole run.
The prefill waiting for blocks is held outside the pool (one prompt's full cache, as
a server holds a prefill's activations); the pool's bytes are the decode cache's.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass, field

import torch

from pagekv.maths.config import EvictionConfig
from pagekv.runtime.block_pool import BlockPool
from pagekv.runtime.paged_cache import blocks_needed
from pagekv.runtime.prefill import as_id_list, synced_now

__all__ = ["PoolRun", "serve"]


@dataclass
class PoolRun:
    """What `Runner.serve` did with a list of prompts in a pool of fixed bytes."""

    answers: list[str]  # per prompt, in the prompts' order
    tokens: list[list[int]]
    stop_reasons: list[str]  # "eos" or "max_new_tokens"
    config: dict  # the EvictionConfig
    pool_bytes: int  # the bytes asked for
    pool_blocks: int  # the blocks they hold (each `page_size` tokens of one (layer, KV head))
    block_bytes: int
    page_size: int
    live: list[int] = field(default_factory=list)  # rows decoded at each batched step
    blocks_in_use: list[int] = field(default_factory=list)  # at each batched step
    blocks: list[int] = field(default_factory=list)  # per prompt, the blocks it held
    admitted_at: list[int] = field(default_factory=list)  # per prompt, the step it joined
    finished_at: list[int] = field(default_factory=list)  # per prompt, the step it left
    prefill_s: list[float] = field(default_factory=list)  # per prompt
    evict_s: list[float] = field(default_factory=list)  # per prompt: plan and copy in
    decode_s: float = 0.0  # the batched steps, in all
    decode_tokens: int = 0  # the tokens they made
    wall_s: float = 0.0  # the whole run: prefills, evictions and decode

    @property
    def max_live(self) -> int:
        """The most sequences decoded at once."""
        return max(self.live, default=min(1, len(self.tokens)))

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens per second of the batched decode steps."""
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Answer tokens per second of the whole run (prefills and evictions included)."""
        return sum(map(len, self.tokens)) / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(
            max_live=self.max_live,
            decode_tokens_per_s=self.decode_tokens_per_s,
            tokens_per_s=self.tokens_per_s,
        )
        return out


@dataclass
class _Live:
    prompt: int
    tokens: list[int]
    pos: int  # the position of the next token fed


def serve(runner, prompts, config, pool_bytes, max_new_tokens=24, window_max=128,
          stop_at_eos=True) -> PoolRun:  # fmt: skip
    """`Runner.serve`: `prompts` through a pool of `pool_bytes` bytes (module docstring).

    Args:
        runner: a `pagekv.runtime.runner.Runner`.
        prompts: each a list of token ids (the whole prompt), or a pair
            `(context_ids, question_ids)` (question-after mode).
        config: the `EvictionConfig` every prompt is evicted under (`policy="full"`:
            nothing evicted); its page size is the pool's.
        pool_bytes: the pool's bytes, keys and values.
        max_new_tokens: each answer's most tokens.
        window_max, stop_at_eos: as `Runner.prefill` and `Runner.evaluate`.

    Raises ValueError, in one sentence, for no prompts, a pool smaller than one
    block, or a prompt whose blocks alone exceed the pool.
    """
    if not isinstance(config, EvictionConfig):
        raise TypeError(f"config must be an EvictionConfig; got {type(config).__name__}")
    items = [_as_prompt(p, i) for i, p in enumerate(prompts)]
    if not items:
        raise ValueError("serve needs at least one prompt")
    n_new = max_new_tokens
    if isinstance(n_new, bool) or not isinstance(n_new, int) or n_new < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0; got {n_new!r}")
    eos = runner.eos_ids if stop_at_eos else set()
    dev = runner.device
    P = int(config.page_size)
    start = time.perf_counter()
    n = len(items)
    run = PoolRun(
        answers=[""] * n, tokens=[[] for _ in range(n)], stop_reasons=["max_new_tokens"] * n,
        config=config.to_dict(), pool_bytes=int(pool_bytes), pool_blocks=0, block_bytes=0,
        page_size=P, blocks=[0] * n, admitted_at=[0] * n, finished_at=[0] * n,
        prefill_s=[0.0] * n, evict_s=[0.0] * n,
    )  # fmt: skip
    pool: BlockPool | None = None
    waiting = deque(range(n))
    head = None  # (prompt, prefill, evicted): the next to admit
    live: dict[int, _Live] = {}  # pool row -> its sequence
    step = runner._lean_decoder().step
    batch, batch_rows = None, None

    def finish(row: int, reason: str) -> None:
        s = live.pop(row)
        run.stop_reasons[s.prompt] = reason
        run.finished_at[s.prompt] = len(run.live)
        pool.release(row)

    def take(row: int, token: int) -> None:
        """Append `token` to `row`'s answer; finish the row at EOS or its last token."""
        s = live[row]
        s.tokens.append(token)
        if token in eos:
            finish(row, "eos")
        elif len(s.tokens) >= n_new:
            finish(row, "max_new_tokens")

    with torch.inference_mode():
        while waiting or head is not None or live:
            # Admit while the next prompt's blocks are free.
            while True:
                if head is None and waiting:
                    i = waiting.popleft()
                    ids, question = items[i]
                    runner._check_length(len(ids) + len(question or ()) + n_new)
                    pre = runner.prefill(ids, window_max=window_max, question_ids=question)
                    ev = runner.evict(pre, config)
                    run.prefill_s[i] = float(pre.timings["prefill_s"])
                    run.evict_s[i] = float(ev.evict_s or 0.0)
                    if pool is None:
                        like = pre.cache.layers[0].keys
                        pool = BlockPool.of_bytes(
                            pool_bytes, pre.n_layers, pre.n_groups, pre.head_dim, P, like,
                            kernel=runner.backend == "triton",
                        )  # fmt: skip
                        run.pool_blocks, run.block_bytes = pool.num_blocks, pool.block_bytes
                    extra = len(question or ()) + n_new
                    need = blocks_needed(ev.stored_tokens, extra, P)
                    if need > pool.num_blocks:
                        raise ValueError(
                            f"prompt {i} needs {need} blocks of {pool.block_bytes} bytes "
                            f"({need * pool.block_bytes} bytes) and the pool holds "
                            f"{pool.num_blocks} ({pool_bytes} bytes): give the pool more bytes"
                        )
                    head = (i, pre, ev, extra)
                if head is None:
                    break
                i, pre, ev, extra = head
                t0 = synced_now(dev)
                keys = [lay.keys for lay in pre.cache.layers]
                values = [lay.values for lay in pre.cache.layers]
                row = pool.admit(keys, values, ev.kept_indices, ev.stored_tokens, extra)
                if row is None:
                    break  # wait for a row to finish
                head = None
                run.evict_s[i] += synced_now(dev) - t0
                run.blocks[i] = pool.rows[row].n_blocks
                run.admitted_at[i] = len(run.live)
                live[row] = _Live(i, run.tokens[i], pre.n)
                if n_new == 0:
                    finish(row, "max_new_tokens")
                    continue
                logits = pre.first_logits
                if pre.question_ids:
                    q = torch.tensor([pre.question_ids], dtype=torch.long, device=dev)
                    logits = step(q, pre.n, pool.batch([row]))[0]
                    live[row].pos += len(pre.question_ids)
                del pre, keys, values
                take(row, int(torch.argmax(logits)))
            if not live:
                continue
            # One batched step over every live row.
            rows = list(live)
            if rows != batch_rows:
                batch, batch_rows = pool.batch(rows), rows
            ids = torch.tensor([[live[r].tokens[-1]] for r in rows], dtype=torch.long, device=dev)
            pos = torch.tensor([live[r].pos for r in rows], dtype=torch.long, device=dev)
            run.live.append(len(rows))
            run.blocks_in_use.append(pool.used_blocks)
            t0 = synced_now(dev)
            nxt = torch.argmax(step(ids, pos, batch), dim=-1).tolist()
            run.decode_s += synced_now(dev) - t0
            run.decode_tokens += len(rows)
            for r, token in zip(rows, nxt, strict=True):
                live[r].pos += 1
                take(r, token)
    run.answers = [runner._detok(t) for t in run.tokens]
    run.wall_s = time.perf_counter() - start
    return run


def _as_prompt(p, i: int) -> tuple[list[int], list[int] | None]:
    """A prompt as `(ids, question_ids or None)`, checked as `Runner.prefill` checks ids."""
    name = f"prompt {i}"
    try:
        if isinstance(p, tuple) and len(p) == 2:
            ids, question = p
            asked = as_id_list(question, f"{name}'s question") if len(question) else None
            return as_id_list(ids, name), asked
        return as_id_list(p, name), None
    except TypeError:
        raise ValueError(f"{name} is not a list of token ids") from None
