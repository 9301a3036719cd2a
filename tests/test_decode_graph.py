"""The decode step in the form a CUDA graph replays (`pagekv.runtime.decode`): position from a
device tensor, block tables and device lengths, no host reads. On the CPU it is checked against
the ordinary step; a failed capture falls back to the eager step; a bucketed cache adopting
another decode's cache steps as its own would. Capture itself: benchmarks/gpu_check.py."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from pagekv import EvictionConfig
from pagekv.runtime import decode as decode_graph
from pagekv.runtime.decode import GraphBuckets, GraphedStep
from pagekv.runtime.paged_cache import bucket
from pagekv.runtime.runner import Runner
from tests.test_host_waits import HostReads
from tests.test_runner import prompt, tiny_model

CASES = {
    "entropy": dict(policy="entropy"),
    "global": dict(policy="entropy", allocation="global"),  # groups of different lengths
}


def _caches(case):
    runner = Runner(tiny_model("llama", seed=2), decode_dtype="float32")
    pre = runner.prefill(prompt(70, seed=4), window_max=8, question_ids=[5, 6, 7])
    cfg = EvictionConfig(budget=0.3, page_size=4, window=8, n_sink=2, **CASES[case])
    plain = runner.decode_cache([runner.evict(pre, cfg)], pre, 12)
    static = runner.decode_cache([runner.evict(pre, cfg)], pre, 12)
    static.static = True
    return runner, pre, plain, static


@pytest.mark.parametrize("case", list(CASES))
def test_the_static_step_is_the_step(case):
    runner, pre, plain, static = _caches(case)
    step = runner._lean_decoder().step
    q = torch.tensor([pre.question_ids])
    a, b = step(q, pre.n, plain), step(q, pre.n, static)  # the question: eager, both
    torch.testing.assert_close(b, a, atol=1e-5, rtol=0)
    pos = pre.n + 3
    for t in (11, 42, 7, 99):
        ids = torch.tensor([[t]])
        a = step(ids, pos, plain)
        b = step(ids, torch.tensor(pos), static)  # a device position, the tables' path
        torch.testing.assert_close(b, a, atol=1e-5, rtol=0)
        pos += 1
    for layer in range(pre.n_layers):
        assert static.lengths[layer].tolist() == plain.host_lengths(layer)
        for g in range(pre.n_groups):
            for x, y in zip(static.read(layer, 0, g), plain.read(layer, 0, g), strict=True):
                torch.testing.assert_close(x, y, atol=1e-5, rtol=0)


class _Ops(TorchDispatchMode):
    """Every op torch dispatches, with its tensors' shapes, strides and offsets and its
    scalar arguments: what a CUDA graph would have recorded."""

    def __init__(self):
        super().__init__()
        self.log = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        sig = [str(func)]
        for a in pytree.tree_leaves((args, kwargs)):
            if isinstance(a, torch.Tensor):
                sig.append((tuple(a.shape), a.stride(), a.storage_offset()))
            elif isinstance(a, (int, float, bool)):
                sig.append(a)
        self.log.append(tuple(sig))
        return func(*args, **kwargs)


def _two_steps(step, cache, pos, as_tensor: bool) -> tuple[list, list]:
    logs = []
    for i in range(2):
        p = torch.tensor(pos + i) if as_tensor else pos + i
        with _Ops() as ops:
            step(torch.tensor([[9 + i]]), p, cache)
        logs.append(ops.log)
    return logs[0], logs[1]


@pytest.mark.parametrize("case", list(CASES))
def test_two_static_steps_are_the_same_launches(case):
    """Two static steps dispatch the same ops on the same shapes, strides, offsets and scalars; the
    ordinary step (control) does not."""
    runner, pre, plain, static = _caches(case)
    step = runner._lean_decoder().step
    for cache in (plain, static):
        step(torch.tensor([pre.question_ids]), pre.n, cache)
    first, second = _two_steps(step, static, pre.n + 3, as_tensor=True)
    assert len(first) > 50 and first == second
    if case == "entropy":  # alike groups: the ordinary step takes the sliced views
        first, second = _two_steps(step, plain, pre.n + 3, as_tensor=False)
        assert first != second


def test_the_static_step_reads_nothing_from_the_host(monkeypatch):
    runner, pre, _, static = _caches("global")
    step = runner._lean_decoder().step
    step(torch.tensor([pre.question_ids]), pre.n, static)
    reads = HostReads(monkeypatch).install()
    ids, pos = torch.tensor([[9]]), torch.tensor(pre.n + 3)
    with reads:
        step(ids, pos, static)
    assert reads.total == 0, reads.counts
    with reads:  # the check bites: a position read back to the host is counted
        step(ids, int(pos.item()), static)
    assert reads.total > 0, reads.counts


class _FakeCuda:
    """Stand-ins for the torch.cuda calls GraphedStep makes, the capture failing."""

    class Stream:
        def wait_stream(self, other):
            pass

    @staticmethod
    def current_stream():
        return _FakeCuda.Stream()

    @staticmethod
    def stream(s):
        return contextlib.nullcontext()

    class CUDAGraph:
        def replay(self):
            raise AssertionError("a failed capture is never replayed")

    @staticmethod
    @contextlib.contextmanager
    def graph(g):
        raise RuntimeError("operation not permitted when stream is capturing")
        yield


def test_a_failed_capture_decodes_eagerly(monkeypatch):
    runner, pre, plain, static = _caches("entropy")
    monkeypatch.setattr(decode_graph.torch, "cuda", _FakeCuda)
    graphed = GraphedStep(runner._lean_decoder(), static)
    step = runner._lean_decoder().step
    q = torch.tensor([pre.question_ids])
    torch.testing.assert_close(graphed(q, pre.n), step(q, pre.n, plain), atol=1e-5, rtol=0)
    pos = pre.n + 3
    for t in (4, 8, 15, 16):  # warm-up, the failed capture, then eager
        ids = torch.tensor([[t]])
        torch.testing.assert_close(graphed(ids, pos), step(ids, pos, plain), atol=1e-5, rtol=0)
        pos += 1
    assert graphed.failed == "RuntimeError: operation not permitted when stream is capturing"
    assert not graphed.graphed
    assert static.added == plain.added == 3 + 4  # the host's count, undone after the failure
    assert static.lengths[0].tolist() == plain.host_lengths(0)
    with pytest.raises(ValueError, match="needs a static PagedCache"):
        GraphedStep(runner._lean_decoder(), plain)


def test_the_runner_graphs_only_on_cuda_with_the_kernels():
    assert not Runner(tiny_model("llama"), backend="triton").cuda_graphs  # the CPU


def test_a_bucket_is_at_least_its_size_and_under_a_quarter_more():
    sizes = [*range(1, 300), 1000, 2049, 4097, 65535, 65537]
    assert [bucket(n) for n in range(1, 10)] == [1, 2, 3, 4, 5, 6, 7, 8, 10]
    assert [bucket(n) for n in (17, 33, 100, 2000)] == [20, 40, 112, 2048]
    assert all(n <= bucket(n) < 1.25 * n or n <= 8 for n in sizes)
    assert all(bucket(bucket(n)) == bucket(n) for n in sizes)  # a bucket is its own
    assert len({bucket(n) for n in range(1000, 1300)}) <= 3  # near sizes share one


def _two_decodes(case):
    """Two evictions of one prompt, the second keeping fewer tokens in the same bucket."""
    runner = Runner(tiny_model("llama", seed=2), decode_dtype="float32")
    pre = runner.prefill(prompt(140, seed=4), window_max=8, question_ids=[5, 6, 7])
    cfgs = [
        EvictionConfig(budget=b, page_size=4, window=8, n_sink=2, **CASES[case])
        for b in (0.4, 0.38)
    ]
    caches = [runner.decode_cache([runner.evict(pre, c)], pre, 12) for c in cfgs]
    return runner, pre, caches


@pytest.mark.parametrize("case", list(CASES))
def test_a_bucket_steps_as_each_cache_it_adopts(case):
    runner, pre, (big, small) = _two_decodes(case)
    assert big.bucket_key() == small.bucket_key()  # the premise: one bucket
    assert big.host_lengths(0) != small.host_lengths(0)
    step = runner._lean_decoder().step
    held = big.bucketed()
    assert held.static and held.bucket_key() == big.bucket_key()
    assert held.k_pool[0].shape[0] == bucket(big.k_pool[0].shape[0])
    q = torch.tensor([pre.question_ids])
    for plain in (big, small):  # the second decode finds the first one's tokens there
        if plain is small:
            held.adopt(small)
        torch.testing.assert_close(step(q, pre.n, held), step(q, pre.n, plain), atol=1e-5, rtol=0)
        pos = pre.n + 3
        for t in (11, 42, 7):
            ids = torch.tensor([[t]])
            a = step(ids, pos, plain)
            b = step(ids, torch.tensor(pos), held)
            torch.testing.assert_close(b, a, atol=1e-5, rtol=0)
            pos += 1
        assert held.added == plain.added and held.room() == plain.room()
        for layer in range(pre.n_layers):
            assert held.lengths[layer].tolist() == plain.host_lengths(layer)
    cfg = EvictionConfig(budget=0.9, page_size=4, window=8, n_sink=2)
    other = runner.decode_cache([runner.evict(pre, cfg)], pre, 12)
    with pytest.raises(ValueError, match="same capacity bucket"):
        held.adopt(other)


def test_the_buckets_hand_one_step_to_a_bucket(monkeypatch):
    """Decodes of one bucket share a step (its pools hold the latest decode's tokens);
    another bucket gets its own; past `limit` the least recently used is dropped."""
    runner, pre, (big, small) = _two_decodes("entropy")
    buckets = GraphBuckets(runner._lean_decoder(), limit=2)
    first = buckets.step_for(big)
    assert buckets.step_for(small) is first and len(buckets) == 1
    assert first.cache.host_lengths(0) == small.host_lengths(0)
    cfg = dict(page_size=4, window=8, n_sink=2)
    wide, full = (
        runner.decode_cache([runner.evict(pre, EvictionConfig(budget=b, **cfg))], pre, 12)
        for b in (0.7, 1.0)
    )
    assert len({c.bucket_key() for c in (big, wide, full)}) == 3
    monkeypatch.setattr(decode_graph.torch, "cuda", _FakeCuda)  # steps run eagerly
    for step in (first, first):  # the question, the warm-up, the failed capture: eager
        step(torch.tensor([pre.question_ids]), pre.n)
    second = buckets.step_for(wide)
    assert second is not first and len(buckets) == 2
    buckets.step_for(full)  # a third bucket: the least recently used (first) goes
    assert len(buckets) == 2 and buckets.step_for(wide) is second
    assert buckets.step_for(small) is not first


def test_graphed_decodes_give_the_eager_tokens(monkeypatch):
    """Decodes through the runner's buckets (captures failing on the CPU) give the ordinary decode's
    tokens, across plans and buckets."""
    runner, pre, _ = _two_decodes("global")
    cfgs = [EvictionConfig(budget=b, page_size=4, window=8, n_sink=2) for b in (0.4, 0.38, 0.8)]
    want = [runner.evaluate(pre, c, max_new_tokens=12, stop_at_eos=False).tokens for c in cfgs]
    monkeypatch.setattr(decode_graph.torch, "cuda", _FakeCuda)
    monkeypatch.setattr(runner, "cuda_graphs", True)
    got = [runner.evaluate(pre, c, max_new_tokens=12, stop_at_eos=False).tokens for c in cfgs]
    assert got == want and len(runner._graphs) == 2
