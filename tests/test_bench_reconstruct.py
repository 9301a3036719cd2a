"""benchmarks/bench_reconstruct.py: the reconstruction pass timed against the prefill on
the bundled model, its rows written with the CPU they ran on."""

from __future__ import annotations

import json

from tests.benchmark_scripts import load


def test_it_times_both_and_names_the_cpu(tmp_path, capsys):
    out = tmp_path / "rec.json"
    load("bench_reconstruct").main(["--sizes", "300", "--repeats", "1", "--json", str(out)])
    got = json.loads(out.read_text())
    (row,) = got["rows"]
    assert 250 <= row["prompt_tokens"] <= 400  # a needle prompt of about 300 tokens
    assert row["prefill_s"] > 0 and row["reconstruct_s"] > 0
    assert row["ratio"] == row["reconstruct_s"] / row["prefill_s"]
    lines = open("/proc/cpuinfo").read().splitlines()
    names = [x.split(":", 1)[1].strip() for x in lines if x.startswith("model name")]
    assert got["cpu"]["model"] == names[0] and got["cpu"]["cores"] >= 1
    printed = capsys.readouterr().out
    assert got["cpu"]["model"] in printed and f"{row['ratio']:.2f}" in printed
