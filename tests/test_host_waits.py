"""The eviction step waits on the device as often at 2, 4 and 6 layers (no slope).

A host wait is a value read back or a data-dependent output size. `Runner.evict` and
`Runner.decode_cache` are counted by wrapping those points on `torch.Tensor` (`HostReads`; on the
CPU an upper bound) and on CUDA also by `torch.cuda.set_sync_debug_mode("warn")`. A planted
per-layer wait makes the count grow (negative control). On the Triton backend the dispatched
operations, less views and allocations, are constant in depth too, and `_new_cache` dispatches
nothing per layer."""

from __future__ import annotations

import os
import traceback
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pagekv import EvictionConfig
from pagekv.runtime import runner as runner_mod
from pagekv.runtime.runner import Runner
from tests.test_runner import prompt, tiny_model

#: The repository's root: a sync's site is named by our innermost line above it.
REPO = Path(__file__).resolve().parents[1]

#: (policy, allocation): dense plans, per-head unions and a global plan (both padded).
CASES = [
    ("entropy", "uniform"),
    ("max", "uniform"),
    ("streaming", "uniform"),
    ("head_independent", "uniform"),
    ("entropy", "global"),
]
DEPTHS = (2, 4, 6)

#: Tensor methods that hand a device value to the host.
READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero")


class HostReads:
    """Counts the host reads of tensors made inside `with` (see the module docstring)."""

    def __init__(self, monkeypatch):
        self.monkeypatch = monkeypatch
        self.counts: Counter = Counter()
        self.active = False

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def install(self) -> HostReads:
        for name in READS:
            self._wrap(torch.Tensor, name, name)
        self._wrap(torch.Tensor, "masked_select", "masked_select")
        self._wrap(torch, "nonzero", "nonzero")
        self._wrap(torch, "masked_select", "masked_select")
        getitem = torch.Tensor.__getitem__

        def indexed(tensor, index):
            items = index if isinstance(index, tuple) else (index,)
            if self.active and any(_is_mask(i) for i in items):
                self.counts["boolean-mask index"] += 1
            return getitem(tensor, index)

        self.monkeypatch.setattr(torch.Tensor, "__getitem__", indexed)
        return self

    def _wrap(self, owner, name: str, label: str) -> None:
        original = getattr(owner, name)

        def counted(*args, **kwargs):
            if self.active:
                self.counts[label] += 1
            return original(*args, **kwargs)

        self.monkeypatch.setattr(owner, name, counted)

    def __enter__(self) -> HostReads:
        self.counts.clear()
        self.active = True
        return self

    def __exit__(self, *exc) -> None:
        self.active = False


def _is_mask(index) -> bool:
    return isinstance(index, torch.Tensor) and index.dtype == torch.bool and index.dim() > 0


class CudaSyncs:
    """Counts `set_sync_debug_mode("warn")` reports inside `with` by site (torch's line and our
    innermost line), so a GPU failure names our waiting line."""

    def __enter__(self) -> CudaSyncs:
        torch.cuda.synchronize()
        self._caught = warnings.catch_warnings()
        self._caught.__enter__()
        self.sites: Counter = Counter()
        warnings.simplefilter("always")  # every report, not the first per line
        warnings.showwarning = self._record
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def _record(self, message, category, filename, lineno, file=None, line=None) -> None:
        if "synchronizing" not in str(message):
            return
        ours = [
            f"{Path(f.filename).relative_to(REPO)}:{f.lineno}"
            for f in traceback.extract_stack()
            if f.filename.startswith(str(REPO)) and "/tests/" not in f.filename
        ]
        self.sites[f"{filename}:{lineno} from {ours[-1] if ours else '?'}"] += 1

    def __exit__(self, *exc) -> None:
        torch.cuda.set_sync_debug_mode("default")
        self._caught.__exit__(*exc)
        self.total = sum(self.sites.values())


@pytest.fixture(scope="module")
def models():
    """One tiny GQA model per depth (2 KV heads of 4 query heads each), on the CPU."""
    return {L: tiny_model("llama", layers=L, seed=L) for L in DEPTHS}


