"""Prefill, eviction and decode on the bundled model for 1k, 2k and 4k-token prompts.

Usage: python benchmarks/bench_decode.py [--sizes 1000 2000 4000] [--policy entropy]
       [--budget 0.2] [--page-size 16] [--new-tokens 24] [--model bundled] [--dtype auto]
       [--repeats 3] [--json PATH]

Per prompt size: prefill seconds; eviction (plan + compaction, profiles included)
in ms and as a fraction of the prefill; decode tokens/s with the full cache and
with the evicted cache (same process, same prompt); cache bytes before and after;
and the whole needle run (prefill + every policy + decoding) in seconds. Also the
model's load time (from the converted cache after the first run).

Then the decode on both paths, on the same prefill in the same process: ms per token
of the model's own transformers forward (plain transformers with a `DynamicCache` over
the same evicted cache, positions continuing at n: the baseline, run here) and of the
runner's decode step (`--dtype`, "auto": float16 linear weights on the CPU), full cache
and evicted, their ratio, and whether both decoded the same tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from transformers import DynamicCache

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pagekv import POLICIES, EvictionConfig  # noqa: E402
from pagekv.engine.study import PromptSpec, Study  # noqa: E402
from pagekv.runtime.backend import compact_layer  # noqa: E402
from pagekv.runtime.decode import DECODE_DTYPES  # noqa: E402
from pagekv.runtime.machine import cpu_facts  # noqa: E402
from pagekv.runtime.models import load_model  # noqa: E402
from pagekv.runtime.prefill import (
    forward,  # noqa: E402 (one token's forward into a cache)
    synced_now,  # noqa: E402 (wall time after the device's queue)
)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bundled")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 2000, 4000])
    ap.add_argument("--policy", default="entropy")
    ap.add_argument("--budget", type=float, default=0.2)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--dtype", default="auto", choices=DECODE_DTYPES, help="the runner's decode")
    ap.add_argument(
        "--repeats", type=int, default=3, help="decodes per path, alternated; the fastest kept"
    )
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    loaded = load_model(args.model)
    load_s = time.perf_counter() - t0
    # time every run: no result memo
    study = Study(loaded, result_memo_bytes=0, plan_memo_bytes=0, decode_dtype=args.dtype)
    runner = study.runner
    runner.warm_up()
    print(
        f"model {loaded.name} ({loaded.source}) on {loaded.device}, {loaded.dtype}; "
        f"load {load_s:.2f}s; torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"backend {runner.backend}; decode: {runner.decode_path}"
    )
    cfg = EvictionConfig(policy=args.policy, budget=args.budget, page_size=args.page_size)
    full = cfg.replace(policy="full")
    rows = []
    hdr = (
        f"{'tokens':>7}{'prefill s':>11}{'evict ms':>10}{'evict/prefill':>15}"
        f"{'full tok/s':>12}{'evicted tok/s':>15}{'MiB before':>12}{'MiB after':>11}"
        f"{'all policies s':>16}"
    )
    print(hdr, "-" * len(hdr), sep="\n")
    for size in args.sizes:
        spec = PromptSpec(task="needle", context=size, depth=0.5, seed=0)
        t_all = time.perf_counter()
        prep = study.prepare(spec)
        runs = {
            p: study.run(prep, cfg.replace(policy=p), args.new_tokens).to_dict() for p in POLICIES
        }
        all_s = time.perf_counter() - t_all
        # Timed again on the warm prefill: the policy under test and the full cache.
        ev = study.run(prep, cfg, args.new_tokens).to_dict()
        fu = study.run(prep, full, args.new_tokens).to_dict()
        prefill_s = prep.prefill.timings["prefill_s"]
        evict_s = ev["timings"]["score_s"] + ev["timings"]["evict_s"]
        row = {
            "prompt_tokens": prep.n,
            "prefill_s": prefill_s,
            "evict_ms": 1000 * evict_s,
            "evict_over_prefill": evict_s / prefill_s,
            "decode_tok_s_full": _tok_s(fu),
            "decode_tok_s_evicted": _tok_s(ev),
            "cache_bytes_before": ev["cache_bytes_before"],
            "cache_bytes_after": ev["cache_bytes_after"],
            "needle_run_all_policies_s": all_s,
            "answers": {p: (r["answer"], r["correct"]) for p, r in runs.items()},
        }
        # Both decode paths on this prefill, alternated so that both see the same machine.
        for label, c in (("full", full), ("evicted", cfg)):
            f32, dft = [], []  # seconds per forward: transformers', the runner's
            for _ in range(args.repeats):
                s, f32_tokens = transformers_decode(runner, prep.prefill, c, args.new_tokens)
                f32.append(s)
                r = runner.evaluate(prep.prefill, c, args.new_tokens, stop_at_eos=False)
                dft.append(r.timings["decode_s"] / _forwards(r))
            row[f"decode_ms_{label}_float32"] = 1000 * min(f32)
            row[f"decode_ms_{label}_default"] = 1000 * min(dft)
            row[f"decode_ratio_{label}"] = min(f32) / min(dft)
            row[f"same_tokens_{label}"] = f32_tokens == r.tokens
        rows.append(row)
        print(
            f"{row['prompt_tokens']:>7}{prefill_s:>11.2f}{row['evict_ms']:>10.1f}"
            f"{100 * row['evict_over_prefill']:>14.2f}%{row['decode_tok_s_full']:>12.1f}"
            f"{row['decode_tok_s_evicted']:>15.1f}{row['cache_bytes_before'] / 2**20:>12.1f}"
            f"{row['cache_bytes_after'] / 2**20:>11.1f}{all_s:>16.1f}"
        )
    hdr2 = (
        f"{'tokens':>7}{'cache':>9}{'transformers':>16}{'pagekv ms/tok':>16}{'ratio':>8}"
        f"{'same tokens':>13}"
    )
    print(
        f"\ndecode ms per token: transformers = the model's own forward with a DynamicCache; "
        f"pagekv = {runner.decode_path}"
    )
    print(hdr2, "-" * len(hdr2), sep="\n")
    for row in rows:
        for label in ("full", "evicted"):
            print(
                f"{row['prompt_tokens']:>7}{label:>9}{row[f'decode_ms_{label}_float32']:>16.1f}"
                f"{row[f'decode_ms_{label}_default']:>16.1f}{row[f'decode_ratio_{label}']:>8.2f}"
                f"{str(row[f'same_tokens_{label}']):>13}"
            )
    print(
        f"{args.new_tokens} tokens without stopping at EOS, on one prefill per size; each path "
        f"decoded {args.repeats} times, alternating, the fastest kept"
    )
    print(
        f"policy {args.policy}, budget {args.budget}, page size {args.page_size}, "
        f"{args.new_tokens} new tokens; 'all policies' = prefill + {len(POLICIES)} policies "
        "decoded on one prefill"
    )
    if args.json:
        with open(args.json, "w") as f:
            meta = {"load_s": load_s, "device": loaded.device, "decode": runner.decode_path,
                    "cpu": cpu_facts()}  # fmt: skip
            json.dump({**meta, "torch_threads": torch.get_num_threads(), "rows": rows}, f, indent=1)
    return rows


def transformers_decode(runner, pre, config, new_tokens: int) -> tuple[float, list[int]]:
    """The baseline: `config`'s evicted cache (dense plans: every group of a layer keeps
    the same tokens) decoded greedily by the model's own forward with a transformers
    `DynamicCache`, positions continuing at n, the question inside the prompt.
    Seconds per forward, and the tokens (the first from the prefill's logits)."""
    ev = runner.evict(pre, config)
    if ev.ragged or pre.question_ids:
        raise ValueError("the transformers baseline needs a dense plan and the question inside")
    cache = DynamicCache()  # appending concatenates: the prefill is left alone
    for layer, la in enumerate(pre.cache.layers):
        if ev.kept_indices is None:
            keys, values = la.keys, la.values
        else:
            keys, values = compact_layer(la.keys, la.values, ev.kept_indices[layer])
        cache.update(keys, values, layer)
    tokens = [int(pre.first_logits.argmax())]
    dev = runner.device
    with torch.inference_mode():
        t0 = synced_now(dev)
        for i in range(new_tokens - 1):
            out = forward(runner.model, tokens[-1:], pre.n + i, cache, runner._cache_kw, dev)
            tokens.append(int(out.logits[0, -1].argmax()))
        s = synced_now(dev) - t0
    return s / max(1, new_tokens - 1), tokens


def _forwards(res) -> int:
    """Decode forwards of a RunResult (see `_tok_s`)."""
    return max(1, len(res.tokens) - (1 if res.mode == "inside" else 0))


def _tok_s(rec: dict) -> float:
    """Decode forwards per second. With the question inside the prompt the first
    answer token comes from the prefill's logits, so n tokens cost n - 1 forwards."""
    forwards = len(rec["tokens"]) - (1 if rec["mode"] == "inside" else 0)
    dt = rec["timings"]["decode_s"]
    return forwards / dt if dt > 0 and forwards > 0 else float("nan")


if __name__ == "__main__":
    main()
