"""Metrics of a selection (docs/design.md, "The data path"): union overhead, disagreement and its
bounds, needle retention, sink advantage. Counts are exact integers; ratios float64.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import comb

import torch


@dataclass(frozen=True)
class GroupOverlap:
    """Head-independent selections of one prompt, per (layer, group).

    Shapes: `union_tokens`, `uor`, `mean_disagreement`, `lower`, `upper`: `[L, G]`;
    `intersections`, `disagreement`: `[L, G, r, r]` (diagonal: `k'` and 0).
    """

    per_head_tokens: int  # k', tokens each head keeps
    union_tokens: torch.Tensor  # int64 [L, G]
    intersections: torch.Tensor  # int64 [L, G, r, r]
    uor: torch.Tensor  # float64 [L, G]
    disagreement: torch.Tensor  # float64 [L, G, r, r]
    mean_disagreement: torch.Tensor  # float64 [L, G] (0 when r = 1)
    lower: torch.Tensor  # float64 [L, G]
    upper: torch.Tensor  # float64 [L, G]


def group_overlap(head_keep: torch.Tensor, n_groups: int) -> GroupOverlap:
    """UOR, pairwise disagreement and the two-sided bounds from per-head selections.

    Args:
        head_keep: bool `[L, H, n]`; every head keeps the same number `k'` of tokens.
        n_groups: G; heads `g*r .. g*r + r - 1` share group `g`.

    `UOR_g = |union S_h| / k'`; `D_ab = 1 - |S_a & S_b| / k'`; `D_g` = mean over pairs;
    lower = `max(1 + max_ab D_ab, r - C(r,2) (1 - D_g))`,
    upper = `min(r, 1 + min_a sum_{b != a} D_ab)`.
    """
    L, H, n = head_keep.shape
    r = H // n_groups
    counts = head_keep.sum(-1)
    # The smallest and largest count in one read (one host wait).
    lo, hi = torch.stack([counts.amin(), counts.amax()]).tolist() if counts.numel() else (0, 0)
    if lo != hi:
        raise ValueError("every head must keep the same number of tokens for UOR")
    k = lo
    hk = head_keep.view(L, n_groups, r, n)
    union = hk.any(dim=2).sum(-1)  # [L, G]
    # Pairwise intersections as a Gram matrix of 0/1 rows: exact in float64 up to 2^53.
    f = hk.to(torch.float64)
    inter = torch.einsum("lgan,lgbn->lgab", f, f).round().to(torch.int64)  # [L, G, r, r]
    kd = float(max(k, 1))
    uor = union.to(torch.float64) / kd
    dis = 1.0 - inter.to(torch.float64) / kd
    eye = torch.eye(r, dtype=torch.bool, device=head_keep.device)
    n_pairs = comb(r, 2)
    if n_pairs:
        pair_sum = dis.masked_fill(eye, 0.0).sum((-1, -2)) / 2
        mean_dis = pair_sum / n_pairs
        max_dis = dis.masked_fill(eye, float("-inf")).amax((-1, -2))
        lower = torch.maximum(1.0 + max_dis, r - n_pairs * (1.0 - mean_dis))
        row = dis.masked_fill(eye, 0.0).sum(-1)  # [L, G, r]
        upper = torch.clamp(1.0 + row.amin(-1), max=float(r))
    else:  # r = 1: one head, no pairs; the union is that head's set.
        mean_dis = torch.zeros(L, n_groups, dtype=torch.float64, device=head_keep.device)
        lower, upper = torch.ones_like(mean_dis), torch.ones_like(mean_dis)
    return GroupOverlap(k, union, inter, uor, dis, mean_dis, lower, upper)


def needle_retention(keep: torch.Tensor, needle_positions) -> torch.Tensor:
    """Fraction of the needle's answer tokens kept, per (layer, group).

    `keep` bool `[L, G, n]`; `needle_positions` token indices (list or 1-D tensor).
    Returns float64 `[L, G]`; `(result == 1).all()` says every (layer, group) kept
    the whole needle.
    """
    idx = torch.as_tensor(needle_positions, dtype=torch.long, device=keep.device).flatten()
    if idx.numel() == 0:
        raise ValueError("needle_positions is empty")
    n = keep.shape[-1]
    if int(idx.min()) < 0 or int(idx.max()) >= n:
        raise ValueError(f"needle positions must lie in [0, {n}); got {idx.tolist()}")
    return keep[..., idx].to(torch.float64).mean(-1)


def sink_advantage(weights: torch.Tensor, is_sink: torch.Tensor, n_groups: int) -> torch.Tensor:
    """Mean weight of a group's sink heads over the mean weight of its other heads.

    `weights` float `[L, H]`, `is_sink` bool `[L, H]` -> float64 `[L, G]`; NaN where a
    group lacks sink heads or non-sink heads (the ratio is undefined there).
    Above 1: the sink heads out-weigh the rest (the masquerade, without isolation).
    """
    L, H = weights.shape
    r = H // n_groups
    w = weights.to(torch.float64).view(L, n_groups, r)
    s = is_sink.view(L, n_groups, r)
    n_s = s.sum(-1)
    n_o = r - n_s
    mean_s = (w * s).sum(-1) / n_s.clamp_min(1)
    mean_o = (w * ~s).sum(-1) / n_o.clamp_min(1)
    ratio = mean_s / mean_o
    return torch.where((n_s > 0) & (n_o > 0), ratio, torch.full_like(ratio, float("nan")))


def isolation_gain(
    weights_isolated: torch.Tensor, weights_nosink: torch.Tensor, sinks: torch.Tensor | None = None
) -> tuple:
    """`(head, gain)` of one layer (`[H]` weights with and without sink isolation): the
    head whose weight isolation raises most, and by how much (where the weight it takes
    from the sink heads goes). With `sinks` (bool `[H]`, the layer's sink heads), only
    the other heads compete: a sink head is never the one that gains most; `(-1, 0.0)`
    where every head is a sink head."""
    gain = (weights_isolated - weights_nosink).float()
    if sinks is not None:
        gain = gain.masked_fill(sinks.to(torch.bool), float("-inf"))
        if bool(torch.isinf(gain).all()):
            return -1, 0.0
    h = int(gain.argmax())
    return h, float(gain[h])


def summarize_sink_advantage(adv: torch.Tensor) -> dict:
    """Mean and max over the groups where the sink advantage is defined."""
    ok = ~torch.isnan(adv)
    vals = adv[ok]
    return {
        "groups": int(ok.sum()),
        "mean": float(vals.mean()) if vals.numel() else float("nan"),
        "max": float(vals.max()) if vals.numel() else float("nan"),
    }
