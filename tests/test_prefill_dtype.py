"""experiments/prefill_dtype.py: the bfloat16 prefill it compares hands the float32
runner a float32 prefill of the same prompt, close to the runner's own."""

from __future__ import annotations

import torch

from experiments.prefill_dtype import prefill_in
from pagekv import EvictionConfig, Runner
from tests.test_runner import prompt, tiny_model


def test_a_bfloat16_prefill_comes_back_in_float32_and_near_the_float32_one():
    runner = Runner(tiny_model("llama"), None)
    ids = prompt(96, seed=3)
    own = runner.prefill(ids)
    half = prefill_in(runner, torch.bfloat16)(ids)
    assert next(runner.model.parameters()).dtype == torch.float32  # a copy ran in bf16
    assert half.ids == own.ids and half.n == own.n and half.backend == own.backend
    for mine, theirs in zip(half.cache.layers, own.cache.layers, strict=True):
        for x, y in ((mine.keys, theirs.keys), (mine.values, theirs.values)):
            assert x.dtype == torch.float32 and x.shape == y.shape
            # bfloat16 keeps 8 significant bits: near, but not the same numbers.
            assert 0 < (x - y).abs().max() <= 0.05 * y.abs().max()
    assert half.q_win.dtype == torch.float32 and half.q_win.shape == own.q_win.shape
    assert torch.allclose(half.q_win, own.q_win, rtol=0.05, atol=0.05 * own.q_win.abs().max())
    cfg = EvictionConfig(policy="entropy", budget=0.5, page_size=8, window=16)
    out = runner.evaluate(half, cfg, max_new_tokens=4)  # the float32 runner decodes from it
    assert len(out.tokens) == 4


def test_the_performance_doc_states_the_committed_measurement():
    """docs/performance.md's bfloat16-prefill table is docs/prefill_dtype.json's."""
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    got = json.loads((root / "docs/prefill_dtype.json").read_text())
    rows, prefills = got["rows"], got["prefills"]
    same = sum(r["same_tokens"] for r in rows)
    flips = sum(r["correct_float32"] != r["correct_bfloat16"] for r in rows)
    right = [sum(r[f"correct_{k}"] for r in rows) for k in ("float32", "bfloat16")]
    f32, bf16 = (sum(p[k] for p in prefills) for k in ("float32_s", "bfloat16_s"))
    doc = (root / "docs/performance.md").read_text()
    n = len(rows)
    assert f"| float32 | {f32:.1f} s | | {right[0]} of {n} | |" in doc
    assert f"| bfloat16 | {bf16:.1f} s ({f32 / bf16:.2f}x faster) | {same} of {n} | " in doc
    assert f"| {right[1]} of {n} | {flips} |" in doc
    assert len(prefills) == 28 and f"{n} cases twice" in doc.replace("\n", " ")
