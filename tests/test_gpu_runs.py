"""The GPU figures docs/app.md and docs/performance.md quote are those of the run in
docs/perf_gpu.json (what `benchmarks/gpu_check.py` wrote on an H200) and of the launch
sweep in docs/tune_score.json: a quoted figure that drifts from its file fails here."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PERF = (ROOT / "docs" / "performance.md").read_text()
GUIDE = " ".join((ROOT / "docs" / "app.md").read_text().split())  # lines joined


def _run() -> dict:
    return json.loads((ROOT / "docs" / "perf_gpu.json").read_text())


def test_the_quoted_end_to_end_rows_are_the_run_s():
    run = _run()
    for r in run["end_to_end"]["runs"]:
        row = (
            f"| {r['n']:,} | {r['prefill_s']:.3f} s | {1e3 * r['evict_step_s']:.2f} ms "
            f"({1e3 * r['score_s']:.2f} ms) | {100 * r['evict_frac_of_prefill']:.2f} % | "
            f"{r['decode_tok_s_full']:.1f} / {r['decode_tok_s_evicted']:.1f} | "
            f"{r['decode_tok_s_first_full']:.1f} / {r['decode_tok_s_first_evicted']:.1f} | "
            f"{r['generate_tok_s']:.1f} | {r['decode_over_generate_full']:.1f}x / "
            f"{r['decode_over_generate_evicted']:.1f}x |"
        )
        assert row in PERF, row
        assert r["decode_tok_s_evicted"] > r["decode_tok_s_full"]  # as both pages say
    assert run["verdict"]["passed"] is False and "**FAILED**" in PERF
    bench = run["bench_kernels"]["summary"]
    assert (
        "| score, Triton ms | " + " | ".join(f"{s['score_triton_ms']:.3f}" for s in bench) in PERF
    )
    assert f"**{100 * bench[-1]['score_frac_of_bound']:.1f} %**" in PERF


def test_the_app_guide_quotes_the_run():
    run = _run()
    cuda = sum(run[s]["cuda"]["passed"] for s in ("runner_tests", "kernel_tests"))
    assert run["runner_tests"]["failed"] == run["kernel_tests"]["failed"] == 0
    rows = run["end_to_end"]["runs"]
    ratios = [r[f"decode_over_generate_{k}"] for r in rows for k in ("full", "evicted")]
    tok_s = [r[f"decode_tok_s_{k}"] for r in rows for k in ("full", "evicted")]
    big = rows[-1]
    for quoted in (
        f"({cuda} in all",
        f"at {min(ratios):.0f}-{max(ratios):.0f}x transformers' `generate`",
        f"({min(tok_s):.0f}-{max(tok_s):.0f} tokens/s)",
        f"took {100 * big['evict_frac_of_prefill']:.2f} % of the prefill at 32k",
    ):
        assert quoted in GUIDE, quoted


def test_the_quoted_sweep_figures_are_the_sweeps():
    rows = json.loads((ROOT / "docs" / "tune_score.json").read_text())["rows"]
    timed = [r for r in rows if "131072" in r["ms"]]
    best = min(timed, key=lambda r: r["ms"]["131072"])
    assert (best["option"], best["tiles_per_prog"]) == ("N64 w8 s33", 16)
    assert f"3 stages took {best['ms']['131072']:.2f} ms ({best['ms']['32768']:.2f} ms" in PERF
    one = next(r for r in timed if r["option"] == "N64 w8 s22" and r["tiles_per_prog"] == 1)
    assert f"took {one['ms']['131072']:.2f} ms at 128k" in PERF
    worst = max(max(r["err"].values()) for r in timed)
    assert f"(largest difference {worst:.1e})" in PERF and worst < 1e-9
