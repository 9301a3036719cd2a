"""A ragged cache takes the question in one step with a causal block per group: the logits of
feeding it token by token. A non-causal block (control) gives other logits."""

from __future__ import annotations

import pytest
import torch

from pagekv import EvictionConfig
from pagekv.runtime.runner import Runner
from tests.test_runner import prompt, tiny_model

CASES = [("head_independent", "uniform"), ("entropy", "global")]


def _question_logits(runner, pre, cfg, one_step: bool) -> torch.Tensor:
    """The last question position's logits, the question fed in one step or one token
    at a time, through the decode step on a cache evicted for the purpose."""
    ev = runner.evict(pre, cfg)
    assert ev.ragged
    cache = runner.decode_cache([ev], pre, len(pre.question_ids))
    step = runner._lean_decoder().step
    if one_step:
        return step(torch.tensor([pre.question_ids]), pre.n, cache)[0]
    for i, t in enumerate(pre.question_ids):
        out = step(torch.tensor([[t]]), pre.n + i, cache)[0]
    return out


@pytest.mark.parametrize("policy, allocation", CASES, ids=[p for p, _ in CASES])
def test_the_question_in_one_step_is_the_question_token_by_token(policy, allocation):
    runner = Runner(tiny_model("llama"), None, decode_dtype="float32")
    pre = runner.prefill(prompt(80, seed=6), window_max=16, question_ids=prompt(7, seed=8))
    cfg = EvictionConfig(policy=policy, budget=0.4, page_size=8, window=16, allocation=allocation)
    one = _question_logits(runner, pre, cfg, one_step=True)
    each = _question_logits(runner, pre, cfg, one_step=False)
    torch.testing.assert_close(one, each, rtol=1e-5, atol=1e-5)
    res = runner.evaluate(pre, cfg, max_new_tokens=6, stop_at_eos=False)
    assert res.tokens[0] == int(each.argmax())


def test_without_the_causal_block_the_logits_differ(monkeypatch):
    """Negative control: masks that let every question token see the whole question."""
    runner = Runner(tiny_model("llama"), None, decode_dtype="float32")
    pre = runner.prefill(prompt(80, seed=6), window_max=16, question_ids=prompt(7, seed=8))
    cfg = EvictionConfig(policy="head_independent", budget=0.4, page_size=8, window=16)
    each = _question_logits(runner, pre, cfg, one_step=False)
    from pagekv.runtime import paged_cache

    def nothing_ahead(n, t, device=None):
        return torch.zeros(t, n, dtype=torch.bool, device=device)

    monkeypatch.setattr(paged_cache, "future_mask", nothing_ahead)
    one = _question_logits(runner, pre, cfg, one_step=True)
    assert not torch.allclose(one, each, rtol=1e-3, atol=1e-3)
