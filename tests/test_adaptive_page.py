"""The adaptive page size (`pagekv.maths.adaptive`): a worked case, its bound, its choice."""

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from pagekv.maths.adaptive import captured_share, choose_page_size
from pagekv.maths.config import EvictionConfig
from pagekv.maths.paging import min_feasible_budget
from pagekv.maths.plan import plan
from tests.strategies import random_profiles

# One head, 16 tokens: three scattered peaks (tokens 0, 4 and 8), the window token 15,
# and 0.025 on each of the other twelve.
SCATTERED = torch.full((1, 1, 16), 0.025)
SCATTERED[0, 0, [0, 4, 8]] = 0.2
SCATTERED[0, 0, 15] = 0.1
CFG = EvictionConfig(policy="entropy", budget=0.5, n_sink=0, window=1)  # k = 8


def plan_at(profiles, cfg, calls=None):
    def at(size):
        if calls is not None:
            calls.append(size)
        return plan(profiles, 1, cfg.replace(page_size=size))

    return at


def test_the_hand_worked_shares():
    # Token plan: token 15 protected; the best 7 free tokens are 0, 4, 8 (0.2 each) and
    # four of 0.025: free score 0.7.
    # Pages of 4: page 3 (tokens 12-15) protected, room for one more page: page 0 (the
    # lowest of three tied maxima), 0.2 + 3 x 0.025; with tokens 12-14, 0.35 of 0.7.
    # Pages of 2: page 7 (14, 15) protected, three more pages: those of 0, 4 and 8, each
    # with one 0.025 token; with token 14, 0.7 of 0.7.
    at = plan_at(SCATTERED, CFG)
    token = at(1)
    assert captured_share(token, token) == 1.0
    assert captured_share(token, at(4)) == pytest.approx(0.5, abs=1e-6)
    assert captured_share(token, at(2)) == pytest.approx(1.0, abs=1e-6)
    assert at(4).keep[0, 0].nonzero().flatten().tolist() == [0, 1, 2, 3, 12, 13, 14, 15]


def test_the_rule_takes_the_largest_page_that_passes_and_stops_there():
    calls = []
    choice = choose_page_size(plan_at(SCATTERED, CFG, calls), candidates=(2, 4), threshold=0.9)
    assert choice.page_size == 2 and calls == [1, 4, 2]
    assert choice.shares == pytest.approx({4: 0.5, 2: 1.0}, abs=1e-6)
    assert choice.plan.config.page_size == 2
    calls.clear()
    choice = choose_page_size(plan_at(SCATTERED, CFG, calls), candidates=(4, 2), threshold=0.4)
    assert choice.page_size == 4 and calls == [1, 4]  # pages of 2 not planned
    # None passes: the smallest candidate.
    choice = choose_page_size(plan_at(SCATTERED, CFG), candidates=(4,), threshold=0.9)
    assert choice.page_size == 4
    # Page size 1 among the candidates: the token plan itself, share 1.
    choice = choose_page_size(plan_at(SCATTERED, CFG), candidates=(4, 1), threshold=0.9)
    assert choice.page_size == 1 and choice.shares[1] == 1.0


def test_a_page_of_contiguous_peaks_keeps_the_large_page():
    # The same scores with the peaks in one page of 4 (tokens 4-6): pages of 4 keep all.
    p = torch.full((1, 1, 16), 0.025)
    p[0, 0, [4, 5, 6]] = 0.2
    p[0, 0, 15] = 0.1
    assert choose_page_size(plan_at(p, CFG), candidates=(4, 2), threshold=0.99).page_size == 4


def test_bad_input_is_refused():
    at = plan_at(SCATTERED, CFG)
    with pytest.raises(ValueError, match="page size 1"):
        captured_share(at(2), at(4))
    other = plan(torch.full((1, 1, 20), 0.05), 1, CFG.replace(page_size=4))
    with pytest.raises(ValueError, match="not the same prompt"):
        captured_share(at(1), other)
    with pytest.raises(ValueError, match="candidates"):
        choose_page_size(at, candidates=())
    with pytest.raises(ValueError, match="candidates"):
        choose_page_size(at, candidates=(4, 0))
    with pytest.raises(ValueError, match="threshold"):
        choose_page_size(at, threshold=1.5)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    L=st.integers(1, 3),
    G=st.integers(1, 3),
    r=st.sampled_from([1, 2, 3]),
    n=st.integers(20, 150),
    page=st.sampled_from([2, 4, 8, 16]),
    frac=st.floats(0.05, 0.9),
    allocation=st.sampled_from(["uniform", "global", "layer"]),
    policy=st.sampled_from(["entropy", "mean", "max"]),
)
def test_no_page_size_captures_more_than_the_token_plan(
    seed, L, G, r, n, page, frac, allocation, policy
):
    # The token plan keeps the best free tokens up to the same budget, and a plan at any
    # page size keeps its protected tokens and no more in all.
    n_sink, window = 2, 3
    budget = max(frac, min_feasible_budget(n, page, n_sink, window) + 1e-6)
    assume(budget <= 1.0)
    H = G * r
    profiles = random_profiles(seed, L, H, n)
    scales = 0.5 + torch.rand(L, H, generator=torch.Generator().manual_seed(seed))
    cfg = EvictionConfig(
        policy=policy, budget=budget, n_sink=n_sink, window=window, allocation=allocation
    )
    token = plan(profiles, G, cfg.replace(page_size=1), scales=scales)
    paged = plan(profiles, G, cfg.replace(page_size=page), scales=scales)
    share = captured_share(token, paged)
    assert 0.0 <= share <= 1.0 + 1e-9, share
    assert captured_share(token, token) == 1.0
