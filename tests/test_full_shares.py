"""The `full` baseline copies the prefill's cache once, into its decode cache, and leaves
the prefill's own tensors as they were: through any number of decodes, on
both decode paths and in a batched pair, every later run on it answers the same."""

from __future__ import annotations

import pytest
import torch

from pagekv import EvictionConfig
from pagekv.runtime.runner import Runner
from tests.test_runner import prompt, stored_layers, tiny_model


@pytest.mark.parametrize("decode", ["float32", "float16"])
@pytest.mark.parametrize("mode", ["inside", "after"])
def test_full_shares_the_prefill_and_leaves_it_as_it_was(decode, mode):
    runner = Runner(tiny_model("llama"), None, decode_dtype=decode)
    q = prompt(5, seed=4) if mode == "after" else None
    pre = runner.prefill(prompt(70, seed=2), window_max=16, question_ids=q)
    before = [(la.keys.clone(), la.values.clone()) for la in pre.cache.layers]
    full = EvictionConfig(policy="full", window=16)
    ev = runner.evict(pre, full)
    assert ev.kept_indices is None and ev.stored_tokens == [[70] * pre.n_groups] * pre.n_layers
    for (k, v), la in zip(stored_layers(runner, pre, ev), pre.cache.layers, strict=True):
        assert torch.equal(k, la.keys) and torch.equal(v, la.values)  # the whole prompt
    first = runner.evaluate(pre, full, max_new_tokens=8, stop_at_eos=False)
    other = EvictionConfig(policy="entropy", budget=0.5, page_size=8, window=16)
    runner.evaluate_pair(pre, full, other, max_new_tokens=8, stop_at_eos=False)
    again = runner.evaluate(pre, full, max_new_tokens=8, stop_at_eos=False)
    assert again.tokens == first.tokens
    for (k0, v0), la in zip(before, pre.cache.layers, strict=True):
        assert torch.equal(la.keys, k0) and torch.equal(la.values, v0)
        assert la.keys.shape[2] == 70  # nothing appended to the prefill's own layers
