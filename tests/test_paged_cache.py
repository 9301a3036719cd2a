"""The decode cache (`pagekv.runtime.paged_cache.PagedCache`): a hand-worked layout; a property test
of random appends read back and attended (torch path and paged-decode kernel) against SDPA;
decode-time bytes (kept pages plus room, no more); one copy of the kept keys and values."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from pagekv import EvictionConfig
from pagekv.runtime.paged_cache import PagedCache
from pagekv.runtime.runner import Runner
from tests.benchmark_scripts import load
from tests.test_runner import VOCAB, prompt, tiny_model


def _tokens(n, d, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=gen)


def test_a_hand_worked_layout():
    """Groups of 6 and 3 tokens, P = 4, room 3: blocks (0, 1, 2) and (3, 4)."""
    d = 2
    k0, k1 = _tokens(6, d, 0), _tokens(3, d, 1)
    cache = PagedCache([([[k0, k1]], [[k0 * 2, k1 * 2]])], extra=3, page_size=4)
    assert cache.tables[0].tolist() == [[[0, 1, 2], [3, 4, -1]]]
    assert cache.k_pool[0].shape == (5, 4, d)
    assert cache.nbytes == 2 * 5 * 4 * d * 4 == cache.row_nbytes(0)
    assert cache.room() == 5 and cache.lengths[0].tolist() == [[6, 3]]
    assert torch.equal(cache.read(0, 0, 0)[0], k0) and torch.equal(cache.read(0, 0, 1)[1], k1 * 2)
    # Group 1's tokens start its first block (3), at pool row 12; its slot 3 stays empty.
    flat = cache.k_pool[0].view(-1, d)
    assert torch.equal(flat[12:15], k1) and not flat[15].any()
    new = torch.arange(2 * d, dtype=torch.float32).view(1, 2, 1, d)
    cache.grow(1)
    cache.write(0, new, new)
    assert torch.equal(flat[6], new[0, 0, 0]) and torch.equal(flat[15], new[0, 1, 0])
    assert cache.room() == 4 and cache.lengths[0].tolist() == [[7, 4]] == cache.host_lengths(0)
    with pytest.raises(ValueError, match="PagedCache is full: 5 new tokens, room for 4"):
        cache.grow(5)
    with pytest.raises(ValueError, match="list over rows of a list over groups"):
        PagedCache([([[k0, k1]], [k0, k1])], extra=3, page_size=4)  # values not in a row


def _reference(q, groups, scale):
    """SDPA of `q` `[B, H, t, d]` over each (row, group)'s tokens `[n, d]` (the last `t`
    of them the new ones, causal among themselves), in float64."""
    B, H, t, d = q.shape
    G = len(groups[0])
    r = H // G
    out = torch.empty(B, H, t, d, dtype=torch.float64)
    for b in range(B):
        for g in range(G):
            k, v = (x.double() for x in groups[b][g])
            n = k.shape[0]
            allowed = torch.ones(t, n, dtype=torch.bool)
            allowed[:, n - t :] = torch.ones(t, t, dtype=torch.bool).tril()
            qg = q[b, g * r : (g + 1) * r].double()
            out[b, g * r : (g + 1) * r] = F.scaled_dot_product_attention(
                qg, k[None], v[None], attn_mask=allowed, scale=scale
            )
    return out


@settings(max_examples=25, deadline=None)
@given(
    B=st.integers(1, 2),
    G=st.integers(1, 3),
    r=st.integers(1, 3),
    P=st.integers(1, 8),
    equal=st.booleans(),
    counts=st.lists(st.integers(1, 19), min_size=6, max_size=6),
    chunks=st.lists(st.integers(1, 4), min_size=1, max_size=3),
    seed=st.integers(0, 1000),
)
def test_appends_reads_and_attention_match_each_groups_tokens(B, G, r, P, equal, counts, chunks,
                                                              seed):  # fmt: skip
    d, H = 8, G * r
    gen = torch.Generator().manual_seed(seed)
    n = [[counts[0] if equal else counts[(b * G + g) % 6] for g in range(G)] for b in range(B)]
    keys = [[torch.randn(n[b][g], d, generator=gen) for g in range(G)] for b in range(B)]
    values = [[torch.randn(n[b][g], d, generator=gen) for g in range(G)] for b in range(B)]
    cache = PagedCache([(keys, values)], extra=sum(chunks), page_size=P)
    kernel = PagedCache([(keys, values)], extra=sum(chunks), page_size=P, kernel=True)
    blocks = sum(math.ceil((n[b][g] + sum(chunks)) / P) for b in range(B) for g in range(G))
    assert cache.nbytes == 2 * blocks * P * d * 4
    groups = [[[keys[b][g], values[b][g]] for g in range(G)] for b in range(B)]
    for t in chunks:
        k_new = torch.randn(B, G, t, d, generator=gen)
        v_new = torch.randn(B, G, t, d, generator=gen)
        q = torch.randn(B, H, t, d, generator=gen)
        for c in (cache, kernel):
            c.grow(t)
            c.write(0, k_new, v_new)
        for b in range(B):
            for g in range(G):
                groups[b][g][0] = torch.cat([groups[b][g][0], k_new[b, g]])
                groups[b][g][1] = torch.cat([groups[b][g][1], v_new[b, g]])
                got_k, got_v = cache.read(0, b, g)
                assert torch.equal(got_k, groups[b][g][0]) and torch.equal(got_v, groups[b][g][1])
        assert cache.lengths[0].tolist() == cache.host_lengths(0)
        assert cache.host_lengths(0) == [[len(x[0]) for x in row] for row in groups]
        ref = _reference(q, groups, 0.3)
        got = cache.attend(0, q, 0.3)
        torch.testing.assert_close(got.double(), ref, atol=2e-6, rtol=1e-5)
        if t == 1:  # one new token: the kernel reads the block tables
            torch.testing.assert_close(kernel.attend(0, q, 0.3).double(), ref, atol=2e-6, rtol=1e-5)


def _expected_bytes(res, extra, d, elem):
    """Per (layer, group): its kept pages, plus the blocks its `extra` new tokens need
    beyond the free slots of its partial last page; in bytes of keys and values."""
    P = res.config["page_size"]
    total = 0
    for layer, row in enumerate(res.union_tokens):
        for g, stored in enumerate(row):
            kept_pages = int(res.plan.page_keep[layer, g].sum())
            free = kept_pages * P - stored
            total += kept_pages + math.ceil(max(0, extra - free) / P)
    return 2 * total * P * d * elem


@pytest.mark.parametrize(
    "config",
    [
        EvictionConfig(policy="entropy", budget=0.25, page_size=8, window=8, n_sink=2),
        EvictionConfig(policy="mean", budget=0.3, page_size=5, window=8, n_sink=2),
        EvictionConfig(
            policy="entropy", budget=0.25, page_size=4, window=8, n_sink=2, allocation="global"
        ),
        EvictionConfig(policy="full", page_size=16, window=8, n_sink=2),
    ],
    ids=["entropy", "mean-P5", "global", "full"],
)
def test_the_decode_cache_is_the_kept_pages_and_the_new_tokens(config):
    model = tiny_model("llama")
    runner = Runner(model)  # the lean step on the CPU: the paged cache
    pre = runner.prefill(prompt(93, seed=13), window_max=8, question_ids=[5, 6, 7])
    res = runner.evaluate(pre, config, max_new_tokens=6, stop_at_eos=False)
    d = model.config.hidden_size // model.config.num_attention_heads
    extra = 3 + 6  # the question and the answer
    assert res.cache_bytes_decode == _expected_bytes(res, extra, d, 4)
    if config.allocation == "global":  # each group stores its own allocation, no padding
        assert res.stored_tokens == res.union_tokens
        assert len({t for row in res.stored_tokens for t in row}) > 1


def test_a_pair_reports_each_rows_bytes():
    runner = Runner(tiny_model("llama"))
    pre = runner.prefill(prompt(80, seed=2), window_max=8)
    a = EvictionConfig(policy="entropy", budget=0.3, page_size=8, window=8, n_sink=2)
    b = a.replace(policy="mean")
    res_a, res_b = runner.evaluate_pair(pre, a, b, max_new_tokens=4, stop_at_eos=False)
    assert res_a.timings["decode_batch"] == 2
    alone = runner.evaluate(pre, a, max_new_tokens=4, stop_at_eos=False)
    assert res_a.cache_bytes_decode == res_b.cache_bytes_decode == alone.cache_bytes_decode


@pytest.mark.parametrize(
    "config",
    [
        EvictionConfig(policy="entropy", budget=0.25, page_size=8, window=16),
        EvictionConfig(policy="head_independent", budget=0.25, page_size=8, window=16),
        EvictionConfig(policy="entropy", budget=0.25, page_size=8, window=16, allocation="global"),
        EvictionConfig(policy="full", window=16),
    ],
    ids=["entropy", "head_independent", "global", "full"],
)
def test_a_run_copies_the_kept_keys_and_values_once(config):
    """From plan to first decode step a run allocates the pool and under half a copy more; a dense
    cache copied in (control) allocates a whole second copy."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    )  # fmt: skip
    torch.manual_seed(0)
    runner = Runner(LlamaForCausalLM(cfg).eval())
    pre = runner.prefill(prompt(300, seed=1), window_max=16)
    planned = runner.plan(pre, config)
    # Every new storage an op makes (views and writes into a given tensor are not new).
    allocations = load("bench_evict_bytes").Allocations
    with torch.inference_mode(), allocations() as made:
        ev = runner.evict(pre, config, planned)
        cache = runner.decode_cache([ev], pre, 6)
    assert made.nbytes >= cache.nbytes > ev.kept_bytes > 0
    assert made.nbytes - cache.nbytes < ev.kept_bytes / 2


