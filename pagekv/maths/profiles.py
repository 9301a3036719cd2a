"""Attention profiles from the observation window (docs/design.md, "The data path").

`a_h(t) = mean_{q in window} softmax_t(q_h . k_g(t) / sqrt(d))`, causal: the window's
i-th query sits at position `n - w + i` and sees keys `t <= n - w + i`. Only a
`[w, n]` block of logits per head is formed, never `[n, n]`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def check_window_shapes(q_win: torch.Tensor, keys: torch.Tensor) -> tuple[int, ...]:
    """Validate `q_win [L, H, w, d]` against `keys [L, G, n, d]`; returns `(L, H, w, d, G, n)`.

    The Triton launcher (kernels/score.py) checks the same with its own copy in
    `pagekv.kernels._common`, since the kernels import nothing from `pagekv`.
    """
    if q_win.dim() != 4 or keys.dim() != 4:
        raise ValueError(
            f"q_win must be [L, H, w, d] and keys [L, G, n, d]; got {tuple(q_win.shape)} "
            f"and {tuple(keys.shape)}"
        )
    L, H, w, d = q_win.shape
    Lk, G, n, dk = keys.shape
    if Lk != L or dk != d:
        raise ValueError(f"q_win {tuple(q_win.shape)} and keys {tuple(keys.shape)} disagree")
    if G == 0 or H % G != 0:
        raise ValueError(f"query heads H={H} must be a multiple of KV groups G={G}")
    if not 1 <= w <= n:
        raise ValueError(f"window w={w} must be in [1, n={n}]")
    return L, H, w, d, G, n


def future_mask(n: int, w: int, device=None) -> torch.Tensor:
    """The causal mask of the last `w` of `n` tokens as queries: bool `[w, n]`, True where
    key `t` lies after query `i` (at position `n - w + i`), the keys it must not see.
    The one definition, for every torch path that attends causally (the profiles, the
    reconstruction pass's rows, the paged cache's several new tokens).

    >>> future_mask(3, 2).int().tolist()
    [[0, 0, 1], [0, 0, 0]]
    """
    return torch.ones(w, n, dtype=torch.bool, device=device).triu_(n - w + 1)


def attention_profiles(
    q_win: torch.Tensor, keys: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Mean causal softmax attention of the window's queries over the prompt's keys.

    Args:
        q_win: `[L, H, w, d]` the last `w` prompt positions' queries, after RoPE.
        keys: `[L, G, n, d]` the keys the cache holds (after RoPE); `H % G == 0`,
            head `h` reads group `h // (H // G)` (GQA).
        scale: softmax scale, default `1 / sqrt(d)`.

    Returns:
        `[L, H, n]` float32 profiles; each row sums to 1.

    Example (one head, two keys, zero logits): the last query sees both keys, so
    `attention_profiles(zeros(1,1,1,4), zeros(1,1,2,4))` is `[[[0.5, 0.5]]]`.
    """
    L, H, w, d, G, n = check_window_shapes(q_win, keys)
    r = H // G
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    future = future_mask(n, w, keys.device)  # query i (position n - w + i) sees t <= n - w + i
    out = torch.empty(L, H, n, dtype=torch.float32, device=keys.device)
    for layer in range(L):  # one layer at a time bounds memory at H * w * n floats
        q = q_win[layer].float().reshape(G, r * w, d)  # [G, r*w, d]
        k = keys[layer].float()  # [G, n, d]
        logits = torch.bmm(q, k.transpose(1, 2)).mul_(scale).view(G, r, w, n)
        logits.masked_fill_(future, float("-inf"))
        # softmax subtracts the row max before exp, so large logits cannot overflow.
        probs = torch.softmax(logits, dim=-1)  # [G, r, w, n]
        out[layer] = probs.mean(dim=2).reshape(H, n)
    return out


def smooth_scores(scores: torch.Tensor, width: int, kind: str = "max") -> torch.Tensor:
    """1-D pooling along the last axis with odd `width` (SnapKV's smoothing).

    Same length out as in; windows are clipped at the ends (max ignores the
    padding, avg divides by the number of real tokens in the window).
    """
    if width == 1:
        return scores
    if width % 2 != 1:
        raise ValueError(f"smoothing width must be odd; got {width}")
    shape = scores.shape
    x = scores.reshape(-1, 1, shape[-1])
    pad = width // 2
    if kind == "max":
        y = F.max_pool1d(x, kernel_size=width, stride=1, padding=pad)
    elif kind == "avg":
        y = F.avg_pool1d(x, kernel_size=width, stride=1, padding=pad, count_include_pad=False)
    else:
        raise ValueError(f"smoothing kind must be 'max' or 'avg'; got {kind!r}")
    return y.reshape(shape)
