"""The reconstruction scorer: how much the model attends to each context token while it
repeats the context (the idea of KVzip, arXiv 2505.23416), as per-head profiles.

Question-agnostic scoring for `EvictionConfig(scorer="reconstruct")`. After the prefill
of a context of `n` tokens, on a COPY of its cache (the prefill's cache is never
changed), the model reads an instruction to repeat the context and then the context
itself again, in chunks of `chunk` tokens. For every layer and query head the score of
context token `t` is the largest attention any reconstruction query gives it:

    s_h(t) = max over reconstruction queries i of softmax_i(q_i . K / sqrt(d))[t]

where the softmax runs over every key the query sees (the context, the instruction and
the reconstruction so far, causally), exactly the model's own attention rows. The
profile is `s_h` normalised to sum to 1 over the context, so the rest of the method
(sink-isolated collision entropy, pooling per group, page selection) is unchanged.

Each chunk's scores come from `pagekv.runtime.backend.attention_scores` (its `c`
queries over the `N` keys so far, query `i` at key index `N - c + i`: the scoring
kernel's causal geometry with `w = c`), on the backend chosen by `backend`: the torch
twin (the reference, the default) or the Triton scoring kernel with its max output,
whose query axis is tiled so that long chunks (KVzip's 2048) need no more rows per
program than the window; the queries' focus (the head weights, below) is a reduction
along each query's row, made by torch ops on both backends. Memory stays bounded: one
layer's chunk attention `[H, chunk, N]` is the largest tensor (on Triton too, for the
focus); the full `[L, H, n, n]` is never formed. The queries come from the module's own
projection and rotary tables (`window_queries`), the keys from the cache after the
module appended the chunk's own keys.

Head weights: the reconstruction queries' own focus (`reconstruction_masses`).

The instruction (`REPEAT_PROMPT`), the choice to reconstruct every context token, the
max over queries and the queries' focus as head weights are this module's choices;
docs/design.md lists them.
"""

from __future__ import annotations

import logging

import torch

from pagekv.maths.entropy import HeadMasses
from pagekv.runtime.backend import attention_scores, resolve_backend
from pagekv.runtime.prefill import (
    attention_modules,
    attention_scale,
    cache_kwarg,
    forward,
    window_queries,
)

log = logging.getLogger("pagekv")

#: What the model reads before it repeats the context (tokenised without special tokens).
REPEAT_PROMPT = "\n\nRepeat the previous context exactly.\n"
#: Reconstruction queries per forward: bounds the `[H, chunk, N]` attention of a chunk.
CHUNK = 256
#: The head weights' focus is kept for every sink count up to this (the app's n_sink
#: range, `pagekv.app.inputs.LIMITS`); `reconstruction_masses` refuses more.
FOCUS_SINKS = 64
#: How a head's attention over the reconstruction queries becomes one score per context
#: token: the largest (the default, as KVzip) or the mean.
AGGREGATIONS = ("max", "mean")


def reconstruction_profiles(
    model,
    cache,
    context_ids: list[int],
    prompt_ids: list[int],
    *,
    chunk: int = CHUNK,
    cache_kw: str | None = None,
    aggregation: str = "max",
    backend: str = "torch",
) -> torch.Tensor:
    """Profiles `[L, H, n]` float32 (rows sum to 1) of the reconstruction pass, by
    `aggregation` (`AGGREGATIONS`) over the reconstruction queries (`backend` as in
    `reconstruction_scores`)."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(
            f"aggregation must be one of {', '.join(AGGREGATIONS)}; got {aggregation!r}"
        )
    scores = reconstruction_scores(
        model, cache, context_ids, prompt_ids, chunk=chunk, cache_kw=cache_kw, backend=backend
    )
    return as_profiles(scores[aggregation])


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
        cache: a DynamicCache holding the context's `n` keys and values per layer; it
            is extended by the pass, so pass a copy.
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
    active = {"on": False}

    def hook(index):
        def after(module, args, kwargs, output):
            if not active["on"]:
                return None
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            cos, sin = kwargs.get("position_embeddings", args[1] if len(args) > 1 else None)
            # [1, H, c, d] in the model's dtype: the twin upcasts; the kernel takes bf16 or
            # fp16 with a cache of the same dtype to its native dot (exact products,
            # float32 sums) and anything else to its float32 dot.
            q = window_queries(module, hidden, cos, sin)
            keys = cache.layers[index].keys[:1]  # [1, G, N, d], the chunk's included
            # Causal: query i of the chunk sits at key index N - c + i.
            mean, top, masses, sinks, _ = attention_scores(
                q, keys, attention_scale(module), used, focus=(n, FOCUS_SINKS)
            )
            new = [top[0, :, :n], mean[0, :, :n] * q.shape[2], masses[0], sinks[0]]
            if (old := acc[index]) is not None:  # the max over the queries; sums of the rest
                new[0] = torch.maximum(old[0], new[0])
                new[1:] = [a + b for a, b in zip(old[1:], new[1:], strict=True)]
            acc[index] = new
            return None

        return after

    handles = [m.register_forward_hook(hook(i), with_kwargs=True) for i, m in enumerate(mods)]
    try:
        with torch.inference_mode():
            pos = n
            if prompt_ids:
                forward(model, prompt_ids, pos, cache, cache_kw, dev)
                pos += len(prompt_ids)
            active["on"] = True
            for start in range(0, n, chunk):
                part = context_ids[start : start + chunk]
                forward(model, part, pos, cache, cache_kw, dev)
                pos += len(part)
    finally:
        for h in handles:
            h.remove()
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
