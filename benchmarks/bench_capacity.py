"""What a budget buys: many 2,048-token prompts through one pool of fixed bytes.

Usage: python benchmarks/bench_capacity.py [--models bundled,qwen-coder-0.5b]
           [--prompts 12] [--context 2048] [--new 24] [--pool-prompts 2]
           [--budgets 0.2,0.1] [--decode float32] [--no-peer]
           [--out assets/results/capacity.json]

For each model, `--prompts` distinct needle prompts (a seeded haystack, the needle at a
seeded depth, the question inside the prompt) go through a pool that holds
`--pool-prompts` of them with the full cache (pages of 16, float32 keys and values).
In one process, at those same bytes:

- `full`: `Runner.serve` with nothing evicted (the baseline);
- `entropy` at each budget: `Runner.serve` evicting under the paper's policy;
- `transformers CB`: transformers' own continuous batching (`generate_batch`, sdpa
  attention, its `PagedAttentionCache` given the same bytes in pages of 16, no prefix
  sharing), what a user would run instead. It allocates blocks as a request grows
  and holds every KV head of every layer in a block; it evicts nothing.

For each it prints the sequences held at once (the most rows one step decoded), the
rows the pool fits by its blocks, the tokens per second of the batched decode steps
and of the whole run (prefills included), the prefill and eviction seconds per prompt,
and the share of answers scored correct; then the ratios to `full` and the CPU.
Tokens per second are the greedy decode's (`pagekv.runtime.decode`) with `--decode`
linear weights (float32 by default: the model's own, as transformers runs it);
transformers' figure is of the whole run only (its prefill and decode interleave
inside `generate_batch`). `--out` writes the table as JSON (the lesson "What a budget
buys" draws it).

Where the time of a batched step goes: before the pools, the milliseconds of one
decode step over 1, 2, 4 and 8 rows of one evicted prompt (the median of 7 steps),
with float16 and with float32 linear weights, and the share of one step in matrix
products (`aten::mm`, torch's profiler): how far a step's cost grows with its rows,
and on a CPU without half-precision arithmetic, where the default float16 weights
(fastest for one row) stop paying.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from pagekv import EvictionConfig  # noqa: E402
from pagekv.paths import CAPACITY_RESULTS_PATH  # noqa: E402
from pagekv.runtime.block_pool import BlockPool, blocks_needed  # noqa: E402
from pagekv.runtime.machine import cpu_facts  # noqa: E402
from pagekv.runtime.models import load_model  # noqa: E402
from pagekv.runtime.runner import Runner  # noqa: E402
from pagekv.tasks.base import score  # noqa: E402
from pagekv.tasks.needle import make_needle_task  # noqa: E402

PAGE = 16


def needle_prompts(tokenizer, n: int, context: int):
    """`n` distinct needle tasks of about `context` tokens and their prompt ids."""
    tasks = [
        make_needle_task(tokenizer, context_tokens=context, seed=100 + i, depth=(i * 0.37) % 1.0)
        for i in range(n)
    ]
    return tasks, [t.build_prompt_ids(tokenizer)["input_ids"] for t in tasks]


def share_correct(answers, tasks) -> float:
    """The share of `answers` their task scores correct."""
    return statistics.fmean(score(a, t)["correct"] for a, t in zip(answers, tasks, strict=True))


def ours(runner, ids, tasks, config, pool_bytes, new) -> dict:
    run = runner.serve(ids, config, pool_bytes, max_new_tokens=new)
    per_prompt = statistics.median(run.blocks)
    return {
        "held": run.max_live,
        "fits": int(run.pool_blocks // per_prompt),
        "mean_live": statistics.fmean(run.live) if run.live else 0.0,
        "decode_tok_s": run.decode_tokens_per_s,
        "tok_s": run.tokens_per_s,
        "prefill_s": statistics.fmean(run.prefill_s),
        "evict_s": statistics.fmean(run.evict_s),
        "correct": share_correct(run.answers, tasks),
        "tokens": sum(map(len, run.tokens)),
        "steps": len(run.live),
        "wall_s": run.wall_s,
        "blocks_per_prompt": per_prompt,
        "pool_blocks": run.pool_blocks,
    }


def transformers_cb(name, ids, tasks, pool_bytes, new) -> dict:
    """transformers' continuous batching on the same bytes (module docstring)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching import scheduler as cbs

    lm = load_model(name)  # its own copy: generate_batch switches the attention
    model, tok = lm.model, lm.tokenizer
    cfg = model.config.get_text_config()
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    itemsize = next(model.parameters()).element_size()
    block = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * d * itemsize * PAGE
    live: list[int] = []
    patched = {}
    for cls in {cbs.FIFOScheduler, *cbs.SCHEDULER_MAPPING.values()}:
        patched[cls] = original = cls.schedule_batch

        def counted(self, *a, _original=original, **k):
            out = _original(self, *a, **k)
            live.append(len(self.active_requests))
            return out

        cls.schedule_batch = counted
    eos = list(Runner(model, tok).eos_ids)
    gen = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=eos,
                           pad_token_id=tok.pad_token_id or eos[0])  # fmt: skip
    cb = ContinuousBatchingConfig(page_size=PAGE, num_blocks=pool_bytes // block,
                                  max_batch_tokens=2048, allow_block_sharing=False)  # fmt: skip
    try:
        t0 = time.perf_counter()
        out = model.generate_batch(inputs=ids, generation_config=gen, continuous_batching_config=cb)
        wall = time.perf_counter() - t0
    finally:
        for cls, original in patched.items():
            cls.schedule_batch = original
    outs = [out[k] for k in sorted(out, key=lambda k: int(k.split("_")[-1]))]
    answers = [tok.decode(o.generated_tokens, skip_special_tokens=True).strip() for o in outs]
    tokens = sum(len(o.generated_tokens) for o in outs)
    need = -(-(len(ids[0]) + new) // PAGE)
    return {
        "held": max(live, default=0),
        "fits": (pool_bytes // block) // need,
        "mean_live": statistics.fmean(live) if live else 0.0,
        "decode_tok_s": None,
        "tok_s": tokens / wall,
        "prefill_s": None,
        "evict_s": None,
        "correct": share_correct(answers, tasks),
        "tokens": tokens,
        "steps": len(live),
        "wall_s": wall,
        "blocks_per_prompt": need,
        "pool_blocks": pool_bytes // block,
    }


def step_profile(model, tokenizer, ids, rows=(1, 2, 4, 8), steps=10) -> dict:
    """Milliseconds of one batched decode step over `rows` rows of one prompt evicted at
    20 %, and the share in `aten::mm`, per weight dtype (module docstring)."""
    from torch.profiler import ProfilerActivity, profile

    out = {}
    for dtype in ("float16", "float32"):
        runner = Runner(model, tokenizer, decode_dtype=dtype)
        pre = runner.prefill(ids)
        ev = runner.evict(pre, EvictionConfig(policy="entropy", budget=0.2, page_size=PAGE))
        keys = [lay.keys for lay in pre.cache.layers]
        values = [lay.values for lay in pre.cache.layers]
        extra = steps * len(rows)  # the first rows step in every batch
        need = blocks_needed(ev.stored_tokens, extra, PAGE)
        pool = BlockPool(need * max(rows), pre.n_layers, pre.n_groups, pre.head_dim, PAGE,
                         keys[0])  # fmt: skip
        admitted = [pool.admit(keys, values, ev.kept_indices, ev.stored_tokens, extra)
                    for _ in range(max(rows))]  # fmt: skip
        step = runner._lean_decoder().step
        timings = {}
        for b in rows:
            batch = pool.batch(admitted[:b])
            tok = torch.zeros(b, 1, dtype=torch.long)
            pos = torch.full((b,), pre.n, dtype=torch.long)
            times = []
            for i in range(steps - 1):  # two to warm, then each timed: the median
                t0 = time.perf_counter()
                step(tok, pos + i, batch)
                times.append(time.perf_counter() - t0)
            ms = 1000 * statistics.median(times[2:])
            with profile(activities=[ProfilerActivity.CPU]) as prof:  # one step, profiled
                step(tok, pos + steps - 1, batch)
            total = sum(e.self_cpu_time_total for e in prof.key_averages())
            mm = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key == "aten::mm")
            timings[b] = {"ms": ms, "mm_share": mm / total if total else 0.0}
        out[dtype] = timings
    return out


def bench_model(name, args) -> dict:
    lm = load_model(name)
    runner = Runner(lm.model, lm.tokenizer, decode_dtype=args.decode)
    tasks, ids = needle_prompts(lm.tokenizer, args.prompts, args.context)
    steps = step_profile(lm.model, lm.tokenizer, ids[0], rows=args.profile_rows)
    cfg = lm.model.config.get_text_config()
    L, G = cfg.num_hidden_layers, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    longest = max(map(len, ids))
    full_blocks = blocks_needed([[longest] * G] * L, args.new, PAGE)
    pool_bytes = args.pool_prompts * full_blocks * 2 * PAGE * d * 4  # float32 K and V
    runner.warm_up()
    sides = {"full": ours(runner, ids, tasks, EvictionConfig(policy="full", page_size=PAGE),
                          pool_bytes, args.new)}  # fmt: skip
    for b in args.budgets:
        config = EvictionConfig(policy="entropy", budget=b, page_size=PAGE)
        sides[f"entropy {b:.0%}"] = ours(runner, ids, tasks, config, pool_bytes, args.new)
    if not args.no_peer:
        sides["transformers CB"] = transformers_cb(name, ids, tasks, pool_bytes, args.new)
    return {
        "model": name,
        "prompts": args.prompts,
        "prompt_tokens": [min(map(len, ids)), longest],
        "max_new_tokens": args.new,
        "page_size": PAGE,
        "pool_bytes": pool_bytes,
        "pool_full_prompts": args.pool_prompts,
        "decode": runner.decode_path,
        "step_ms": steps,
        "sides": sides,
    }


def table(result: dict) -> str:
    full = result["sides"]["full"]

    def ratio(a, b):
        return "" if a is None or not b else f" ({a / b:.2f}x)"

    lines = [
        f"{result['model']}: {result['prompts']} prompts of {result['prompt_tokens'][0]}-"
        f"{result['prompt_tokens'][1]} tokens, {result['max_new_tokens']} new, a pool of "
        f"{result['pool_bytes'] / 2**20:.1f} MiB ({result['pool_full_prompts']} full prompts)",
        "| side | held at once | pool fits | decode tok/s | run tok/s | prefill s | evict s "
        "| correct |",
        "|---|---|---|---|---|---|---|---|",
    ]
    rows = list(next(iter(result["step_ms"].values())))
    steps = [
        "one batched step (ms; share in aten::mm): "
        + "; ".join(
            f"{dtype} weights "
            + ", ".join(f"{b} rows {t[b]['ms']:.0f} ({t[b]['mm_share']:.0%})" for b in rows)
            for dtype, t in result["step_ms"].items()
        )
    ]
    for side, s in result["sides"].items():
        dec = "n/a" if s["decode_tok_s"] is None else f"{s['decode_tok_s']:.1f}"
        pre = "in run" if s["prefill_s"] is None else f"{s['prefill_s']:.2f}"
        ev = "none" if s["evict_s"] is None else f"{s['evict_s']:.3f}"
        lines.append(
            f"| {side} | {s['held']}{ratio(s['held'], full['held'])} | {s['fits']} | "
            f"{dec}{ratio(s['decode_tok_s'], full['decode_tok_s'])} | "
            f"{s['tok_s']:.2f}{ratio(s['tok_s'], full['tok_s'])} | {pre} | {ev} | "
            f"{s['correct']:.2f} |"
        )
    return "\n".join(lines + steps)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="bundled,qwen-coder-0.5b")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--new", type=int, default=24)
    ap.add_argument("--pool-prompts", type=int, default=2)
    ap.add_argument("--budgets", default="0.2,0.1")
    ap.add_argument("--profile-rows", default="1,2,4,8", help="the profiled steps' batch sizes")
    ap.add_argument("--decode", default="float32", help="the decode's linear weights")
    ap.add_argument("--no-peer", action="store_true", help="skip transformers' continuous batching")
    ap.add_argument(
        "--out", default=None, help=f"write JSON here (the lesson reads {CAPACITY_RESULTS_PATH})"
    )
    args = ap.parse_args(argv)
    args.budgets = [float(b) for b in args.budgets.split(",")]
    args.profile_rows = tuple(int(b) for b in args.profile_rows.split(","))
    torch.manual_seed(0)
    results = []
    for name in args.models.split(","):
        results.append(bench_model(name, args))
        print(table(results[-1]), flush=True)
    machine = cpu_facts()
    print(f"CPU: {machine['model']}, {machine['cores']} cores, torch {torch.__version__}")
    if args.out:
        command = "python benchmarks/bench_capacity.py " + " ".join(argv or sys.argv[1:])
        payload = {"command": command, "cpu": machine, "results": results}
        with open(args.out, "w") as f:
            json.dump(payload, f, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
