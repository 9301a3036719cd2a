"""A ragged cache (head-independent unions, a padded global plan) takes the question in
one step, its layers' masks holding a causal block over the question's tokens: the same
logits as feeding the question one token at a time (how it was decoded before issue 40),
and so the same answers. A mask without the causal block (every question token seeing
the whole question) gives other logits: the check can fail."""

from __future__ import annotations

import pytest
import torch

from pagekv import EvictionConfig
from pagekv.runtime.runner import Runner
from tests.test_runner import prompt, tiny_model

CASES = [("head_independent", "uniform"), ("entropy", "global")]


def _question_logits(runner, pre, cfg, one_step: bool) -> torch.Tensor:
    """The logits of every question position, fed in one step or one token at a time,
    on a cache evicted for the purpose (`_masked` reads its layers' lengths)."""
    ev = runner.evict(pre, cfg)
    assert ev.ragged
    cache = ev.cache
    out = []
    with runner._masked(ev):
        if one_step:
            x = torch.tensor([pre.question_ids])
            pos = torch.arange(pre.n, pre.n + x.shape[1])[None]
            kw = {runner._cache_kw: cache}
            return runner.model(input_ids=x, position_ids=pos, use_cache=True, **kw).logits[0]
        for i, t in enumerate(pre.question_ids):
            out.append(runner._forward([t], pre.n + i, cache))
    return torch.stack(out)


@pytest.mark.parametrize("policy, allocation", CASES, ids=[p for p, _ in CASES])
def test_the_question_in_one_step_is_the_question_token_by_token(policy, allocation):
    runner = Runner(tiny_model("llama"), None, decode_dtype="float32")
    pre = runner.prefill(prompt(80, seed=6), window_max=16, question_ids=prompt(7, seed=8))
    cfg = EvictionConfig(policy=policy, budget=0.4, page_size=8, window=16, allocation=allocation)
    one = _question_logits(runner, pre, cfg, one_step=True)
    each = _question_logits(runner, pre, cfg, one_step=False)
    torch.testing.assert_close(one, each, rtol=1e-5, atol=1e-5)
    res = runner.evaluate(pre, cfg, max_new_tokens=6, stop_at_eos=False)
    assert res.tokens[0] == int(each[-1].argmax())


def test_without_the_causal_block_the_logits_differ(monkeypatch):
    """Negative control: masks that let every question token see the whole question."""
    runner = Runner(tiny_model("llama"), None, decode_dtype="float32")
    pre = runner.prefill(prompt(80, seed=6), window_max=16, question_ids=prompt(7, seed=8))
    cfg = EvictionConfig(policy="head_independent", budget=0.4, page_size=8, window=16)
    each = _question_logits(runner, pre, cfg, one_step=False)
    monkeypatch.setattr(torch.Tensor, "triu", lambda self, k=0: torch.zeros_like(self))
    one = _question_logits(runner, pre, cfg, one_step=True)
    assert not torch.allclose(one, each, rtol=1e-3, atol=1e-3)
