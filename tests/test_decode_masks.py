"""Every mask a ragged decode passes to SDPA spans its keys with unit stride (CUDA's fused attention
refuses a mask broadcast along the keys), for per-head unions and a global plan; a
question-inside paged decode passes none."""

from __future__ import annotations

import pytest
import torch

from pagekv import EvictionConfig
from pagekv.runtime.runner import Runner
from tests.test_runner import prompt, tiny_model

CASES = {
    "head_independent": dict(policy="head_independent", allocation="uniform"),
    "global": dict(policy="entropy", allocation="global"),
}


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", attn="sdpa", layers=4, seed=3)


def _masks_seen(monkeypatch, run) -> list[tuple]:
    """`(mask shape, mask stride, key length)` of every masked SDPA call inside `run()`."""
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(query, key, value, attn_mask=None, *args, **kwargs):
        if attn_mask is not None:
            seen.append((tuple(attn_mask.shape), attn_mask.stride(), key.shape[-2]))
        return sdpa(query, key, value, attn_mask, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    run()
    return seen


@pytest.mark.parametrize("mode", ["inside", "after"])
@pytest.mark.parametrize("case", list(CASES))
def test_ragged_decode_masks_span_the_keys_contiguously(model, monkeypatch, case, mode):
    runner = Runner(model, None, decode_dtype="float32")
    ids = prompt(100, seed=17)
    question = ids[92:] if mode == "after" else None
    pre = runner.prefill(ids[:92] if question else ids, window_max=8, question_ids=question)
    ragged = None
    for budget in (0.2, 0.25, 0.3, 0.35, 0.4):
        cfg = EvictionConfig(budget=budget, page_size=4, window=8, n_sink=2, **CASES[case])
        if runner.evict(pre, cfg).ragged:
            ragged = cfg
            break
    assert ragged is not None, "no budget gave a ragged cache"
    seen = _masks_seen(
        monkeypatch, lambda: runner.evaluate(pre, ragged, max_new_tokens=3, stop_at_eos=False)
    )
    if question is None:
        assert seen == [], "one new token needs no mask"
        return
    assert len(seen) >= len(pre.cache.layers), "the question's step masks every layer"
    for shape, stride, keys in seen:
        assert shape[-1] == keys, f"mask {shape} over {keys} keys: broadcast along the keys"
        assert stride[-1] == 1, f"mask {shape} has stride {stride}: not contiguous in the keys"
