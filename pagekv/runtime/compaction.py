"""Gathering the kept tokens of a K/V cache (the torch twins of `pagekv.kernels.compact`).

`gather_layer` copies one layer's kept tokens to their destination rows: what eviction
does to fill the paged decode cache (`pagekv.runtime.paged_cache.PagedCache.gathered`),
the one copy of K and V a run makes. `compact_layer` is the dense case: the kept set
of a dense plan is `Plan.kept_indices()`, `[L, G, k']`, and layer `l` gathers
`keys[:, g, idx[l, g]]` for every group `g` into a dense `[B, G, k', d]` (what kvpress's
pipeline keeps).
"""

from __future__ import annotations

import torch


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
