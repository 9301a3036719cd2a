"""The GPU figures docs/app.md and docs/performance.md quote are those of the runs in
docs/gpu_runs/ (what `benchmarks/gpu_check.py` wrote on an H200) and of the launch sweep
in docs/tune_score.json: a quoted figure that drifts from its file fails here."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "docs" / "gpu_runs"


def _run(i: int) -> dict:
    return json.loads((RUNS / f"2026-12-04-run{i}.json").read_text())


def test_the_quoted_end_to_end_figures_are_run_1s():
    perf = (ROOT / "docs" / "performance.md").read_text()
    readme = (ROOT / "docs" / "app.md").read_text()
    runs = {r["n"]: r for r in _run(1)["end_to_end"]["runs"]}
    big = runs[32768]
    step = f"{100 * big['evict_frac_of_prefill']:.2f} %"
    assert step == "1.58 %" and f"**{step}**" in perf and f"({step} in run 1)" in readme
    assert f"{1e3 * big['evict_step_s']:.2f} ms ({1e3 * big['score_s']:.2f} ms)" in perf
    bench = {s["n"]: s for s in _run(1)["bench_kernels"]["summary"]}
    ratio = big["score_s"] * 1e3 / bench[32768]["score_triton_ms"]
    assert f"is {ratio:.2f}x `bench_kernels`' {bench[32768]['score_triton_ms']:.3f} ms" in perf
    for n, label in ((4096, "4k"), (32768, "32k"), (131072, "128k")):
        row = f"| {label} | {bench[n]['score_triton_ms']:.3f} ("
        assert row in perf, row


def test_the_quoted_decode_runs_are_runs_4_to_6():
    """The table of runs 4-6 in docs/performance.md, row by row from the JSON files, and
    docs/perf_gpu.json is run 5; runs 4 and 5 passed every test, and only run 4's
    verdict is PASSED."""
    perf = (ROOT / "docs" / "performance.md").read_text()
    assert json.loads((ROOT / "docs" / "perf_gpu.json").read_text()) == _run(5)
    for i in (4, 5, 6):
        for r in _run(i)["end_to_end"]["runs"]:
            if i == 6 and r["n"] != 32768:
                continue
            first = (
                f"{r['decode_tok_s_first_full']:.1f} / {r['decode_tok_s_first_evicted']:.1f}"
                if i > 4
                else "(each decode captures)"
            )
            row = (
                f"| {i} | {r['n']:,} | {r['prefill_s']:.3f} s | {1e3 * r['evict_step_s']:.2f} ms "
                f"({1e3 * r['score_s']:.2f} ms) | "
            )
            assert row in perf, row
            tail = (
                f"| {r['decode_tok_s_full']:.1f} / {r['decode_tok_s_evicted']:.1f} | {first} | "
                f"{r['generate_tok_s']:.1f} | {r['decode_over_generate_full']:.1f}x / "
                f"{r['decode_over_generate_evicted']:.1f}x |"
            )
            assert tail in perf, tail
            assert r["decode_tok_s_evicted"] > r["decode_tok_s_full"]  # as the text says
            assert "CUDA graph" in r["decode_path"]
    for i in (4, 5):
        assert _run(i)["runner_tests"]["failed"] == _run(i)["kernel_tests"]["failed"] == 0
    # The app guide's sentence on them.
    readme = (ROOT / "docs" / "app.md").read_text()
    cuda = sum(_run(4)[s]["cuda"]["passed"] for s in ("runner_tests", "kernel_tests"))
    runs = {i: {r["n"]: r for r in _run(i)["end_to_end"]["runs"]} for i in (4, 5, 6)}
    step = f"{100 * runs[4][32768]['evict_frac_of_prefill']:.2f} %"
    later = sorted(f"{100 * runs[i][32768]['evict_frac_of_prefill']:.1f}" for i in (5, 6))
    ratios = [
        r[f"decode_over_generate_{k}"]
        for i in runs
        for r in runs[i].values()
        for k in ("full", "evicted")
    ]
    reused = [
        r[f"decode_tok_s_{k}"]
        for i in (5, 6)
        for r in runs[i].values()
        for k in ("full", "evicted")
    ]
    for quoted in (
        f"{cuda} in all", f"took {step} of the prefill at 32k", f"but {later[0]}-{later[1]} %",
        f"at {min(ratios):.0f}-{max(ratios):.0f}x transformers' `generate`",
        f"({min(reused):.0f}-{max(reused):.0f} tokens/s once a",
    ):  # fmt: skip
        assert quoted in readme, quoted
    assert [_run(i)["verdict"]["passed"] for i in (4, 5, 6)] == [True, False, False]


def test_run_3_is_quoted_as_it_went():
    """Run 3, the committed code: no test failed, and its verdict is FAILED (for what
    it did not reach), as docs/performance.md says."""
    run = _run(3)
    assert run["runner_tests"]["cuda"] == {"passed": 33, "failed": 0, "errors": 0, "skipped": 0}
    assert run["kernel_tests"]["cuda"]["passed"] == 89 and run["kernel_tests"]["failed"] == 0
    assert run["verdict"]["passed"] is False
    assert not any("failed" in f and "0 failed" not in f for f in run["verdict"]["failures"])


def test_the_quoted_sweep_figures_are_the_sweeps():
    perf = (ROOT / "docs" / "performance.md").read_text()
    rows = json.loads((ROOT / "docs" / "tune_score.json").read_text())["rows"]
    timed = [r for r in rows if "131072" in r["ms"]]
    best = min(timed, key=lambda r: r["ms"]["131072"])
    assert (best["option"], best["tiles_per_prog"]) == ("N64 w8 s33", 16)
    assert f"with 3 stages {best['ms']['131072']:.2f} ms ({best['ms']['32768']:.2f} ms" in perf
    one = next(r for r in timed if r["option"] == "N64 w8 s22" and r["tiles_per_prog"] == 1)
    assert f"took {one['ms']['131072']:.2f} ms at 128k" in perf
    worst = max(max(r["err"].values()) for r in timed)
    assert f"(largest difference {worst:.1e})" in perf and worst < 1e-9
