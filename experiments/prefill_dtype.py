"""Would a bfloat16 prefill keep the answers? The bundled model's prefill in float32
(what the runner does) against the same forward with bfloat16 weights.

Usage: python experiments/prefill_dtype.py [--json PATH]

On the bundled model, the cases of `experiments/decode_agreement.py` (every curated
task in its question modes, the needle prompts of 1k, 2k and 4k tokens in both modes;
the full cache, entropy at 20 % and at 50 %, pages of 16), each prefilled twice: by the
runner (float32) and by a copy of the model in bfloat16, whose cache, window queries
and first logits are then cast to float32. Everything after the prefill (scoring,
planning, the decode with the runner's default step) is the same code on the same
float32 model. Prints per case whether the answer tokens are identical and whether
each answer is right, each prompt's two prefill times, then the counts and the CPU.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from experiments.decode_agreement import case_rows, counts, specs  # noqa: E402
from pagekv import Runner  # noqa: E402
from pagekv.engine.study import Study  # noqa: E402
from pagekv.runtime.machine import cpu_facts  # noqa: E402
from pagekv.runtime.models import load_model  # noqa: E402


def prefill_in(runner: Runner, dtype: torch.dtype):
    """A `prefill` with the signature of `runner.prefill` that runs the forward on a
    copy of `runner.model` in `dtype`, then hands back a `Prefill` whose tensors are
    float32, as the runner's own (its `timings["prefill_s"]` is the `dtype` forward's)."""
    other = Runner(copy.deepcopy(runner.model).to(dtype), runner.tokenizer)

    def prefill(input_ids, window_max: int = 128, question_ids=None):
        pre = other.prefill(input_ids, window_max=window_max, question_ids=question_ids)
        for layer in pre.cache.layers:
            layer.keys, layer.values = layer.keys.float(), layer.values.float()
        return dataclasses.replace(pre, q_win=pre.q_win.float(), backend=runner.backend)

    return prefill


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = ap.parse_args(argv)
    loaded = load_model("bundled")
    base = Study(loaded)
    half = Study(loaded)
    half.runner.prefill = prefill_in(half.runner, torch.bfloat16)
    rows, prefills = [], []
    t0 = time.perf_counter()
    for spec in specs():
        a_prep, b_prep = base.prepare(spec), half.prepare(spec)
        assert a_prep.prefill.ids == b_prep.prefill.ids
        seconds = [p.prefill.timings["prefill_s"] for p in (a_prep, b_prep)]
        prefills.append({"n": a_prep.n, "float32_s": seconds[0], "bfloat16_s": seconds[1]})
        print(f"prefill {a_prep.n} tokens: float32 {seconds[0]:.2f} s, bfloat16 {seconds[1]:.2f} s")
        rows += case_rows(spec, (base, half), (a_prep, b_prep), "bfloat16", "bf16")
    f32, bf16 = (sum(p[k] for p in prefills) for k in ("float32_s", "bfloat16_s"))
    cpu = cpu_facts()
    print(
        f"\n{counts(rows, 'bfloat16')}; prefills {f32:.1f} s in float32, {bf16:.1f} s in "
        f"bfloat16 ({f32 / bf16:.2f}x); {time.perf_counter() - t0:.0f} s on {cpu['model']} "
        f"({', '.join(cpu['flags'])})"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu, "prefills": prefills, "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
