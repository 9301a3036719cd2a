"""Hand-worked cases: the exact kept set of every policy.

The worked instance (one layer, n = 12 tokens, page size 2, n_sink = 2, window = 2):

    pages:      0      1      2      3      4      5
    tokens:   0  1 | 2  3 | 4  5 | 6  7 | 8  9 | 10 11
    h0 (x16): 1  1 | 0  0 | 0  0 | 8  0 | 0  0 |  6  0   retrieval head: peak on token 6
    h1 (x16): 1  1 | 1  1 | 1  1 | 0  0 | 9  0 |  1  0   broader head: one higher peak, token 8

Pages 0 (sinks) and 5 (window) are protected: 4 tokens. Budget 0.5 gives k = 6, so
exactly one more page fits. Candidate pages 3 (h0's peak) and 4 (h1's peak):

- mean:  page 3 = (8 + 0)/2 = 4.0, page 4 = (0 + 9)/2 = 4.5            -> page 4
- max:   page 3 = 8, page 4 = 9                                         -> page 4
- entropy (sink-isolated): non-sink mass 14 for both heads;
    ||a~_0||^2 = (64 + 36)/196 = 100/196,  ||a~_1||^2 = (5*1 + 81)/196 = 86/196
    w = (100, 86)/186;  page 3 = 8*100/186 = 4.30, page 4 = 9*86/186 = 4.16 -> page 3
- entropy_nosink: ||a_0||^2 = 102/256, ||a_1||^2 = 88/256
    w = (102, 88)/190;  page 3 = 8*102/190 = 4.29, page 4 = 9*88/190 = 4.17 -> page 3
- entropy with tau = 2: w ~ sqrt(100), sqrt(86) = (10, 9.27)/19.27
    page 3 = 8*0.519 = 4.15, page 4 = 9*0.481 = 4.33                   -> page 4
- head_independent: h0 picks page 3, h1 picks page 4; union = pages {0, 3, 4, 5} = 8 tokens,
    k' = 6, UOR = 8/6; D = 1 - |S0 & S1|/k' = 1 - 4/6 = 1/3, and UOR = 1 + D.
- streaming: the most recent unprotected page, 4.
- full: everything.

Group 1 holds the same two heads in the other order (h1, h0): pooling must not care.
"""

import pytest
import torch

from pagekv import BudgetError, EvictionConfig, min_feasible_budget, plan
from pagekv.maths.entropy import HeadMasses
from pagekv.maths.paging import page_sizes, protected_pages, select_pages

H0 = [1, 1, 0, 0, 0, 0, 8, 0, 0, 0, 6, 0]
H1 = [1, 1, 1, 1, 1, 1, 0, 0, 9, 0, 1, 0]
BASE = dict(budget=0.5, page_size=2, n_sink=2, window=2)


def pages_to_tokens(pages, P=2, n=12):
    return sorted(t for j in pages for t in range(j * P, min((j + 1) * P, n)))


@pytest.fixture
def profiles():
    p = torch.tensor([H0, H1, H1, H0], dtype=torch.float32) / 16
    return p[None]  # [L=1, H=4, n=12]; groups (h0, h1) and (h1, h0)


@pytest.mark.parametrize(
    "policy, extra, pages",
    [
        ("mean", {}, [0, 4, 5]),
        ("max", {}, [0, 4, 5]),
        ("entropy", {}, [0, 3, 5]),
        ("entropy_nosink", {}, [0, 3, 5]),
        ("entropy", {"tau": 2.0}, [0, 4, 5]),
        ("entropy", {"page_reduction": "sum"}, [0, 3, 5]),
        ("mean", {"page_reduction": "sum"}, [0, 4, 5]),
        ("streaming", {}, [0, 4, 5]),
        ("head_independent", {}, [0, 3, 4, 5]),
        ("full", {}, [0, 1, 2, 3, 4, 5]),
        ("entropy", {"budget": 8 / 12}, [0, 3, 4, 5]),
        ("mean", {"budget": 1.0}, [0, 1, 2, 3, 4, 5]),
    ],
    ids=lambda v: str(v),
)
def test_exact_kept_set(profiles, policy, extra, pages):
    p = plan(profiles, n_groups=2, config=EvictionConfig(policy=policy, **{**BASE, **extra}))
    expected = pages_to_tokens(pages)
    for g in range(2):
        kept = torch.nonzero(p.keep[0, g]).flatten().tolist()
        assert kept == expected, f"{policy} {extra} group {g}"
    assert p.union_tokens.tolist() == [[len(expected)] * 2]


