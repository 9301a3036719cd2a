"""Metrics on small hand-made selections."""

import math

import pytest
import torch

from pagekv import group_overlap, needle_retention, sink_advantage
from pagekv.maths.metrics import summarize_sink_advantage


def sets_to_mask(sets, n):
    m = torch.zeros(1, len(sets), n, dtype=torch.bool)
    for h, s in enumerate(sets):
        m[0, h, list(s)] = True
    return m


def test_three_heads_by_hand():
    # k' = 4 each over n = 10; S0 = {0,1,2,3}, S1 = {0,1,4,5}, S2 = {0,6,7,8}.
    hk = sets_to_mask([{0, 1, 2, 3}, {0, 1, 4, 5}, {0, 6, 7, 8}], 10)
    ov = group_overlap(hk, 1)
    assert ov.per_head_tokens == 4
    assert ov.union_tokens.tolist() == [[9]]
    assert ov.uor.tolist() == [[9 / 4]]
    assert ov.intersections[0, 0].tolist() == [[4, 2, 1], [2, 4, 1], [1, 1, 4]]
    d01, d02, d12 = 1 - 2 / 4, 1 - 1 / 4, 1 - 1 / 4
    assert float(ov.mean_disagreement[0, 0]) == pytest.approx((d01 + d02 + d12) / 3)
    lower = max(1 + max(d01, d02, d12), 3 - 3 * (1 - (d01 + d02 + d12) / 3))
    upper = min(3, 1 + min(d01 + d02, d01 + d12, d02 + d12))
    assert float(ov.lower[0, 0]) == pytest.approx(lower)  # 2.0
    assert float(ov.upper[0, 0]) == pytest.approx(upper)  # 2.25: tight here
    assert lower <= 9 / 4 <= upper


def test_single_head_groups():
    hk = sets_to_mask([{1, 2}, {3, 4}], 6)
    ov = group_overlap(hk, 2)
    assert ov.uor.tolist() == [[1.0, 1.0]]
    assert ov.lower.tolist() == ov.upper.tolist() == [[1.0, 1.0]]


def test_unequal_head_counts_rejected():
    with pytest.raises(ValueError, match="same number"):
        group_overlap(sets_to_mask([{1}, {2, 3}], 5), 1)


def test_needle_retention():
    keep = torch.zeros(2, 1, 8, dtype=torch.bool)
    keep[0, 0, [2, 3]] = True
    keep[1, 0, [3]] = True
    torch.testing.assert_close(
        needle_retention(keep, [2, 3]), torch.tensor([[1.0], [0.5]], dtype=torch.float64)
    )
    with pytest.raises(ValueError, match="empty"):
        needle_retention(keep, [])
    with pytest.raises(ValueError, match="positions"):
        needle_retention(keep, [8])


def test_sink_advantage_defined_only_for_mixed_groups():
    w = torch.tensor([[0.6, 0.2, 0.2, 0.5, 0.5, 0.0]])
    s = torch.tensor([[True, False, False, False, False, False]])
    adv = sink_advantage(w, s, 2)
    assert adv[0, 0].item() == pytest.approx(3.0)
    assert math.isnan(adv[0, 1].item())
    summary = summarize_sink_advantage(adv)
    assert summary["groups"] == 1 and summary["max"] == pytest.approx(3.0)
