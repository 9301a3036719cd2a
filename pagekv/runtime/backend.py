"""Backend choice: Triton kernels (`kernels/`) or their torch twins, same results.

What `auto`, `torch` and `triton` run: docs/design.md, "What runs where" (`resolve_backend`).
Nothing here imports Triton or queries CUDA at import time; each dispatch logs (logger
"pagekv") which backend ran and returns its name, so results can record it.

The dispatch functions (the runner's entry points): `score_window`, `attention_scores`
(the reconstruction scorer's), `page_scores` (`select_pages`, torch, then decides),
`gather_layers` (eviction into the paged decode cache) and `compact_layers` (a dense
compacted cache, kvpress's).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Sequence

import torch

from pagekv.maths.entropy import HeadMasses, mass_sums, row_focus_sums
from pagekv.maths.paging import page_reduce, protected_pages
from pagekv.maths.policies import max_pool, weighted_pool
from pagekv.maths.profiles import attention_profiles, check_window_shapes, future_mask

log = logging.getLogger("pagekv")

BACKENDS = ("auto", "torch", "triton")
_KERNEL_MODULES = ("pagekv.kernels.score", "pagekv.kernels.pool_pages", "pagekv.kernels.compact")


class BackendError(RuntimeError):
    """The requested backend cannot run here (no Triton, or no interpreter on CPU)."""


def _kernel_modules():
    """Import the kernel modules (and so Triton); BackendError when that fails."""
    try:
        return [importlib.import_module(m) for m in _KERNEL_MODULES]
    except ImportError as e:  # triton missing, or kernels/ not on the path
        raise BackendError(f"the Triton backend is unavailable: {e}") from e


def _interpreted(mods) -> bool:
    from pagekv.kernels._common import is_interpreted

    kernels = [getattr(m, name) for m in mods for name in dir(m) if name.startswith("_")]
    jitted = [k for k in kernels if type(k).__name__ in ("JITFunction", "InterpretedFunction")]
    return all(is_interpreted(k) for k in jitted)


def resolve_backend(name: str, tensor_or_device) -> str:
    """`"torch"` or `"triton"`: what backend `name` means for this tensor or device.

    Raises:
        ValueError: an unknown name.
        BackendError: `triton` where it cannot run: Triton does not import; or a CPU
            tensor while the kernels were defined without `TRITON_INTERPRET=1`.
    """
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {name!r}")
    device = getattr(tensor_or_device, "device", None) or torch.device(tensor_or_device)
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return "torch"
    if name == "auto":
        try:
            _kernel_modules()
        except BackendError as e:
            log.warning("pagekv: %s; using the torch twins on %s", e, device)
            return "torch"
        return "triton"
    mods = _kernel_modules()
    if device.type == "cpu" and not _interpreted(mods):
        raise BackendError(
            "backend 'triton' on CPU tensors runs the Triton interpreter, which needs "
            "TRITON_INTERPRET=1 in the environment before the kernels are first "
            "imported (set it before importing kernels or calling pagekv.runtime.backend); "
            "use backend='torch' or 'auto' on CPU otherwise"
        )
    if device.type not in ("cuda", "cpu"):
        raise BackendError(f"no Triton backend for device {device}; use backend='torch'")
    return "triton"


def _ran(op: str, backend: str, device) -> None:
    log.debug("%s ran on the %s backend (%s)", op, backend, device)


def score_window(
    q_win: torch.Tensor,
    keys: torch.Tensor | Sequence[torch.Tensor],
    n_sink: int,
    scale: float | Sequence[float] | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, HeadMasses, str]:
    """Profiles and per-head masses of all layers (one launch pair on Triton).

    Args:
        q_win: `[L, H, w, d]` window queries after RoPE (or `[H, w, d]` for one layer),
            in the cache's dtype or float32 (the twin computes in float32; the kernel
            takes fp16/bf16 queries over keys of their dtype to its native dot).
        keys: `[L, G, n, d]` cached keys (or `[G, n, d]`), or one `[G, n, d]` tensor per
            layer, as a model's cache holds them (a model's whole cache is scored in one
            launch pair, with no stacked copy).
        n_sink: sink tokens; scale: softmax scale, one or one per layer (default
            `1/sqrt(d)`).

    Returns:
        `(profiles [L, H, n] float32, masses, backend_used)`: `masses` is a
        `pagekv.maths.entropy.HeadMasses` built from the per-head sums (the kernel's, or
        `mass_sums` of the twin's profiles) by the one conversion in the core. No host
        wait on either backend.
    """
    layers = _layers(keys[None] if isinstance(keys, torch.Tensor) and keys.dim() == 3 else keys)
    if not layers:
        raise ValueError("keys holds no layer")
    used = resolve_backend(backend, layers[0])
    if q_win.dim() == 3:
        q_win = q_win[None]
    if used == "triton":
        from pagekv.kernels.score import score_layers as kernel

        prof, sums = kernel(q_win, layers, n_sink, scale=scale)
    else:
        prof = _profiles_twin(q_win, layers, scale)
        sums = mass_sums(prof, n_sink)
    masses = HeadMasses.from_sums(sums, prof.shape[-1], n_sink)
    _ran("score_window", used, layers[0].device)
    return prof, masses, used


def _profiles_twin(q_win, layers: list[torch.Tensor], scale) -> torch.Tensor:
    """`attention_profiles` of per-layer keys, each layer with its own scale."""
    L = len(layers)
    scales = [scale] * L if scale is None or isinstance(scale, (int, float)) else list(scale)
    if len(scales) != L:
        raise ValueError(f"need one scale per layer ({L}); got {len(scales)}")
    check_window_shapes(q_win, torch.empty(L, *layers[0].shape, device="meta"))
    out = torch.empty(L, q_win.shape[1], layers[0].shape[1], dtype=torch.float32,
                      device=layers[0].device)  # fmt: skip
    for i, (k, s) in enumerate(zip(layers, scales, strict=True)):
        out[i] = attention_profiles(q_win[i : i + 1], k[None], s)[0]
    return out


def attention_scores(
    q: torch.Tensor,
    keys: torch.Tensor,
    scale: float | None = None,
    backend: str = "auto",
    focus: tuple[int, int] | None = None,
) -> tuple:
    """The mean and the max over `w` causal queries of their attention on every key.

    Query `i` sits at key index `n - w + i` and sees the keys `t <= n - w + i` (the
    geometry of `score_window`, for any `w`: a window, or a chunk of a longer pass):

        mean_h(t) = (1 / w) sum_i softmax_t(q_{h,i} . k(t) * scale)
        top_h(t) = max_i softmax_t(q_{h,i} . k(t) * scale)

    Args:
        q: `[L, H, w, d]` queries after RoPE (or `[H, w, d]`), any float dtype.
        keys: `[L, G, n, d]` keys (or `[G, n, d]`), the queries' own included.
        scale: softmax scale (default `1/sqrt(d)`).
        focus: `(n_ctx, S)`: also how focused each query is on the first `n_ctx` keys.

    Returns:
        `(mean [L, H, n], top [L, H, n], backend_used)`, float32. On Triton it is the
        scoring kernel with `return_max` (its query axis tiled, so long `w` is fine);
        the torch twin (`_attention_scores_torch`) computes in float32, one layer at a
        time, so its largest tensor is one layer's `[H, w, n]` attention. With `focus`,
        `(mean, top, masses [L, H, S + 1], sinks [L, H, S + 1], backend_used)`: the
        `row_focus_sums` of the queries' attention rows (summed over the queries, per
        head, for every sink count `0 .. S`), a reduction along each row that the
        scoring kernel (a reduction over queries per key) does not make: torch ops give
        it on both backends, one layer's `[H, w, n]` attention at a time.
    """
    used = resolve_backend(backend, keys)
    if q.dim() == 3 and keys.dim() == 3:
        q, keys = q[None], keys[None]
    if used == "triton":
        from pagekv.kernels.score import score_layers as kernel

        mean, _, top = kernel(q, keys, 0, scale=scale, return_max=True)
        rows = () if focus is None else _attention_scores_torch(q, keys, scale, focus, False)[2:]
    else:
        mean, top, *rows = _attention_scores_torch(q, keys, scale, focus)
    _ran("attention_scores", used, keys.device)
    return (mean, top, *rows, used)


def _attention_scores_torch(
    q: torch.Tensor,
    keys: torch.Tensor,
    scale: float | None,
    focus: tuple[int, int] | None = None,
    reduce: bool = True,
) -> tuple[torch.Tensor, ...]:
    """Torch twin of `attention_scores` (the reference): float32 softmax per layer. With
    `focus=(n_ctx, max_sink)` also `row_focus_sums` of every layer's rows (`[L, H, S+1]`
    twice); `reduce=False` skips the mean and max (returned as None)."""
    L, H, w, d, G, n = check_window_shapes(q, keys)
    r = H // G
    scale = d**-0.5 if scale is None else float(scale)
    future = future_mask(n, w, keys.device)  # query i (key index n - w + i) sees t <= n - w + i
    mean = top = masses = sinks = None
    if reduce:
        mean = torch.empty(L, H, n, dtype=torch.float32, device=keys.device)
        top = torch.empty_like(mean)
    if focus is not None:
        masses = torch.empty(L, H, focus[1] + 1, dtype=torch.float32, device=keys.device)
        sinks = torch.empty_like(masses)
    for layer in range(L):
        qq = q[layer].float().reshape(G, r * w, d)  # heads of a group share its keys
        logits = torch.bmm(qq, keys[layer].float().transpose(1, 2)).mul_(scale)
        logits = logits.view(G, r, w, n).masked_fill_(future, float("-inf"))
        probs = torch.softmax(logits, dim=-1)  # [G, r, w, n]
        del logits
        if reduce:
            mean[layer] = probs.mean(2).reshape(H, n)
            top[layer] = probs.amax(2).reshape(H, n)
        if focus is not None:
            m, s = row_focus_sums(probs.view(H, w, n), *focus)
            masses[layer], sinks[layer] = m, s
    return (mean, top) if focus is None else (mean, top, masses, sinks)


def page_scores(
    scores: torch.Tensor,
    weights: torch.Tensor | None,
    n_groups: int,
    page_size: int,
    n_sink: int,
    window: int,
    pooling: str = "weighted",
    reduction: str = "max",
    backend: str = "auto",
    return_pooled: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, str]:
    """Pool the heads of each group, then score pages.

    Args:
        scores: `[L, H, n]` token scores; weights: `[L, H]` for `pooling="weighted"`
            (policies entropy / entropy_nosink / mean), None for `pooling="max"`.
        n_groups: `G`; page_size: `P`; n_sink, window: the protected tokens (pass the
            effective window, `min(window, n)`).
        reduction: "max" or "sum" over a page's tokens.
        return_pooled: also return the pooled token scores (else None; the kernel
            then skips writing them).

    Returns:
        `(pooled [L, G, n] or None, page_scores [L, G, n_pages], protected [n_pages] bool,
        backend_used)`. Feed `page_scores` and `protected` to
        `pagekv.maths.paging.select_pages`: both backends give bit-identical page scores,
        max- or sum-reduced, since both add the heads, and a page's tokens, in index
        order (see `kernels/pool_pages.py`), so they keep the same pages on ties.
    """
    used = resolve_backend(backend, scores)
    n = scores.shape[-1]
    if used == "triton":
        from pagekv.kernels.pool_pages import pool_pages

        pooled, pages, prot = pool_pages(
            scores, weights, n_groups, page_size, n_sink, window, pooling, reduction,
            return_pooled=return_pooled,
        )  # fmt: skip
    else:
        if pooling == "weighted":
            pooled = weighted_pool(scores, weights, n_groups)
        elif pooling == "max":
            pooled = max_pool(scores, n_groups)
        else:
            raise ValueError(f"pooling must be 'weighted' or 'max'; got {pooling!r}")
        pages = page_reduce(pooled, page_size, reduction)
        prot = protected_pages(n, page_size, n_sink, window, scores.device)
        pooled = pooled if return_pooled else None
    _ran("page_scores", used, scores.device)
    return pooled, pages, prot, used


def pooler(backend: str = "auto"):
    """`plan`'s pooling step on `backend` (`plan(..., pool_pages=pooler(backend))`):
    the Triton kernel where `backend` resolves to it, its torch twin otherwise."""

    def pool_pages(scores, weights, n_groups, page_size, n_sink, window, reduction):
        _, pages, _, used = page_scores(
            scores, weights, n_groups, page_size, n_sink, window,
            pooling="max" if weights is None else "weighted", reduction=reduction,
            backend=backend, return_pooled=False,
        )  # fmt: skip
        return pages, used

    return pool_pages


def compact_layers(
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    kept_idx: Sequence[torch.Tensor],
    backend: str = "auto",
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], str]:
    """Gather the kept tokens of a whole cache, kept as one tensor per layer.

    Args:
        keys, values: per layer `[B, G, n, d]` (a cache's layers, one shape and dtype).
        kept_idx: per layer sorted kept indices `[G, k_l]`; `k_l` may differ by layer.

    Returns:
        `(per layer (keys [B, G, k_l, d], values [B, G, k_l, d]), backend_used)`,
        bit-identical across backends. On Triton it is one launch for all layers
        (`pagekv.kernels.compact.compact_every_layer`) and one host wait (the bounds check), however
        many layers; the twin runs `compact_layer` per layer and never waits.
    """
    used = resolve_backend(backend, keys[0])
    if used == "triton":
        from pagekv.kernels.compact import compact_every_layer as kernel

        out = kernel(keys, values, kept_idx)
    else:
        out = [compact_layer(k, v, i) for k, v, i in zip(keys, values, kept_idx, strict=True)]
    _ran("compact_layers", used, keys[0].device)
    return out, used


def gather_layers(keys, values, kept_idx, out_keys, out_values, starts, counts, backend="auto"):
    """Copy the kept tokens of every layer to their destination rows, in place
    (`pagekv.runtime.backend.gather_layer`'s arguments, one per layer; a layer's
    `kept_idx` None: every token). On Triton it is one launch for all layers
    (`pagekv.kernels.compact.gather_every_layer`, every layer's indices given) and one
    host wait (the bounds check); the twin runs `gather_layer` per layer. Returns the
    backend that ran."""
    used = resolve_backend(backend, keys[0])
    if used == "triton":
        from pagekv.kernels.compact import gather_every_layer as kernel

        n = keys[0].shape[2]
        every = None  # every token, as indices a layer shares (an expanded arange)
        idx = []
        for i in kept_idx:
            if i is None and every is None:
                every = torch.arange(n, device=keys[0].device).expand(keys[0].shape[1], n)
            idx.append(every if i is None else i)
        kernel(keys, values, idx, out_keys, out_values, starts, counts)
    else:
        for layer in zip(keys, values, kept_idx, out_keys, out_values, starts, counts, strict=True):
            gather_layer(*layer)
    _ran("gather_layers", used, keys[0].device)
    return used


def _layers(x: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """`[L, G, n, d]`, or a sequence of per-layer `[G, n, d]` / `[1, G, n, d]` -> list."""
    layers = list(x.unbind(0)) if isinstance(x, torch.Tensor) else list(x)
    out = []
    for i, t in enumerate(layers):
        if t.dim() == 4 and t.shape[0] == 1:
            t = t[0]
        if t.dim() != 3:
            raise ValueError(f"layer {i}: expected [G, n, d] (or batch 1); got {tuple(t.shape)}")
        out.append(t)
    return out


# --------------------------------------------------------------- compaction (torch twins)
# Gathering the kept tokens of a K/V cache (the torch twins of `pagekv.kernels.compact`).
#
# `gather_layer` copies one layer's kept tokens to their destination rows: what eviction
# does to fill the paged decode cache (`pagekv.runtime.paged_cache.PagedCache.gathered`),
# the one copy of K and V a run makes. `compact_layer` is the dense case: the kept set
# of a dense plan is `Plan.kept_indices()`, `[L, G, k']`, and layer `l` gathers
# `keys[:, g, idx[l, g]]` for every group `g` into a dense `[B, G, k', d]` (what kvpress's
# pipeline keeps).


def compact_layer(
    keys: torch.Tensor, values: torch.Tensor, kept_idx: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather kept tokens: keys/values `[B, G, n, d]`, kept_idx `[G, k']` -> `[B, G, k', d]`.

    Example: `n = 4`, `kept_idx = [[0, 3]]` keeps tokens 0 and 3 of the only group,
    in that order (ascending indices keep the positional order of the prompt).
    """
    if keys.dim() != 4 or keys.shape != values.shape:
        raise ValueError(
            f"keys and values must both be [B, G, n, d]; got {tuple(keys.shape)} "
            f"and {tuple(values.shape)}"
        )
    B, G, n, d = keys.shape
    if kept_idx.dim() != 2 or kept_idx.shape[0] != G:
        raise ValueError(f"kept_idx must be [G={G}, k']; got {tuple(kept_idx.shape)}")
    idx = kept_idx.to(device=keys.device, dtype=torch.long)[None, :, :, None]
    idx = idx.expand(B, G, kept_idx.shape[1], d)  # [B, G, k', d]
    return torch.gather(keys, 2, idx), torch.gather(values, 2, idx)


def gather_layer(
    keys: torch.Tensor,
    values: torch.Tensor,
    kept_idx: torch.Tensor | None,
    out_keys: torch.Tensor,
    out_values: torch.Tensor,
    starts,
    counts,
) -> None:
    """Copy one layer's kept tokens to their destination rows, in place.

    Args:
        keys, values: `[B, G, n, d]`, `B` the destination's rows `R` or 1 (every row
            reads batch row 0).
        kept_idx: sorted indices `[R, G, k]` (or `[G, k]` for every row alike), of
            which (row r, group g) copies its first `counts[r][g]`; None: every token.
        out_keys, out_values: contiguous, read as `[rows, d]`.
        starts, counts: `[R][G]` host ints: (r, g)'s tokens go to rows `starts[r][g]`
            onwards.

    Example: `starts = [[0, 8]]`, `counts = [[2, 1]]`, `kept_idx = [[[0, 3]], [[5, 5]]]`
    (R = 1, G = 2) writes group 0's tokens 0 and 3 to rows 0 and 1 and group 1's token
    5 to row 8.
    """
    d = keys.shape[-1]
    flat_k, flat_v = out_keys.view(-1, d), out_values.view(-1, d)
    for r, (start_row, count_row) in enumerate(zip(starts, counts, strict=True)):
        b = r if keys.shape[0] > 1 else 0
        for g, (s, c) in enumerate(zip(start_row, count_row, strict=True)):
            if kept_idx is None:
                flat_k[s : s + c].copy_(keys[b, g, :c])
                flat_v[s : s + c].copy_(values[b, g, :c])
                continue
            idx = (kept_idx[r] if kept_idx.dim() == 3 else kept_idx)[g, :c]
            torch.index_select(keys[b, g], 0, idx, out=flat_k[s : s + c])
            torch.index_select(values[b, g], 0, idx, out=flat_v[s : s + c])