def test_entropy_weights_are_the_hand_values(profiles):
    p = plan(profiles, n_groups=2, config=EvictionConfig(policy="entropy", **BASE))
    want = torch.tensor([100 / 186, 86 / 186, 86 / 186, 100 / 186])
    torch.testing.assert_close(p.head_weights[0], want)
    torch.testing.assert_close(p.weights_nosink[0], torch.tensor([102, 88, 88, 102]) / 190)
    torch.testing.assert_close(p.sink_mass[0], torch.full((4,), 2 / 16))
    # Page scores of group 0: pages 3 and 4 as in the module docstring.
    torch.testing.assert_close(p.page_scores[0, 0, 3], torch.tensor(8 * 100 / 186 / 16))
    torch.testing.assert_close(p.page_scores[0, 0, 4], torch.tensor(9 * 86 / 186 / 16))


def test_mean_weights_and_pooled_uor(profiles):
    p = plan(profiles, n_groups=2, config=EvictionConfig(policy="mean", **BASE))
    assert p.head_weights.tolist() == [[0.5] * 4]
    # Pooled UOR measured (not `p.uor`, a constant 1): the group's one mask, 6 tokens, over
    # each head's k' = 2 + 2 + 2.
    union = p.keep.sum(-1)
    k_head = (p.page_keep.long() * p.page_sizes).sum(-1)
    assert union.tolist() == [[6, 6]] and k_head.tolist() == [[6, 6]]
    assert (union.double() / k_head.double()).tolist() == [[1.0, 1.0]]
    assert p.head_keep is None and p.overlap is None


def test_head_independent_uor_and_disagreement(profiles):
    p = plan(profiles, n_groups=2, config=EvictionConfig(policy="head_independent", **BASE))
    assert p.head_keep is not None
    assert torch.nonzero(p.head_keep[0, 0]).flatten().tolist() == pages_to_tokens([0, 3, 5])
    assert torch.nonzero(p.head_keep[0, 1]).flatten().tolist() == pages_to_tokens([0, 4, 5])
    ov = p.overlap
    assert ov.per_head_tokens == 6
    assert ov.union_tokens.tolist() == [[8, 8]]
    assert p.uor.tolist() == [[8 / 6, 8 / 6]]
    assert ov.intersections[0, 0].tolist() == [[6, 4], [4, 6]]
    assert abs(float(ov.mean_disagreement[0, 0]) - 1 / 3) < 1e-12
    assert float(ov.lower[0, 0]) == pytest.approx(8 / 6) == float(ov.upper[0, 0])


def test_kept_indices_dense(profiles):
    p = plan(profiles, n_groups=2, config=EvictionConfig(policy="entropy", **BASE))
    assert p.kept_indices().tolist() == [[[0, 1, 6, 7, 10, 11]] * 2]
    hi = plan(profiles, n_groups=2, config=EvictionConfig(policy="head_independent", **BASE))
    assert hi.kept_indices().shape == (1, 2, 8)  # both unions happen to be 8 tokens


def test_partial_last_page_sizes_and_protection():
    # n = 11, P = 4: pages [0..3], [4..7], [8..10]; the last has 3 tokens.
    assert page_sizes(11, 4).tolist() == [4, 4, 3]
    assert protected_pages(11, 4, n_sink=1, window=1).tolist() == [True, False, True]
    assert protected_pages(11, 4, n_sink=5, window=4).tolist() == [True, True, True]
    assert protected_pages(11, 4, n_sink=0, window=20).tolist() == [True, True, True]
    assert page_sizes(3, 16).tolist() == [3]


def test_ties_break_toward_lower_page_index():
    sizes = torch.full((6,), 2)
    prot = torch.tensor([True, False, False, False, False, True])
    scores = torch.tensor([[0.0, 0.5, 0.9, 0.5, 0.9, 0.0]])
    # k = 8: protected 4 tokens + two pages; pages 2 and 4 tie at 0.9 -> both kept.
    assert select_pages(scores, prot, sizes, 8).tolist() == [[True, False, True, False, True, True]]
    # k = 6: one page; the tie 2 vs 4 goes to page 2.
    assert select_pages(scores, prot, sizes, 6).tolist() == [
        [True, False, True, False, False, True]
    ]
    # k = 10: pages 2, 4 and then the tie 1 vs 3 goes to page 1.
    assert select_pages(scores, prot, sizes, 10).tolist() == [[True, True, True, False, True, True]]
    # k = 7: an odd budget cannot hold a half page; still three pages, 6 tokens.
    assert select_pages(scores, prot, sizes, 7).tolist() == [
        [True, False, True, False, False, True]
    ]


def test_uniform_profiles_keep_lowest_pages():
    prof = torch.full((1, 3, 40), 1 / 40)
    p = plan(prof, 1, EvictionConfig(policy="entropy", budget=0.5, page_size=4, n_sink=4, window=4))
    # Protected pages 0 and 9 (8 tokens), k = 20: three more pages; all tie -> pages 1, 2, 3.
    assert p.page_keep[0, 0].nonzero().flatten().tolist() == [0, 1, 2, 3, 9]


