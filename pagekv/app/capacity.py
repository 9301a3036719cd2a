"""What a budget buys: how many prompts like the current one a fixed pool holds at each
side's budget, from the plans' kept pages (live), beside what the committed benchmark
measured in such a pool (`benchmarks/bench_capacity.py`, measured earlier, not live).

The pool. `POOL_FULL_PROMPTS` full caches of a `POOL_PROMPT_TOKENS`-token prompt with
`ANSWER_TOKENS` answer tokens, of the model that ran, in pages of 16: the benchmark's
pool. A prompt takes, per (layer, KV head), its stored tokens plus its question and
answer tokens rounded up to its pages (`pagekv.runtime.block_pool`: what `Runner.serve`
reserves at admission), in the cache's dtype.
"""

from __future__ import annotations

import json

from pagekv.paths import CAPACITY_RESULTS_PATH

#: The benchmark's pool: this many full caches of a prompt of this many tokens.
POOL_FULL_PROMPTS = 2
POOL_PROMPT_TOKENS = 2048
#: The answer tokens every prompt reserves (the benchmark's `--new`).
ANSWER_TOKENS = 24
#: The full cache's page size (the benchmark's).
FULL_PAGE = 16


def prompt_bytes(stored, extra: int, page: int, token_bytes: int) -> int:
    """The bytes a prompt whose (layer, KV head)s store `stored[l][g]` tokens takes in a
    pool of pages of `page` tokens, with `extra` more tokens each."""
    return sum(-(-(int(t) + extra) // page) * page for row in stored for t in row) * token_bytes


def stored_tokens(plan) -> list[list[int]]:
    """What the decode cache stores per (layer, KV head) for `plan`
    (`Runner.evict`): each group's own allocation under a global plan, else every group
    of a layer at the layer's largest kept set (the runner pads head-independent unions)."""
    union = plan.union_tokens.tolist()
    if plan.config.allocation != "uniform" and not plan.dense:
        return union
    return [[max(row)] * len(row) for row in union]


def pool_rows(comp) -> dict:
    """The pool and, for the full cache and each side, the bytes one prompt like
    `comp`'s takes and how many of them the pool holds."""
    pre = comp.prep.prefill
    token_bytes = 2 * pre.head_dim * pre.cache.layers[0].keys.element_size()
    L, G = pre.n_layers, pre.n_groups
    full_at = [[POOL_PROMPT_TOKENS] * G] * L
    pool = POOL_FULL_PROMPTS * prompt_bytes(full_at, ANSWER_TOKENS, FULL_PAGE, token_bytes)
    rows = []
    for key in ("full", "A", "B"):
        prep = comp.prep if key == "full" else comp.preps.get(key, comp.prep)
        extra = len(prep.prefill.question_ids or ()) + ANSWER_TOKENS
        if key == "full":
            size = prompt_bytes([[prep.n] * G] * L, extra, FULL_PAGE, token_bytes)
            label, policy = "full cache", "full"
        else:
            p = comp.plan_of(key)
            size = prompt_bytes(stored_tokens(p), extra, p.config.page_size, token_bytes)
            label, policy = comp.labels.get(key, key), p.config.policy
        rows.append({"side": key, "label": label, "policy": policy, "bytes": size,
                     "held": pool // size})  # fmt: skip
    return {"pool_bytes": pool, "prompt_tokens": comp.prep.n, "rows": rows}


def load_capacity() -> dict | None:
    """The committed benchmark (`CAPACITY_RESULTS_PATH`), or None where it is missing."""
    try:
        return json.loads(CAPACITY_RESULTS_PATH.read_text())
    except FileNotFoundError:
        return None


def measured(model: str = "bundled", data: dict | None = None) -> dict | None:
    """The benchmark's block for `model` (`results[i]`, its `sides` keyed by name), with
    the CPU and the command; None where it was not measured."""
    data = load_capacity() if data is None else data
    if data is None:
        return None
    block = next((r for r in data["results"] if r["model"] == model), None)
    if block is None:
        return None
    return block | {"cpu": data["cpu"]["model"], "command": data["command"]}


def capacity_numbers(model: str = "bundled", data: dict | None = None) -> dict:
    """The figures the lesson "What a budget buys" quotes from the benchmark: `cap_cpu`,
    `cap_prompts`, `cap_tokens`; per side (`full`, `e20`, `e10`, `cb`) the sequences held
    at once (`cap_held_*`), and for ours the decode's tokens per second (`cap_tps_*`);
    the ratios of entropy to the full cache (`cap_held_x*`, `cap_tps_x*`), and the share
    of answers correct (`cap_ok_*`)."""
    m = measured(model, data)
    if m is None:
        raise ValueError(f"the capacity benchmark has no block for {model!r}")
    s = m["sides"]
    names = {"full": "full", "e20": "entropy 20%", "e10": "entropy 10%", "cb": "transformers CB"}
    out = {"cap_cpu": m["cpu"], "cap_prompts": m["prompts"], "cap_tokens": m["prompt_tokens"][1]}
    for short, name in names.items():
        side = s[name]
        out[f"cap_held_{short}"] = side["held"]
        out[f"cap_ok_{short}"] = f"{side['correct']:.2f}"
        if side["decode_tok_s"] is not None:
            out[f"cap_tps_{short}"] = f"{side['decode_tok_s']:.1f}"
    for short in ("e20", "e10"):
        side, full = s[names[short]], s["full"]
        out[f"cap_held_x{short[1:]}"] = f"{side['held'] / full['held']:.1f}"
        out[f"cap_tps_x{short[1:]}"] = f"{side['decode_tok_s'] / full['decode_tok_s']:.1f}"
    return out
