"""benchmarks/bench_products.py: every linear weight of a model multiplied by one row,
per weight dtype, and what that leaves of a step twice as fast as the float32 one."""

from __future__ import annotations

import json

import torch

from tests.benchmark_scripts import load
from tests.test_runner import tiny_model


def test_each_sweep_multiplies_one_row_by_every_weight_of_the_model():
    bench = load("bench_products")
    model = tiny_model("llama")
    ws = bench.weights(model)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert len(ws) == len(linears) == 3 * 7 + 1  # q, k, v, o, gate, up, down; the head
    for name, sweep in bench.sweeps(ws).items():
        outs = sweep()
        assert [tuple(o.shape) for o in outs] == [(1, w.shape[0]) for w in ws], name


def test_the_int8_weights_are_the_weights_to_half_a_step():
    bench = load("bench_products")
    w = torch.randn(48, 32) * torch.linspace(0.01, 3, 48)[:, None]
    q, scale = bench.int8_rows(w)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127
    step = scale.float()[:, None]
    assert bool(((q.float() * step - w).abs() <= step * 0.51).all())
    x = torch.randn(1, 32).bfloat16()
    got = torch.ops.aten._weight_int8pack_mm(x, q, scale).float()
    torch.testing.assert_close(got, x.float() @ w.t(), atol=0.1, rtol=0.05)


def test_it_bounds_a_step_twice_as_fast_as_the_float32_forward(tmp_path, capsys):
    out = tmp_path / "products.json"
    load("bench_products").main(["--repeats", "1", "--tokens", "40", "8", "--json", str(out)])
    got = json.loads(out.read_text())
    kept = min(got["ms"][d] for d in ("float32", "float16", "bfloat16"))
    assert kept > 0 and got["ms"]["int8 weights (quantised)"] > 0
    long, short = got["bounds"]
    assert (long["cached_tokens"], short["cached_tokens"]) == (40, 8)
    for row in (long, short):
        step = got["ms"][f"float32 forward step, {row['cached_tokens']} cached tokens"]
        assert row["float32_step_ms"] == step > 0 and row["half_ms"] == step / 2
        assert row["products_ms"] == kept and row["left_ms"] == step / 2 - kept
    printed = capsys.readouterr().out
    assert got["cpu"]["model"] in printed
    assert f"leaving {short['left_ms']:.1f} ms for the rest" in printed
