"""The reconstruction scorer: how much the model attends to each context token while it
repeats the context (the idea of KVzip, arXiv 2505.23416), as per-head profiles.

Question-agnostic scoring for `EvictionConfig(scorer="reconstruct")`. After the prefill
of a context of `n` tokens, on a cache of its own (the prefill's cache is never
changed), the model reads an instruction to repeat the context and then the context
itself again, in chunks of `chunk` tokens. For every layer and query head the score of
context token `t` is the largest attention any reconstruction query gives it:

    s_h(t) = max over reconstruction queries i of softmax_i(q_i . K / sqrt(d))[t]

where the softmax runs over every key the query sees (the context, the instruction and
the reconstruction so far, causally), exactly the model's own attention rows. The
profile is `s_h` normalised to sum to 1 over the context, so the rest of the method
(sink-isolated collision entropy, pooling per group, page selection) is unchanged.

Each chunk's forward runs under this module's attention implementation
(`SCORED_ATTENTION`, registered with transformers' `AttentionInterface`). It receives
the queries the model computed (after RoPE) and the cache's keys with the chunk's own
appended: `c` queries over `N` keys, query `i` at key index `N - c + i` (the scoring
kernel's causal geometry with `w = c`). On the torch backend (the reference, the
default) every attention row is computed once, in float32, and serves twice: as the
layer's output (`rows @ V`, the eager attention's arithmetic) and as the scores. On the
Triton backend the output is SDPA's and the scores are
`pagekv.runtime.backend.attention_scores`' (the scoring kernel with its max output,
whose query axis is tiled so that long chunks, KVzip's 2048, need no more rows per
program than the window). The queries' focus (the head weights, below) is a reduction
along each row, made by torch ops on both backends. Memory stays bounded: one layer's
chunk attention `[H, chunk, N]` is the largest tensor; the full `[L, H, n, n]` is never
formed.

The implementation is the model's only while its chunks run (the config is restored
after, on an error too): nothing else may run the same model meanwhile, which the app's
one model worker guarantees (docs/design.md).

Head weights: the reconstruction queries' own focus (`reconstruction_masses`).

The instruction (`REPEAT_PROMPT`), the choice to reconstruct every context token, the
max over queries and the queries' focus as head weights are this module's choices;
docs/design.md lists them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.cache_utils import DynamicLayer

from pagekv.maths.entropy import HeadMasses, row_focus_sums
from pagekv.maths.profiles import future_mask
from pagekv.runtime.backend import attention_scores, resolve_backend
from pagekv.runtime.paged_cache import group_attention
from pagekv.runtime.prefill import (
    attention_modules,
    attention_scale,
    cache_kwarg,
    forward,
)

log = logging.getLogger("pagekv")

#: What the model reads before it repeats the context (tokenised without special tokens).
REPEAT_PROMPT = "\n\nRepeat the previous context exactly.\n"
#: Reconstruction queries per forward: bounds the `[H, chunk, N]` attention of a chunk.
CHUNK = 256
#: The head weights' focus is kept for every sink count up to this (the app's n_sink
#: range, `pagekv.app.run_inputs.LIMITS`); `reconstruction_masses` refuses more.
FOCUS_SINKS = 64
#: The attention implementation the reconstruction chunks run under (registered with
#: transformers' `AttentionInterface` below): the model's attention, scoring its rows.
SCORED_ATTENTION = "pagekv_scored"
#: The attention rows' stride is a multiple of this many float32 (`padded`).
ALIGN = 16


@dataclass
class _Pass:
    """What one reconstruction pass's attention calls share: the context length `n`,
    the backend, the per-layer sums (`acc`), the most keys a query sees (`n_keys`) and
    a float32 buffer for the attention rows, made once and reused by every layer and
    chunk (a fresh tensor of that size costs the CPU about as much as filling it)."""

    n: int
    used: str
    acc: list
    n_keys: int
    buffer: torch.Tensor | None = None

    def rows_buffer(self, groups: int, rows: int, n_keys: int, device) -> torch.Tensor:
        """A float32 view `(groups, rows, padded(n_keys))` on the shared buffer."""
        need = groups * rows * padded(n_keys)
        if self.buffer is None or self.buffer.numel() < need or self.buffer.device != device:
            most = groups * rows * padded(max(self.n_keys, n_keys))
            self.buffer = torch.empty(most, dtype=torch.float32, device=device)
        return self.buffer[:need].view(groups, rows, padded(n_keys))


def padded(n_keys: int) -> int:
    """The attention rows' stride: `n_keys` rounded up to whole 64-byte lines (`ALIGN`
    floats). On the CPU the `q . K` product into rows of an unaligned stride is about a
    third slower (benchmarks/bench_reconstruct.py); the padding holds -inf logits, so the
    softmax of a padded row gives the same row."""
    return -(-n_keys // ALIGN) * ALIGN


def _scored_attention(module, query, key, value, attention_mask=None, *sixth, **kwargs):
    """One layer's attention for one reconstruction chunk, its rows scored on the way.

    Its sixth argument comes in either of two orders that callers use: `scaling` in
    transformers' eager order (`module, query, key, value, attention_mask, scaling,
    dropout`), `dropout` in its SDPA order, as kvpress's attention wrapper passes it
    (`func(module, query, key, value, attention_mask, dropout, **kwargs)`, `scaling` by
    keyword). A `scaling` keyword wins, and a sixth value beside it is the dropout
    (inference: none); a sixth value alone is the scaling; neither: the module's own.

    `query` `[1, H, c, d]` after RoPE; `key`, `value` `[1, G, N, d]`, the cache with the
    chunk's own keys appended, so query `i` sits at key index `N - c + i` and sees the
    keys `t <= N - c + i` (batch 1 without padding: transformers builds no mask for an
    implementation it does not know, and `attention_mask` is not read). Returns
    `(output [1, c, H, d], None)`, as transformers' attention functions do.

    The torch backend computes each row once, in float32, and uses it twice: the output
    is `rows @ V` (the eager attention's arithmetic: rows cast to the values' dtype), and
    the scores are reductions of the same rows. The Triton backend keeps the fused
    attention (SDPA) for the output and scores with the scoring kernel
    (`attention_scores`). Either way the scores are of the queries the model computed.
    """
    index, state = module._pagekv_pass
    n = state.n
    scaling = kwargs.pop("scaling") if "scaling" in kwargs else (sixth[0] if sixth else None)
    scale = attention_scale(module) if scaling is None else float(scaling)
    c = int(query.shape[2])
    if state.used == "triton":
        out = group_attention(query, key, value, scale)  # SDPA, causal among the chunk
        mean, top, masses, sinks, _ = attention_scores(
            query, key, scale, "triton", focus=(n, FOCUS_SINKS)
        )
        new = [top[0, :, :n], mean[0, :, :n] * c, masses[0], sinks[0]]
    else:
        rows = _attention_rows(query[0], key[0], scale, state)  # [H, c, N] float32
        G, N, d = value.shape[1], value.shape[2], value.shape[3]
        out = torch.bmm(rows.view(G, -1, N).to(value.dtype), value[0]).view(-1, c, d)
        ctx = rows[:, :, :n]
        top, total = ctx.amax(1), ctx.sum(1)
        new = [top, total, *row_focus_sums(rows, n, FOCUS_SINKS)]
    if (old := state.acc[index]) is not None:  # the max over the queries; sums of the rest
        new[0] = torch.maximum(old[0], new[0])
        new[1:] = [a + b for a, b in zip(old[1:], new[1:], strict=True)]
    state.acc[index] = new
    return out.view(1, -1, c, out.shape[-1]).transpose(1, 2).contiguous(), None


def _attention_rows(q: torch.Tensor, keys: torch.Tensor, scale: float, state: _Pass):
    """Float32 softmax rows `[H, c, N]` of the queries `q` `[H, c, d]` over `keys`
    `[G, N, d]` (the heads of a group share its keys), query `i` at key index
    `N - c + i`, causally: only the last `c` keys are masked. The rows are a view of
    `state`'s buffer (their stride `padded(N)`), valid until the next call."""
    H, c, d = q.shape
    G, N, _ = keys.shape
    full = state.rows_buffer(G, (H // G) * c, N, q.device)
    logits = full[..., :N]
    # alpha: the scale inside the product, as `(q . k) * scale`, with no pass of its own
    torch.baddbmm(logits, q.float().reshape(G, -1, d), keys.float().transpose(1, 2),
                  beta=0.0, alpha=scale, out=logits)  # fmt: skip
    future = future_mask(c, c, q.device)  # among the chunk's own keys, the last c
    logits.view(G, -1, c, N)[..., N - c :].masked_fill_(future, float("-inf"))
    full[..., N:].fill_(float("-inf"))  # the padding: no weight in the softmax
    if q.device.type == "cpu":  # in place: the CPU kernel finishes a row's max first
        torch.ops.aten._softmax.out(full, -1, False, out=full)
    else:
        full = torch.softmax(full, dim=-1)
    return full[..., :N].view(H, c, N)


AttentionInterface.register(SCORED_ATTENTION, _scored_attention)


class _PassLayer(DynamicLayer):
    """One layer of the pass's own cache: the prefill's keys and values copied once into
    buffers `[1, G, capacity, d]` sized for the whole pass, each forward's written after
    them in place. (A DynamicLayer concatenates, so it copies the whole layer each time
    it grows: once per chunk.) `keys` and `values` are views of the filled part, what
    the model's attention reads."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, capacity: int):
        super().__init__()
        self.lazy_initialization(keys, values)
        self._keys = keys.new_empty((*keys.shape[:2], capacity, keys.shape[3]))
        self._values = values.new_empty((*values.shape[:2], capacity, values.shape[3]))
        self._filled = 0
        self.update(keys, values)

    def update(self, key_states, value_states, *args, **kwargs):
        start, end = self._filled, self._filled + key_states.shape[2]
        if end > self._keys.shape[2]:
            raise RuntimeError(f"the pass's cache holds {self._keys.shape[2]} tokens; {end} asked")
        self._keys[:, :, start:end].copy_(key_states)
        self._values[:, :, start:end].copy_(value_states)
        self._filled = end
        self.keys, self.values = self._keys[:, :, :end], self._values[:, :, :end]
        return self.keys, self.values


def _pass_cache(cache, capacity: int) -> DynamicCache:
    """A cache of `_PassLayer`s holding a copy of `cache`'s keys and values, with room
    for `capacity` tokens per layer; `cache` is read, never changed."""
    own = DynamicCache()
    own.layers.extend(_PassLayer(la.keys, la.values, capacity) for la in cache.layers)
    return own


def as_profiles(scores: torch.Tensor) -> torch.Tensor:
    """Scores `[L, H, n]` as profiles: each head's row normalised to sum to 1."""
    return scores / scores.sum(-1, keepdim=True)


def reconstruction_scores(
    model,
    cache,
    context_ids: list[int],
    prompt_ids: list[int],
    *,
    chunk: int = CHUNK,
    cache_kw: str | None = None,
    backend: str = "torch",
) -> dict[str, torch.Tensor]:
    """Every aggregation of one reconstruction pass, float32: `"max"` and `"mean"`
    `[L, H, n]`, not normalised (the largest and the mean attention of the reconstruction
    queries on each context token), and the queries' focus, `"focus_mass"` and
    `"focus_sink"` `[L, H, FOCUS_SINKS + 1]`: the mean over the reconstruction queries of
    `pagekv.maths.entropy.row_focus_sums` (each query's sink-isolated collision mass on
    the context, and its sink share, for every sink count), what `reconstruction_masses`
    makes the head weights of.

    Args:
        model: the decoder whose prefill made `cache`.
        cache: a DynamicCache holding the context's `n` keys and values per layer, read
            and never changed: the pass copies them once into a cache of its own with
            room for the whole pass (`_pass_cache`).
        context_ids: the `n` context ids (what is reconstructed).
        prompt_ids: the instruction's ids, read before the reconstruction.
        chunk: reconstruction queries per forward (>= 1).
        cache_kw: the model's name for the cache argument (`cache_kwarg(model)` if None).
        backend: "torch" (the float32 twin, the reference), "triton" (the scoring
            kernel with its max output; on CPU tensors the Triton interpreter) or
            "auto" (Triton on CUDA), resolved by
            `pagekv.runtime.backend.resolve_backend` (a BackendError where Triton
            cannot run). Both give the same scores up to float32 rounding.
    """
    cache_kw = cache_kw or cache_kwarg(model)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be an integer >= 1; got {chunk!r}")
    mods = attention_modules(model)
    n = len(context_ids)
    if n < 1:
        raise ValueError("the context is empty: nothing to reconstruct")
    held = int(cache.layers[0].keys.shape[2])
    if held != n:
        raise ValueError(f"the cache holds {held} tokens, the context {n}")
    dev = cache.layers[0].keys.device
    used = resolve_backend(backend, dev)
    #: Per layer `[max, sum]` `[H, n]` and the focus sums `[H, S + 1]` x 2, over the chunks.
    acc: list[list[torch.Tensor] | None] = [None] * len(mods)
    configs = {id(m.config): m.config for m in mods}
    before = {k: c._attn_implementation for k, c in configs.items()}
    state = _Pass(n, used, acc, n_keys=n + len(prompt_ids) + n)
    cache = _pass_cache(cache, state.n_keys)
    for i, m in enumerate(mods):
        m._pagekv_pass = (i, state)
    try:
        with torch.inference_mode():
            pos = n
            if prompt_ids:  # the model's own attention: nothing is scored yet
                forward(model, prompt_ids, pos, cache, cache_kw, dev)
                pos += len(prompt_ids)
            for c in configs.values():
                c._attn_implementation = SCORED_ATTENTION
            for start in range(0, n, chunk):
                part = context_ids[start : start + chunk]
                forward(model, part, pos, cache, cache_kw, dev)
                pos += len(part)
    finally:
        for k, c in configs.items():
            c._attn_implementation = before[k]
        for m in mods:
            del m._pagekv_pass
    log.debug("reconstruction_scores ran on the %s backend (%s)", used, dev)
    best, total, mass, sink = (torch.stack(x) for x in zip(*acc, strict=True))  # [L, ...]
    return {"max": best, "mean": total / n, "focus_mass": mass / n, "focus_sink": sink / n}


def reconstruction_masses(scores: dict, profiles: torch.Tensor, n_sink: int) -> HeadMasses:
    """The head masses of the reconstruction scorer for `n_sink` sinks: the focus of the
    reconstruction queries (`scores["focus_mass"]`: each head's mean, over the queries,
    of the sink-isolated collision mass of its attention on the context), not the
    collision mass of the aggregated `profiles`.

    Why: docs/design.md, "Choices where the code settles a detail" (head weights under
    the reconstruction scorer). The sink masses are the queries' mean sink share
    (`scores["focus_sink"]`). `profiles` `[L, H, n]` give the shape and `n` only.
    """
    masses, sinks = scores["focus_mass"], scores["focus_sink"]
    most = masses.shape[-1] - 1
    if isinstance(n_sink, bool) or not isinstance(n_sink, int) or not 0 <= n_sink <= most:
        raise ValueError(
            f"the reconstruction scorer's head weights are kept for n_sink 0..{most}; "
            f"got {n_sink!r}"
        )
    L, H, _ = profiles.shape
    if tuple(masses.shape[:2]) != (L, H):
        raise ValueError(f"focus of shape {tuple(masses.shape)} for profiles of [{L}, {H}, n]")
    return HeadMasses(
        sink=sinks[..., n_sink].float(),
        isolated=masses[..., n_sink].float(),
        collision=masses[..., 0].float(),
        n_sink=n_sink,
    )