def test_the_allocation_count_takes_new_storages_only():
    """The counter the bound above reads: a new tensor counts its bytes; a view, and a
    write into a given tensor (`out=`, in place), count nothing."""
    allocations = load("bench_evict_bytes").Allocations
    x, out = torch.zeros(64, 8), torch.empty(16, 8)
    with allocations() as made:
        x[:16].view(-1)  # views
        torch.index_select(x, 0, torch.arange(16), out=out)  # written into `out`
        x.add_(1)
    assert made.nbytes == 16 * 8  # only the int64 arange's 16 values
    with allocations() as made:
        x.clone()
    assert made.nbytes == 64 * 8 * 4


def test_every_layers_pool_starts_16_byte_aligned_for_the_gather_kernel():
    """Each layer's pool view starts 16-byte aligned for the gather kernel, odd sizes included, and
    the kernel's cache equals the twin's."""
    g = torch.Generator().manual_seed(3)
    keys = [torch.randn(1, 2, 9, 2, generator=g).half() for _ in range(3)]
    values = [torch.randn(1, 2, 9, 2, generator=g).half() for _ in range(3)]
    kept = [torch.tensor([[0, 4, 7], [1, 2, 8]]) for _ in range(3)]
    counts = [[[3, 3]], [[1, 2]], [[3, 1]]]
    caches = {
        b: PagedCache.gathered(keys, values, kept, counts, 1, 1, backend=b)
        for b in ("triton", "torch")
    }
    assert caches["triton"].gathered_on == "triton"
    for layer in range(3):
        for pool in (caches["triton"].k_pool[layer], caches["triton"].v_pool[layer]):
            assert pool.data_ptr() % 16 == 0, layer
        for grp in range(2):
            (kk, vk), (kt, vt) = (c.read(layer, 0, grp) for c in caches.values())
            assert torch.equal(kk, kt) and torch.equal(vk, vt)
            idx = kept[layer][grp, : counts[layer][0][grp]]
            assert torch.equal(kt, keys[layer][0, grp, idx])
