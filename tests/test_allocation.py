"""The global allocation (`EvictionConfig(allocation="global")`): one budget of `L G k`
tokens shared across the (layer, group)s by page scores on the model's attention scale,
whole pages, each (layer, group) keeping its protected pages. Hand-worked cases,
properties, and plans (with the reconstruction scorer's `scales`)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagekv import BudgetError, EvictionConfig, plan
from pagekv.maths.paging import page_sizes, protected_pages, select_pages_global


def test_the_docstring_example():
    scores = torch.tensor([[9.0, 3, 1, 0], [9.0, 1, 1, 1]])
    prot = torch.tensor([True, False, False, False])
    keep = select_pages_global(scores, prot, torch.ones(4, dtype=torch.int64), 2)
    assert keep.tolist() == [[True, True, True, False], [True, False, False, False]]


def test_a_sharp_row_takes_more_than_a_flat_one():
    # Row 0 puts all its free attention on pages 1 and 2; row 1 spreads it evenly.
    # Total budget 2 x 3 = 6 one-token pages, 2 protected (page 0 of each row): 4 free
    # slots. Scores: row 0 (5, 5, 0, 0, 0), row 1 (1 x 5): row 0's two pages first,
    # then row 1's first two (ties toward the lower index).
    scores = torch.tensor([[1.0, 5, 5, 0, 0, 0], [1.0, 1, 1, 1, 1, 1]])
    prot = torch.tensor([True] + [False] * 5)
    keep = select_pages_global(scores, prot, torch.ones(6, dtype=torch.int64), 3)
    assert keep.tolist() == [
        [True, True, True, False, False, False],
        [True, True, True, False, False, False],
    ]
    # Row 1 now puts everything on page 5 (9): it goes first, then row 0's pages 1 and
    # 2 (5 each); the last slot is a tie of zeros, won by the lowest flat index, row 0's
    # page 3.
    scores[1] = torch.tensor([1.0, 0, 0, 0, 0, 9])
    keep = select_pages_global(scores, prot, torch.ones(6, dtype=torch.int64), 3)
    assert keep.tolist() == [
        [True, True, True, True, False, False],
        [True, False, False, False, False, True],
    ]


def test_protected_pages_above_the_budget_raise():
    prot = torch.tensor([True, True, False])
    with pytest.raises(BudgetError):
        select_pages_global(torch.rand(2, 3), prot, torch.ones(3, dtype=torch.int64), 1)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 6),
    n=st.integers(8, 80),
    page=st.sampled_from([1, 2, 4, 8]),
    frac=st.floats(0.3, 1.0),
    seed=st.integers(0, 10_000),
)
def test_properties(rows, n, page, frac, seed):
    gen = torch.Generator().manual_seed(seed)
    sizes = page_sizes(n, page)
    prot = protected_pages(n, page, 2, 4)
    prot_tokens = int(sizes[prot].sum())
    k = max(prot_tokens, int(frac * n))
    scores = torch.rand(rows, sizes.numel(), generator=gen) ** 4
    keep = select_pages_global(scores, prot, sizes, k)
    kept = (keep.long() * sizes).sum(-1)
    total = int(kept.sum())
    assert total <= rows * k  # the shared budget
    assert bool(keep[:, prot].all())  # every row keeps its protected pages
    free_left = (~keep) & ~prot
    if bool(free_left.any()):  # no free page that fits is left out (pages are whole)
        assert total + int(sizes[~prot].min()) > rows * k
    # The kept free pages are the best of all rows by their scores as given.
    kept_free = keep & ~prot
    if bool(kept_free.any()) and bool(free_left.any()):
        assert float(scores[kept_free].min()) >= float(scores[free_left].max())
    # Scaling every score by one factor changes nothing (one scale for all rows) ...
    assert torch.equal(select_pages_global(scores * 7.0, prot, sizes, k), keep)
    # ... while scaling one row up makes it keep at least as much.
    if rows > 1:
        boosted = scores.clone()
        boosted[0] *= 1e3
        kept0 = (select_pages_global(boosted, prot, sizes, k).long() * sizes).sum(-1)[0]
        assert int(kept0) >= int(kept[0])


def _profiles(L, H, n, sharp_layer):
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(L, H, n, generator=gen) + 1.0  # flat everywhere
    x[sharp_layer, :, 10] += 400.0  # one layer attends to token 10 only
    x[sharp_layer, :, 20] += 400.0
    return x / x.sum(-1, keepdim=True)


def test_plan_shares_the_budget_across_layers():
    L, H, G, n = 3, 4, 2, 64
    prof = _profiles(L, H, n, sharp_layer=1)
    uni = EvictionConfig(policy="entropy", budget=0.25, page_size=1, n_sink=2, window=4)
    glo = uni.replace(allocation="global")
    pu, pg = plan(prof, G, uni), plan(prof, G, glo)
    k = uni.budget_tokens(n)
    assert pu.union_tokens.tolist() == [[k] * G] * L and pu.dense
    assert int(pg.union_tokens.sum()) == L * G * k  # one-token pages: the total is exact
    assert not pg.dense
    # The sharp layer needs only its two tokens beyond the protected ones; the flat
    # layers take what it leaves.
    protected = 2 + 4
    assert pg.union_tokens[1].tolist() == [protected + 2] * G
    assert bool(pg.keep[1, :, 10].all() and pg.keep[1, :, 20].all())
    assert int(pg.union_tokens[0].sum() + pg.union_tokens[2].sum()) > 2 * G * k - 2


def test_scales_put_the_layers_on_the_models_attention_scale():
    # Two layers with the same profiles (so the same head weights and the same uniform
    # plan), but the reconstruction queries of layer 1 attended to its context ten times
    # as much (its raw scores sum to 10x layer 0's): under the global allocation layer 1
    # takes the free pages, and without scales the two layers split them evenly.
    L, H, G, n = 2, 2, 1, 32
    gen = torch.Generator().manual_seed(1)
    row = torch.rand(n, generator=gen) + 0.5
    prof = (row / row.sum()).expand(L, H, n).contiguous()
    cfg = EvictionConfig(policy="entropy", budget=0.5, page_size=1, n_sink=2, window=4)
    glo = cfg.replace(allocation="global")
    scales = torch.tensor([[1.0, 1.0], [10.0, 10.0]])
    k = cfg.budget_tokens(n)
    even = plan(prof, G, glo)
    tilted = plan(prof, G, glo, scales=scales)
    assert even.union_tokens.flatten().tolist() == [k, k]
    assert tilted.union_tokens.flatten().tolist() == [2 + 4, 2 * k - 6]
    assert int(tilted.union_tokens.sum()) == L * G * k  # the total is unchanged
    # The uniform allocation and the head weights do not see the scales.
    assert torch.equal(plan(prof, G, cfg, scales=scales).keep, plan(prof, G, cfg).keep)
    assert torch.equal(tilted.head_weights, even.head_weights)
    with pytest.raises(ValueError, match="scales must be a"):
        plan(prof, G, glo, scales=torch.ones(L))
    with pytest.raises(ValueError, match="finite and positive"):
        plan(prof, G, glo, scales=torch.zeros(L, H))


def test_global_is_for_pooled_policies():
    with pytest.raises(ValueError, match="selects per head"):
        EvictionConfig(policy="head_independent", allocation="global")
    with pytest.raises(ValueError, match="allocation must be one of"):
        EvictionConfig(allocation="shared")
    assert not EvictionConfig(allocation="global").pooled


def test_the_runner_stores_and_decodes_a_global_plan():
    """A global plan's (layer, group)s keep different amounts and each stores exactly its own,
    unpadded; decoding runs on the ragged groups."""
    from pagekv.runtime.runner import Runner

    from .test_runner import prompt, tiny_model

    runner = Runner(tiny_model("llama"))
    pre = runner.prefill(prompt(96, seed=13), window_max=8)
    cfg = EvictionConfig(policy="entropy", budget=0.25, page_size=1, window=8, n_sink=2)
    glo = cfg.replace(allocation="global")
    res = runner.evaluate(pre, glo, max_new_tokens=3)
    k = cfg.budget_tokens(pre.n)
    L, G = pre.n_layers, pre.n_groups
    union = res.union_tokens
    assert sum(map(sum, union)) == L * G * k  # one-token pages: the total is exact
    assert len({u for row in union for u in row}) > 1  # and the counts vary
    assert res.stored_tokens == union
    assert res.padding_tokens == [[0] * G] * L
    k0 = pre.cache.layers[0].keys
    assert res.cache_bytes_after == L * G * k * 2 * k0.shape[-1] * k0.element_size()
    assert len(res.tokens) == 3
    uni = runner.evaluate(pre, cfg, max_new_tokens=3)
    assert uni.union_tokens == [[k] * G] * L


def test_the_decode_cache_holds_exactly_the_allocated_tokens():
    """Each (layer, group) of a global plan's decode cache holds the prefill's keys and values at
    exactly its allocated tokens, in order."""
    from pagekv.runtime.runner import Runner

    from .test_runner import prompt, tiny_model

    runner = Runner(tiny_model("llama"))
    pre = runner.prefill(prompt(96, seed=13), window_max=8, question_ids=[5, 6, 7])
    glo = EvictionConfig(
        policy="entropy", budget=0.25, page_size=1, window=8, n_sink=2, allocation="global"
    )
    ev = runner.evict(pre, glo)
    assert ev.allocated and ev.ragged
    cache = runner.decode_cache([ev], pre, 4)
    differ = 0
    for layer, la in enumerate(pre.cache.layers):
        for g in range(pre.n_groups):
            idx = ev.plan.keep[layer, g].nonzero()[:, 0]
            keys, values = cache.read(layer, 0, g)
            assert torch.equal(keys, la.keys[0, g, idx]), f"keys of layer {layer}, group {g}"
            assert torch.equal(values, la.values[0, g, idx])
            differ += len(idx) != max(ev.union_tokens[layer])
    assert differ  # some group holds fewer than its layer's largest allocation
    assert cache.room() == 3 + 4  # the question and the answer
    res = runner.evaluate(pre, glo, max_new_tokens=4, stop_at_eos=False)
    assert res.cache_bytes_decode == cache.row_nbytes(0) and len(res.tokens) == 4


def test_the_cli_flag_sets_it_and_policy_all_keeps_per_head_uniform():
    from pagekv.cli import _config_from, build_parser

    args = build_parser().parse_args(["run", "--allocation", "global", "--policy", "mean"])
    assert _config_from(args, "mean").allocation == "global"
    assert _config_from(args, "mean").scorer == "window"
    args2 = build_parser().parse_args(["run", "--scorer", "reconstruct"])
    assert _config_from(args2, "entropy").scorer == "reconstruct"
    assert _config_from(args, "head_independent", every=True).allocation == "uniform"
    with pytest.raises(ValueError, match="selects per head"):
        _config_from(args, "head_independent")


def test_per_layer_hand_worked():
    """Hand-worked: per layer, layer 0's sharp row takes both its slots (9, 8) and layer 1 splits
    (3, 2); shared across layers the slots go to 9, 8, 7 and 3."""
    scores = torch.tensor(
        [
            [[0.0, 9, 8, 7], [0.0, 1, 1, 1]],
            [[0.0, 3, 0, 0], [0.0, 2, 0, 0]],
        ]
    )
    prot = torch.tensor([True, False, False, False])
    ones = torch.ones(4, dtype=torch.int64)
    per_layer = select_pages_global(scores, prot, ones, 2, per_layer=True)
    assert per_layer.tolist() == [
        [[True, True, True, False], [True, False, False, False]],
        [[True, True, False, False], [True, True, False, False]],
    ]
    shared = select_pages_global(scores, prot, ones, 2)
    assert shared.tolist() == [
        [[True, True, True, True], [True, False, False, False]],
        [[True, True, False, False], [True, False, False, False]],
    ]


@settings(max_examples=40, deadline=None)
@given(
    L=st.integers(1, 4),
    G=st.integers(1, 4),
    n=st.integers(8, 64),
    page=st.sampled_from([1, 2, 4]),
    frac=st.floats(0.3, 1.0),
    seed=st.integers(0, 10_000),
)
def test_per_layer_is_global_within_each_layer(L, G, n, page, frac, seed):
    """Layer by layer, `per_layer` is exactly the global selection of that layer alone
    (each layer keeps at most `G k`); with one layer the two are the same."""
    gen = torch.Generator().manual_seed(seed)
    sizes = page_sizes(n, page)
    prot = protected_pages(n, page, 2, 4)
    k = max(int(sizes[prot].sum()), int(frac * n))
    scores = torch.rand(L, G, sizes.numel(), generator=gen) ** 4
    keep = select_pages_global(scores, prot, sizes, k, per_layer=True)
    for layer in range(L):
        alone = select_pages_global(scores[layer], prot, sizes, k)
        assert torch.equal(keep[layer], alone)
        assert int((keep[layer].long() * sizes).sum()) <= G * k
    if L == 1:
        assert torch.equal(keep, select_pages_global(scores, prot, sizes, k))


def test_plan_layer_allocation_keeps_each_layers_total():
    """Under "layer" every layer keeps exactly `G k` tokens (the sharp layer lends nothing, unlike
    "global"); its groups still share."""
    L, H, G, n = 3, 4, 2, 64
    prof = _profiles(L, H, n, sharp_layer=1)
    cfg = EvictionConfig(
        policy="entropy", budget=0.25, page_size=1, n_sink=2, window=4, allocation="layer"
    )
    k = cfg.budget_tokens(n)
    p = plan(prof, G, cfg)
    assert p.union_tokens.sum(-1).tolist() == [G * k] * L
    assert bool(p.keep[1, :, 10].all() and p.keep[1, :, 20].all())
    glo = plan(prof, G, cfg.replace(allocation="global"))
    assert not torch.equal(p.keep, glo.keep)
    with pytest.raises(ValueError, match="allocation 'layer' shares one budget"):
        EvictionConfig(policy="head_independent", allocation="layer")


def test_plan_layer_allocation_follows_the_scales_within_a_layer():
    """Under "layer" the group with 10x the raw attention takes the free pages."""
    L, H, G, n = 1, 2, 2, 32
    gen = torch.Generator().manual_seed(1)
    row = torch.rand(n, generator=gen) + 0.5
    prof = (row / row.sum()).expand(L, H, n).contiguous()
    cfg = EvictionConfig(
        policy="entropy", budget=0.5, page_size=1, n_sink=2, window=4, allocation="layer"
    )
    k = cfg.budget_tokens(n)
    assert plan(prof, G, cfg).union_tokens.flatten().tolist() == [k, k]
    tilted = plan(prof, G, cfg, scales=torch.tensor([[1.0, 10.0]]))
    assert tilted.union_tokens.flatten().tolist() == [2 + 4, 2 * k - 6]


def test_the_runner_decodes_a_layer_plan():
    from pagekv.runtime.runner import Runner

    from .test_runner import prompt, tiny_model

    runner = Runner(tiny_model("llama"))
    pre = runner.prefill(prompt(96, seed=13), window_max=8)
    cfg = EvictionConfig(
        policy="entropy", budget=0.25, page_size=1, window=8, n_sink=2, allocation="layer"
    )
    res = runner.evaluate(pre, cfg, max_new_tokens=3)
    k = cfg.budget_tokens(pre.n)
    assert [sum(row) for row in res.union_tokens] == [pre.n_groups * k] * pre.n_layers
    assert res.stored_tokens == res.union_tokens  # each group its own, no padding
    assert len({t for row in res.stored_tokens for t in row}) > 1
    assert len(res.tokens) == 3
