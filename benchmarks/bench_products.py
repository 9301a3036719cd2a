"""What bounds the decode step on this CPU: the products of every linear layer, once.

Usage: python benchmarks/bench_products.py [--model bundled] [--tokens 2068 414]
       [--repeats 7] [--json PATH]

A decode step multiplies one row by every linear weight of the model: each layer's
q/k/v, o, gate/up and down, and the head. Nothing a decode does can skip them. This
times exactly those products, `torch.mm` of one row by each of the model's weights
(transposed, as the decode step reads them), in float32, float16 and bfloat16, and
`torch.ops.aten._weight_int8pack_mm` with int8 weights (per-row scales, bfloat16 rows:
weight-only quantisation, each weight rounded to one of 255 levels of its row: a
reference point, not a decode the project runs).

Beside them it times the model's own float32 forward of one token over a transformers
cache of each `--tokens` length (the baseline of `benchmarks/bench_decode.py`: 2068 is
its 2k prompt, 414 its 20 % budget), and prints half of it (the step of a decode twice
as fast) and what would be left of that half for everything but the products
(attention, norms, RoPE, the cache) with the fastest products in a float dtype
(float32, float16 or bfloat16, the decode's `--dtype` choices). Each figure is the
fastest of `--repeats` runs, all of them alternated, in this process; the CPU's model,
flags, cores and load average are printed with them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagekv.runtime.machine import cpu_facts  # noqa: E402
from pagekv.runtime.models import load_model  # noqa: E402
from pagekv.runtime.prefill import cache_kwarg  # noqa: E402

#: The decode's weight dtypes (`--dtype`), then the reference point.
DTYPES = ("float32", "float16", "bfloat16")
INT8 = "int8 weights (quantised)"


def weights(model) -> list[torch.Tensor]:
    """Every linear weight `[out, in]` of `model`, the head included, float32."""
    return [m.weight.detach().float() for m in model.modules() if isinstance(m, torch.nn.Linear)]


def int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`w` `[out, in]` as int8 weights and bfloat16 per-row scales (`w ~ q * scale`, to
    half a step), what `_weight_int8pack_mm` multiplies by."""
    scale = (w.abs().amax(1).clamp_min(torch.finfo(torch.float32).tiny) / 127).bfloat16()
    q = (w / scale.float()[:, None]).round().clamp(-127, 127).to(torch.int8)
    return q, scale


def sweeps(ws: list[torch.Tensor]) -> dict:
    """One callable per way of running the products: each multiplies one row by every
    weight once."""
    made = {}
    for name in DTYPES:
        dtype = getattr(torch, name)
        ts = [w.to(dtype).t() for w in ws]  # `[in, out]` views, as `LeanDecoder` reads them
        rows = {w.shape[0]: torch.randn(1, w.shape[0], dtype=dtype) for w in ts}
        made[name] = lambda ts=ts, rows=rows: [torch.mm(rows[w.shape[0]], w) for w in ts]
    q, scales = zip(*(int8_rows(w) for w in ws), strict=True)
    rows = {w.shape[1]: torch.randn(1, w.shape[1], dtype=torch.bfloat16) for w in q}
    made[INT8] = lambda: [
        torch.ops.aten._weight_int8pack_mm(rows[w.shape[1]], w, s)
        for w, s in zip(q, scales, strict=True)
    ]
    return made


def forward_steps(model, lengths: list[int]) -> dict:
    """One callable per cache length `n`: the model's own float32 forward of one token
    at position `n` over a transformers cache of `n` random tokens (the cache cut back
    to `n` after each, so every call is the same step)."""
    made = {}
    vocab, kw = model.config.vocab_size, cache_kwarg(model)
    for n in lengths:
        g = torch.Generator().manual_seed(n)
        ids = torch.randint(3, vocab, (1, n + 1), generator=g)
        cache = DynamicCache()
        model(input_ids=ids[:, :n], use_cache=True, **{kw: cache})
        pos = torch.tensor([[n]])

        def step(cache=cache, tok=ids[:, n:], pos=pos, n=n):
            model(input_ids=tok, position_ids=pos, use_cache=True, **{kw: cache})
            cache.crop(-1)  # the token just appended

        made[f"float32 forward step, {n} cached tokens"] = step
    return made


def fastest(runs: dict, repeats: int) -> dict:
    """Milliseconds of each callable's fastest run, alternating between them."""
    best = dict.fromkeys(runs, float("inf"))
    for run in runs.values():
        run()  # warm: first-touch of the weights, kernel selection
    for _ in range(repeats):
        for name, run in runs.items():
            t0 = time.perf_counter()
            run()
            best[name] = min(best[name], (time.perf_counter() - t0) * 1e3)
    return best


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bundled")
    ap.add_argument("--repeats", type=int, default=7, help="runs of each; the fastest kept")
    ap.add_argument("--tokens", type=int, nargs="+", default=[2068, 414],
                    help="cache lengths of the float32 forward step")  # fmt: skip
    ap.add_argument("--json", default=None, help="also write the figures to this JSON file")
    args = ap.parse_args(argv)

    loaded = load_model(args.model)
    ws = weights(loaded.model)
    cpu = cpu_facts()
    print(
        f"model {loaded.name}: {len(ws)} linear weights, "
        f"{sum(w.numel() for w in ws) / 1e6:.1f} M parameters; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads"
    )
    print(
        f"cpu {cpu['model']} ({', '.join(cpu['flags'])}), {cpu['cores']} cores, "
        f"load {cpu['loadavg_1_5_15']}"
    )
    with torch.inference_mode():
        steps = forward_steps(loaded.model, args.tokens)
        ms = fastest({**sweeps(ws), **steps}, args.repeats)
    for name, t in ms.items():
        what = "for every product of one step" if name not in steps else "a token"
        print(f"  {name:<40} {t:7.2f} ms {what}")
    kept = min(ms[name] for name in DTYPES)
    bounds = []
    for n, name in zip(args.tokens, steps, strict=True):
        own = ms[name]
        bounds.append({"cached_tokens": n, "float32_step_ms": own, "half_ms": own / 2,
                       "products_ms": kept, "left_ms": own / 2 - kept})  # fmt: skip
        print(
            f"  {n} cached tokens: the float32 step {own:.1f} ms; twice as fast is "
            f"{own / 2:.1f} ms, of which the products take {kept:.1f}, "
            f"leaving {own / 2 - kept:.1f} ms for the rest"
        )
    out = {"model": loaded.name, "cpu": cpu, "threads": torch.get_num_threads(), "ms": ms,
           "bounds": bounds}  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
