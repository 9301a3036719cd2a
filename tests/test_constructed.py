"""Constructed instances: the needle-retention bound's two halves and the sink masquerade."""

import pytest
import torch

from pagekv import EvictionConfig, plan, sink_advantage
from pagekv.maths.constructed import mechanism_profiles


def one_free_page(n, P=4):
    """Sinks page + window page protected; the budget leaves room for one more page."""
    return dict(page_size=P, n_sink=4, window=4, budget=(3 * P) / n)


@pytest.mark.parametrize("n", [64, 256, 1024])
def test_mean_pooling_evicts_the_needle_entropy_keeps_it(n):
    mech = mechanism_profiles(
        n=n, heads=3, retrieval_strength=0.9, distractor_heads=2, distractor_strength=0.48
    )
    P = 4
    geo = one_free_page(n, P)
    needle_page = mech.needle_token // P
    dist_page = mech.distractor_tokens[0] // P
    mean = plan(mech.profiles, 1, EvictionConfig(policy="mean", **geo))
    ent = plan(mech.profiles, 1, EvictionConfig(policy="entropy", **geo))
    s_star = float(mech.profiles[0, 0, mech.needle_token])
    # Second half: mean pooling's weight 1/r makes (1/r) s* fall short of the
    # distractor page, the page that is kept instead.
    c_mean = float(mean.page_scores[0, 0, dist_page])
    assert s_star / 3 < c_mean
    assert not bool(mean.page_keep[0, 0, needle_page]) and bool(mean.page_keep[0, 0, dist_page])
    # First half: the entropy weight of the retrieval head clears the same competitor.
    w_star = float(ent.head_weights[0, 0])
    c_ent = float(ent.page_scores[0, 0, dist_page])
    assert w_star * s_star > c_ent
    assert bool(ent.page_keep[0, 0, needle_page]) and not bool(ent.page_keep[0, 0, dist_page])
    assert float(ent.needle_retention([mech.needle_token])[0, 0]) == 1.0
    assert float(mean.needle_retention([mech.needle_token])[0, 0]) == 0.0


def test_a_weak_retrieval_head_is_lost_by_both():
    # The bound is a sufficient condition: below it, entropy pooling loses the needle too.
    mech = mechanism_profiles(n=64, retrieval_strength=0.3, distractor_strength=0.48)
    ent = plan(mech.profiles, 1, EvictionConfig(policy="entropy", **one_free_page(64)))
    assert not bool(ent.page_keep[0, 0, mech.needle_token // 4])


def test_sink_head_masquerades_without_isolation_only():
    n = 256
    mech = mechanism_profiles(
        n=n, heads=3, retrieval_strength=0.6, distractor_heads=0, sink_head=True, sink_strength=0.95
    )
    assert mech.roles == ("retrieval", "sink", "diffuse")
    p = plan(mech.profiles, 1, EvictionConfig(policy="entropy", budget=0.5))
    assert p.sink_heads[0].tolist() == [False, True, False]
    w_iso, w_raw = p.weights_isolated[0], p.weights_nosink[0]
    # Without isolation the sink head has the largest weight of its group...
    assert int(w_raw.argmax()) == 1
    # ...with isolation its remaining profile is uniform: the smallest weight.
    assert int(w_iso.argmin()) == 1 and int(w_iso.argmax()) == 0
    adv_raw = float(sink_advantage(p.weights_nosink, p.sink_heads, 1)[0, 0])
    adv_iso = float(sink_advantage(p.weights_isolated, p.sink_heads, 1)[0, 0])
    # Hand values: collision masses ~ 0.95^2 (sink), ~0.6^2 (retrieval), 1/n (diffuse).
    assert adv_raw > 4.0 and adv_iso < 0.05
    assert adv_raw == pytest.approx(2 * 0.9026 / (0.3613 + 1 / n), rel=0.02)


def test_pure_sink_head_guard():
    # All mass on the sinks: the isolated profile is defined as uniform (SINK_EPS guard).
    n = 32
    prof = torch.zeros(1, 2, n)
    prof[0, 0, 0] = 1.0
    prof[0, 1] = 1.0 / n
    p = plan(prof, 1, EvictionConfig(policy="entropy", budget=0.5, page_size=1, window=4))
    assert torch.isfinite(p.head_weights).all()
    # Both isolated profiles are uniform over the 28 non-sink tokens: equal weights.
    torch.testing.assert_close(p.weights_isolated[0], torch.tensor([0.5, 0.5]))
    assert float(p.weights_nosink[0, 0]) > 0.9