def _warmed(models, device, backend, cfg) -> dict[int, Runner]:
    """A runner per depth, every depth warmed by two eviction steps before any is counted."""
    runners = {L: Runner(models[L].to(device), None, backend=backend) for L in DEPTHS}
    ids = prompt(150, seed=3)
    for runner in runners.values():
        for _ in range(2):
            _evict_step(runner, runner.prefill(ids, window_max=16), cfg)
    if device.type == "cuda":
        # The first step a process counts under the sync debug mode reports one sync more,
        # at a line of torch's own (torch/cuda/__init__.py with torch 2.11 on an H200), at
        # whichever depth is counted first: one step counted and dropped.
        with CudaSyncs():
            runner = runners[DEPTHS[0]]
            _evict_step(runner, runner.prefill(ids, window_max=16), cfg)
    return runners


def _evict_step(runner, pre, cfg) -> None:
    """The eviction step: the plan, its kept indices, their gather into the cache."""
    runner.decode_cache([runner.evict(pre, cfg)], pre, 8)


def _step_reads(runner, device, cfg, reads) -> tuple[int, Counter, Counter | None]:
    """Host reads (and the sites of the CUDA syncs) of one eviction step of a warmed
    `runner` on a fresh prefill (so its scoring is counted too)."""
    pre = runner.prefill(prompt(150, seed=3), window_max=16)
    syncs = None
    if device.type == "cuda":
        with reads, CudaSyncs() as cuda:
            _evict_step(runner, pre, cfg)
        syncs = cuda.sites
    else:
        with reads:
            _evict_step(runner, pre, cfg)
    return reads.total, Counter(reads.counts), syncs


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("case", CASES, ids=[f"{p}-{a}" for p, a in CASES])
def test_host_waits_do_not_grow_with_the_layers(models, device, monkeypatch, backend, case):
    policy, allocation = case
    cfg = EvictionConfig(policy=policy, budget=0.4, page_size=8, window=16, allocation=allocation)
    reads = HostReads(monkeypatch).install()
    runners = _warmed(models, device, backend, cfg)
    got = {L: _step_reads(runners[L], device, cfg, reads) for L in DEPTHS}
    n = {L: got[L][0] for L in DEPTHS}
    assert len(set(n.values())) == 1, {L: dict(got[L][1]) for L in DEPTHS}  # no slope
    if device.type == "cuda":
        (_, _, s2), (_, _, s6) = got[2], got[6]
        assert s2.total() == s6.total(), (
            f"CUDA syncs differ with the depth: only at L=2: {dict(s2 - s6)}, "
            f"only at L=6: {dict(s6 - s2)}"
        )


def test_the_count_sees_a_per_layer_wait(models, device, monkeypatch):
    """Negative control: a bounds read per layer makes the count grow with the layers."""
    from pagekv.runtime import paged_cache
    from pagekv.runtime.backend import gather_layers

    def per_layer(*layers_and_backend):
        *layers, backend = layers_and_backend
        for layer in zip(*layers, strict=True):  # each reads its bounds
            used = gather_layers(*([x] for x in layer), backend=backend)
        return used

    monkeypatch.setattr(paged_cache, "gather_layers", per_layer)
    cfg = EvictionConfig(policy="entropy", budget=0.4, page_size=8, window=16)
    reads = HostReads(monkeypatch).install()
    runners = _warmed(models, device, "triton", cfg)
    n = {L: _step_reads(runners[L], device, cfg, reads)[0] for L in DEPTHS}
    assert n[2] < n[4] < n[6], n


class DeviceOps(TorchDispatchMode):
    """Counts the operations dispatched inside `with` by name, less views (no work) and
    allocations (`empty*`: an output per layer); `every`: those too."""

    def __init__(self, every: bool = False):
        super().__init__()
        self.every = every
        self.counts: Counter = Counter()

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        is_view = any(r.alias_info is not None for r in func._schema.returns)
        if self.every or (not is_view and "empty" not in name):
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def _step_ops(runner, cfg) -> Counter:
    pre = runner.prefill(prompt(150, seed=3), window_max=16)  # fresh: scoring counted
    with DeviceOps() as ops:
        _evict_step(runner, pre, cfg)
    return ops.counts