def test_budget_below_protected_minimum_names_the_smallest_feasible_budget(profiles):
    cfg = EvictionConfig(policy="entropy", **{**BASE, "budget": 0.25})  # k = 3 < 4 protected
    with pytest.raises(BudgetError) as err:
        plan(profiles, 2, cfg)
    assert err.value.min_budget == pytest.approx(4 / 12)
    assert "0.334" in str(err.value) and "4 tokens" in str(err.value)
    assert min_feasible_budget(12, 2, 2, 2) == pytest.approx(4 / 12)
    # The named budget is indeed feasible.
    ok = plan(profiles, 2, cfg.replace(budget=err.value.min_budget))
    assert ok.union_tokens.tolist() == [[4, 4]]


@pytest.mark.parametrize(
    "policy, allocation",
    [
        ("entropy", "uniform"),
        ("mean", "global"),
        ("entropy", "layer"),
        ("head_independent", "uniform"),
    ],
)
def test_a_plan_checks_its_budget_once(profiles, monkeypatch, policy, allocation):
    """`plan` checks the budget once; the public selectors check at entry."""
    import pagekv.maths.paging as paging
    import pagekv.maths.plan as plan_module

    calls = []
    real = paging.check_budget

    def counted(*args):
        calls.append(args[-1])
        return real(*args)

    monkeypatch.setattr(paging, "check_budget", counted)
    monkeypatch.setattr(plan_module, "check_budget", counted)
    cfg = EvictionConfig(policy=policy, allocation=allocation, **BASE)
    plan(profiles, 2, cfg)
    assert calls == [6]  # k = floor(0.5 * 12), checked once
    with pytest.raises(BudgetError):
        plan(profiles, 2, cfg.replace(budget=0.25))
    calls.clear()
    sizes, prot = page_sizes(12, 2), protected_pages(12, 2, 2, 2)
    for select in (select_pages, paging.select_pages_global):
        select(torch.rand(2, 6), prot, sizes, 6)
        with pytest.raises(BudgetError, match="0.334"):
            select(torch.rand(2, 6), prot, sizes, 3)
    assert calls == [6, 3, 6, 3]


def test_page_larger_than_prompt_keeps_everything_or_errors():
    prof = torch.full((1, 2, 10), 0.1)
    # One 10-token page holds the sinks and window: protected, needs the whole prompt.
    with pytest.raises(BudgetError):
        plan(prof, 1, EvictionConfig(page_size=64, budget=0.5))
    p = plan(prof, 1, EvictionConfig(page_size=64, budget=1.0))
    assert p.union_tokens.tolist() == [[10]]


def test_window_larger_than_prompt_is_clipped():
    prof = torch.full((1, 2, 10), 0.1)
    p = plan(prof, 1, EvictionConfig(page_size=1, window=32, n_sink=0, budget=1.0))
    assert p.window == 10 and p.protected.all()


@pytest.mark.parametrize(
    "bad, msg",
    [
        (torch.zeros(2, 3), "[L, H, n]"),
        (torch.ones(1, 2, 4, dtype=torch.int64), "floating"),
        (torch.full((1, 2, 4), float("nan")), "finite"),
        (torch.full((1, 2, 4), 0.5), "sum to 1"),
        (torch.full((1, 3, 4), 0.25), "multiple"),
    ],
    ids=["rank", "dtype", "nan", "sum", "groups"],
)
def test_malformed_profiles_raise(bad, msg):
    with pytest.raises(ValueError, match=msg.replace("[", r"\[").replace("]", r"\]")):
        plan(bad, 2, EvictionConfig())


def test_a_policy_computes_its_own_head_weights(monkeypatch):
    """A new weighting lives in its policy alone (here from the sink masses), and the plan pools and
    reports exactly those weights."""
    import pagekv.maths.plan as plan_module
    from pagekv.maths.policies import Policy

    def by_sink_mass(x):
        w = x.masses.sink.float() + 1e-3
        L, H = w.shape
        return (w.view(L, x.n_groups, -1) / w.view(L, x.n_groups, -1).sum(-1, keepdim=True)).view(
            L, H
        )

    policy = Policy(
        name="sink_weighted", summary="test", weights=by_sink_mass,
        page_scores=lambda x: x.weighted_pages(by_sink_mass(x)),
    )  # fmt: skip
    monkeypatch.setattr(plan_module, "get_policy", lambda name: policy)
    torch.manual_seed(0)
    profiles = torch.rand(2, 4, 64)
    profiles[:, 0, :4] += 20.0  # head 0 of group 0 a sink head
    profiles = profiles / profiles.sum(-1, keepdim=True)
    cfg = EvictionConfig(policy="entropy", budget=0.5, page_size=4, window=8)
    p = plan(profiles, 2, cfg)
    masses = HeadMasses.from_profiles(profiles.float(), 4)
    w = masses.sink.float() + 1e-3
    want = (w.view(2, 2, 2) / w.view(2, 2, 2).sum(-1, keepdim=True)).view(2, 4)
    assert torch.allclose(p.head_weights, want)
    assert not torch.allclose(p.head_weights, p.weights_isolated)  # not entropy's
