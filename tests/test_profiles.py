"""Attention profiles against a naive full-attention reference, and smoothing."""

import math

import pytest
import torch

from pagekv import attention_profiles, smooth_scores


def naive_profiles(q_win, keys):
    """Reference: full causal softmax of the window rows, built the obvious way."""
    L, H, w, d = q_win.shape
    _, G, n, _ = keys.shape
    r = H // G
    out = torch.zeros(L, H, n, dtype=torch.float64)
    for layer in range(L):
        for h in range(H):
            k = keys[layer, h // r].double()
            for i in range(w):
                pos = n - w + i
                logits = (k[: pos + 1] @ q_win[layer, h, i].double()) / math.sqrt(d)
                out[layer, h, : pos + 1] += torch.softmax(logits, 0) / w
    return out


@pytest.mark.parametrize(
    "L,H,G,w,n,d",
    [(1, 1, 1, 1, 1, 4), (2, 6, 2, 4, 9, 8), (1, 9, 3, 7, 7, 16), (2, 4, 4, 3, 20, 8)],
    ids=lambda v: str(v),
)
def test_profiles_match_naive_reference(L, H, G, w, n, d):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(L, H, w, d, generator=g) * 2
    k = torch.randn(L, G, n, d, generator=g) * 2
    got = attention_profiles(q, k)
    assert got.shape == (L, H, n) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), naive_profiles(q, k), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got.sum(-1), torch.ones(L, H), atol=1e-6, rtol=0)


def test_gqa_mapping_reads_group_of_head():
    # Keys of group 1 point at token 2 only; heads 2, 3 (group 1 with r = 2) must follow.
    d, n = 4, 3
    keys = torch.zeros(1, 2, n, d)
    keys[0, 1, 2, 0] = 50.0
    q = torch.zeros(1, 4, 1, d)
    q[..., 0] = 1.0
    prof = attention_profiles(q, keys)
    torch.testing.assert_close(prof[0, :2], torch.full((2, n), 1 / 3))
    assert bool((prof[0, 2:, 2] > 0.999).all())


def test_causal_inside_window():
    # First window query (position n - w) must not see the last key.
    n, w, d = 5, 2, 4
    keys = torch.zeros(1, 1, n, d)
    keys[0, 0, n - 1, 0] = 100.0
    q = torch.zeros(1, 1, w, d)
    q[..., 0] = 1.0
    prof = attention_profiles(q, keys)[0, 0]
    # Query 0 sees tokens 0..3 uniformly; query 1 sees token 4 almost surely.
    torch.testing.assert_close(prof[:4], torch.full((4,), 0.125), atol=1e-6, rtol=0)
    assert abs(float(prof[4]) - 0.5) < 1e-6


def test_large_logits_are_stable():
    q = torch.full((1, 1, 2, 4), 1e4)
    k = torch.randn(1, 1, 6, 4)
    prof = attention_profiles(q, k)
    assert torch.isfinite(prof).all()
    torch.testing.assert_close(prof.sum(-1), torch.ones(1, 1))


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="multiple"):
        attention_profiles(torch.zeros(1, 3, 1, 4), torch.zeros(1, 2, 5, 4))
    with pytest.raises(ValueError, match="window"):
        attention_profiles(torch.zeros(1, 2, 6, 4), torch.zeros(1, 2, 5, 4))


def test_smoothing_max_and_avg_exact():
    x = torch.tensor([[0.0, 0.0, 3.0, 0.0, 0.0, 1.0]])
    assert smooth_scores(x, 1) is x
    assert smooth_scores(x, 3, "max").tolist() == [[0.0, 3.0, 3.0, 3.0, 1.0, 1.0]]
    avg = smooth_scores(x, 3, "avg")
    torch.testing.assert_close(avg, torch.tensor([[0.0, 1.0, 1.0, 1.0, 1 / 3, 0.5]]))
    with pytest.raises(ValueError):
        smooth_scores(x, 4)
