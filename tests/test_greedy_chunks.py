"""Greedy decoding reads its tokens once per `Runner.decode_chunk` steps: whatever the chunk, the
tokens, stop reason and kept logits equal reading every token (an EOS inside a chunk included),
for dense and ragged caches, both modes and both decode paths."""

from __future__ import annotations

import pytest
import torch

from pagekv import EvictionConfig
from pagekv.runtime.runner import Runner
from tests.test_runner import prompt, tiny_model

#: (policy, allocation, mode): a dense cache, a ragged one (per-head unions), a padded
#: global plan, the full cache.
CASES = [
    ("entropy", "uniform", "inside"),
    ("head_independent", "uniform", "after"),
    ("entropy", "global", "after"),
    ("full", "uniform", "inside"),
]


def _run(runner, case, chunk, eos=None, max_new=11):
    policy, allocation, mode = case
    runner.decode_chunk = chunk
    runner.eos_ids = set(eos or ())
    ids = prompt(90, seed=5)
    q = prompt(6, seed=9) if mode == "after" else None
    pre = runner.prefill(ids, window_max=16, question_ids=q)
    cfg = EvictionConfig(policy=policy, budget=0.5, page_size=8, window=16, allocation=allocation)
    res = runner.evaluate(pre, cfg, max_new_tokens=max_new, stop_at_eos=eos is not None,
                          return_logits=True)  # fmt: skip
    return res.tokens, res.stop_reason, res.logits


@pytest.mark.parametrize("decode", ["float32", "float16"])
@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_any_chunk_decodes_the_same_answer(case, decode):
    runner = Runner(tiny_model("llama"), None, decode_dtype=decode)
    assert runner.decode_chunk == 1  # on the CPU a read waits on nothing
    ref, stop, ref_logits = _run(runner, case, chunk=1)
    assert stop == "max_new_tokens" and len(ref) == 11
    # An EOS at the 6th token, inside a chunk of 4 (tokens 5-8) and of 8 (tokens 1-8):
    # the first occurrence of that token is where a per-token loop stops.
    at = ref.index(ref[5])
    for chunk in (2, 4, 8, 64):
        tokens, stop, logits = _run(runner, case, chunk)
        assert (tokens, stop) == (ref, "max_new_tokens"), chunk
        assert torch.equal(logits, ref_logits), chunk
        tokens, stop, logits = _run(runner, case, chunk, eos=[ref[5]])
        assert (tokens, stop) == (ref[: at + 1], "eos"), chunk
        assert torch.equal(logits, ref_logits[: at + 1]), chunk
