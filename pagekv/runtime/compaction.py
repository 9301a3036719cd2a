"""Compaction: gather the kept tokens of one layer's K/V cache (torch twin).

The kept set of a dense plan is `Plan.kept_indices()`, `[L, G, k']`; layer `l`
gathers `keys[:, g, idx[l, g]]` for every group `g` into a dense `[B, G, k', d]`.
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