@pytest.mark.parametrize("case", CASES, ids=[f"{p}-{a}" for p, a in CASES])
def test_device_work_does_not_grow_with_the_layers(models, device, case):
    policy, allocation = case
    cfg = EvictionConfig(policy=policy, budget=0.4, page_size=8, window=16, allocation=allocation)
    runners = _warmed(models, device, "triton", cfg)
    c2, c4, c6 = (_step_ops(runners[L], cfg) for L in DEPTHS)
    assert c2 == c4 == c6, f"grow with the layers: {dict(c6 - c2)}; fewer: {dict(c2 - c6)}"


def test_the_op_count_sees_per_layer_work(models, device, monkeypatch):
    """Negative control: one more operation per layer (each layer's padded indices
    copied) makes the count grow with the layers."""
    padded = runner_mod.padded_kept_indices
    monkeypatch.setattr(runner_mod, "padded_kept_indices", lambda p: [i.clone() for i in padded(p)])
    cfg = EvictionConfig(policy="head_independent", budget=0.4, page_size=8, window=16)
    runners = _warmed(models, device, "triton", cfg)
    c2, c4, c6 = (_step_ops(runners[L], cfg).total() for L in DEPTHS)
    assert c2 < c4 < c6, (c2, c4, c6)


def _layer_pairs(n_layers: int, device, dtypes=(torch.float16,)) -> list:
    return [
        tuple(torch.randn(1, 2, 5, 4, device=device).to(dtypes[i % len(dtypes)]) for _ in "kv")
        for i in range(n_layers)
    ]


def test_the_evicted_cache_is_made_without_a_tensor_per_layer(device):
    """`_new_cache` dispatches as many operations for 28 layers as for 2."""
    counts = []
    for n_layers in (2, 28):
        pairs = _layer_pairs(n_layers, device)
        with DeviceOps(every=True) as ops:
            runner_mod._new_cache(pairs)
        counts.append(ops.total)
    assert counts[0] == counts[1], counts


def test_the_evicted_cache_layers_are_as_transformers_makes_them(device):
    """Each `_new_cache` layer holds the given tensors and otherwise transformers'
    `lazy_initialization` state, mixed dtypes too."""
    from transformers.cache_utils import DynamicLayer

    pairs = _layer_pairs(5, device, dtypes=(torch.float16, torch.float16, torch.float32))
    cache = runner_mod._new_cache(pairs)
    assert len(cache.layers) == len(pairs)
    for layer, (k, v) in zip(cache.layers, pairs, strict=True):
        ref = DynamicLayer()
        ref.lazy_initialization(k, v)
        assert layer.keys is k and layer.values is v
        got = {a: x for a, x in vars(layer).items() if a not in ("keys", "values")}
        want = {a: x for a, x in vars(ref).items() if a not in ("keys", "values")}
        assert got == want
    assert cache.get_seq_length() == 5
    new_k, new_v = _layer_pairs(1, device)[0]
    keys, _ = cache.update(new_k, new_v, layer_idx=0)  # appends, as before
    assert torch.equal(keys, torch.cat([pairs[0][0], new_k], dim=2))


def test_step_ops_baseline_is_the_per_layer_wrapping(monkeypatch, device):
    """benchmarks/step_ops.py's per-layer baseline dispatches more with each layer."""
    from tests.benchmark_scripts import load

    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "1"))
    step_ops = load("step_ops")  # it sets TRITON_INTERPRET; put back after the test
    extra = []
    for n_layers in (1, 2, 6):
        pairs = _layer_pairs(n_layers, device)
        counts = []
        for wrap in (step_ops.cache_per_layer, runner_mod._new_cache):
            with DeviceOps(every=True) as ops:
                cache = wrap(pairs)
            counts.append(ops.total)
            assert [(la.keys, la.values) for la in cache.layers] == pairs
        extra.append(counts[0] - counts[1])
    assert extra[0] < extra[1] < extra[2], extra
