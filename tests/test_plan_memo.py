"""One plan memo (`Study.plans`, its own cap): one Run plans each configuration once,
the full cache, A and B among them, the UOR curve's budgets and the memory rows'
policies each once too (they read the memo for what a side planned)."""

from __future__ import annotations

import pytest

from pagekv import EvictionConfig, PromptSpec
from pagekv.app.comparison import compare
from pagekv.app.memo import ByteLRU
from pagekv.app.worker import ModelWorker

from .test_worker_stress import _tiny_study, tokenizer  # noqa: F401 (a fixture)

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("result_memo_bytes", [64 * 2**20, 0])
def test_one_run_plans_each_configuration_once(tokenizer, monkeypatch, result_memo_bytes):  # noqa: F811
    study = _tiny_study(tokenizer, ModelWorker())
    if not result_memo_bytes:  # the plan memo stays on when the result memo is off
        study.results = ByteLRU(0)
    planned = []
    real = study.runner.plan_prefill

    def counting(pre, config):
        planned.append(config)
        return real(pre, config)

    monkeypatch.setattr(study.runner, "plan_prefill", counting)
    spec = PromptSpec(task="needle", context_tokens=200, seed=7)
    a = EvictionConfig(policy="mean", budget=0.5, page_size=8, window=16)
    b = a.replace(policy="entropy")
    compare(study, spec, a, b, max_new_tokens=2)
    repeated = sorted({str(c) for c in planned if planned.count(c) > 1})
    assert not repeated, repeated
    assert {EvictionConfig(policy="full"), a, b} <= set(planned)
    curve = [c for c in planned if c.policy == "head_independent" and c.budget != b.budget]
    assert len(curve) == len({c.budget for c in curve}) >= 3  # the curve's budgets, once each
