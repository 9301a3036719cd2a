"""One plan memo (`Study.plans`, its own cap): one Run plans each configuration once,
the full cache, A and B among them, the UOR curve's budgets and the memory rows'
policies each once too (they read the memo for what a side planned)."""

from __future__ import annotations

import pytest

from pagekv import EvictionConfig, PromptSpec
from pagekv.engine.comparison import Side, compare, preview_comparison
from pagekv.engine.memo import ByteLRU
from pagekv.engine.worker import ModelWorker

from .test_worker_stress import _tiny_study, tokenizer  # noqa: F401 (a fixture)

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("result_memo_bytes", [64 * 2**20, 0])
def test_one_run_plans_each_configuration_once(tokenizer, monkeypatch, result_memo_bytes):  # noqa: F811
    study = _tiny_study(tokenizer, ModelWorker())
    if not result_memo_bytes:  # the plan memo stays on when the result memo is off
        study.results = ByteLRU(0)
    planned = []
    real = study.runner.plan

    def counting(pre, config):
        planned.append(config)
        return real(pre, config)

    monkeypatch.setattr(study.runner, "plan", counting)
    spec = PromptSpec(task="needle", context=200, seed=7)
    a = EvictionConfig(policy="mean", budget=0.5, page_size=8, window=16)
    b = a.replace(policy="entropy")
    compare(study, spec, Side(a), Side(b), max_new_tokens=2)
    repeated = sorted({str(c) for c in planned if planned.count(c) > 1})
    assert not repeated, repeated
    assert {EvictionConfig(policy="full"), a, b} <= set(planned)
    curve = [c for c in planned if c.policy == "head_independent" and c.budget != b.budget]
    assert len(curve) == len({c.budget for c in curve}) >= 3  # the curve's budgets, once each


def test_the_memory_rows_count_what_the_decode_cache_stores(tokenizer):  # noqa: F811
    """The memory chart's bytes per pooled policy are what the decode cache stores per (layer,
    group), shared budget included; head-independent counts its unions."""
    study = _tiny_study(tokenizer, ModelWorker())
    spec = PromptSpec(task="needle", context=300, seed=3, mode="after")
    shared = Side.of("entropy", budget=0.3, page_size=4, window=8, allocation="global")
    comp = preview_comparison(study, spec, shared.replace(policy="mean"), shared)
    pre = comp.preps["B"].prefill
    per_token = pre.head_dim * 2 * pre.cache.layers[0].keys.element_size()
    rows = {r["policy"]: r for r in comp.memory}
    uneven = False
    for policy in ("entropy", "mean", "head_independent"):
        per_head = policy == "head_independent"  # per-head picks: always uniform
        cfg = shared.config.replace(policy=policy, allocation="uniform" if per_head else "global")
        ev = study.runner.evict(pre, cfg)
        cache = study.runner.decode_cache([ev], pre, 1)
        stored = [cache.host_lengths(layer)[0] for layer in range(len(ev.stored_tokens))]
        assert stored == ev.stored_tokens, policy
        counted = ev.union_tokens if per_head else stored
        assert rows[policy]["bytes"] == sum(map(sum, counted)) * per_token, policy
        uneven |= not per_head and any(len(set(row)) > 1 for row in stored)
    assert uneven  # the shared budget kept different counts in some layer's groups
