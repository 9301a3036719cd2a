"""benchmarks/load_app.py: its pieces (fast) and a tiny end-to-end run that drives the app with zero
errors and writes every field docs/performance.md quotes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmark_scripts import load

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "load_app.py"


def _load():
    return load("load_app")


def test_varied_settings_are_valid_and_varied():
    """Every varied run is valid input (its budget holds the protected pages even on a
    prompt 10% shorter than asked), and the runs differ in each setting a reader varies."""
    import app
    from pagekv.maths.paging import min_feasible_budget

    la = _load()
    runs = la.varied_settings(100)
    assert len(runs) == 100
    for kw in runs:
        assert set(kw) == set(app.RUN_DEFAULTS)
        assert 500 <= kw["context"] <= 4000
        n = int(0.9 * kw["context"])
        for s in ("", "_b"):
            budget = kw["budget_pct" if not s else "budget_b"] / 100
            need = min_feasible_budget(n, kw["page_size" + s], kw["n_sink" + s], kw["window" + s])
            assert need <= budget <= 0.6, (kw, s, need)
    for key in ("context", "seed", "mode", "mode_b", "page_size", "policy_a", "policy_b"):
        assert len({kw[key] for kw in runs}) > 1, key
    assert len({kw["budget_pct"] for kw in runs}) > 20
    assert {kw["link_b"] for kw in runs} == {True, False}
    # a negative control: a budget below the protected pages would be caught
    assert min_feasible_budget(450, 64, 4, 64) > 0.05


def test_summarize_counts_errors_and_splits_budget_moves():
    la = _load()
    ok = dict(total_s=2.0, first_s=1.0, service_s=0.5)
    records = [
        {"kind": "lesson first", "first": True, **ok, "observation": "holds"},
        {"kind": "lesson repeated", "first": False, **ok, "observation": "holds"},
        {"kind": "lesson repeated", "first": False, "error": "**Error:** x", "total_s": 1.0},
        {"kind": "budget move", "first": True, **ok},
        {"kind": "budget move", "first": False, **dict(ok, total_s=4.0)},
    ]
    s = la.summarize(records)
    assert s["lesson repeated"]["count"] == 2 and s["lesson repeated"]["errors"] == 1
    assert s["lesson repeated"]["total_s"]["p50"] == 2.0  # failed requests carry no time
    assert s["budget move"]["count"] == 2
    assert s["budget move (first)"]["count"] == s["budget move (repeated)"]["count"] == 1
    assert s["budget move"]["total_s"]["max"] == 4.0
    assert s["lesson first"]["observations"] == {"holds": 1}
    assert la.quantile([1.0, 2.0, 3.0, 4.0, 5.0], 0.5) == 3.0
    assert la.quantile([], 0.5) is None


def test_lesson_output_order():
    """The status and observation are found where `pick_lesson` puts them."""
    import app

    la = _load()
    views = [v for v in app.RUN_VIEWS if v != "last"]
    base = len(app.LESSON_CONTROLS) + 1
    out = [None] * (base + len(views) + len(app.MECH_VIEWS))
    out[base + views.index("status")] = "**Done:** ok"
    out[base + views.index("observation")] = "**Observation:** x: **holds**, checked now"
    status, obs = la._lesson_outputs_status(out)
    assert status == "**Done:** ok" and la._observation_outcome(obs) == "holds"
    with pytest.raises(RuntimeError):
        la._lesson_outputs_status(out[:-1])


@pytest.mark.slow
def test_tiny_class_runs_without_errors(tmp_path):
    out = tmp_path / "load.json"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env["GRADIO_ANALYTICS_ENABLED"] = "False"
    cmd = [
        sys.executable, str(SCRIPT), "--students", "2", "--lessons", "1", "--varied-runs", "2",
        "--contexts", "500", "--max-seconds", "120", "--varied-max-seconds", "60",
        "--stagger", "1", "--solo-budgets", "25", "--no-warm", "--out", str(out),
        "--app-log", str(tmp_path / "app.log"),
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    d = json.loads(out.read_text())
    assert proc.returncode == 0 and d["errors"] == 0, (
        d.get("solo", {}).get("error_samples"),
        d.get("class", {}).get("error_samples"),
        d.get("varied", {}).get("error_samples"),
        proc.stdout[-2000:],
    )
    solo = d["solo"]["by_kind"]
    assert {k: v["count"] for k, v in solo.items()} == {
        "solo first run": 1,
        "solo preview": 1,
        "solo budget release": 1,
    }
    kinds = d["class"]["by_kind"]
    assert kinds["lesson first"]["count"] == 1 and kinds["lesson repeated"]["count"] == 1
    assert kinds["budget move"]["count"] == 4  # 2 students x 1 live lesson x 2 moves
    assert d["class"]["skipped"] == 0 and d["varied"]["runs"] == 2
    for s in (*solo.values(), *kinds.values(), *d["varied"]["by_kind"].values()):
        for field in ("total_s", "first_s", "service_s"):
            assert set(s[field]) == {"p50", "p95", "max"}
            assert 0 <= s[field]["p50"] <= s[field]["p95"] <= s[field]["max"]
        assert s["service_s"]["max"] <= s["total_s"]["max"] + 1e-3
    assert kinds["lesson first"]["observations"] == {"holds": 1}
    m = d["memory"]
    assert 0.1 < m["peak_rss_gb"] and m["vm_hwm_gb"] >= d["varied"]["rss_after_gb"] > 0.1
    assert d["command"].endswith(" ".join(cmd[2:]))
    assert set(d["disk"]) == {"gb", "files", "what"}  # runs export nothing unless asked
    # the app was started, then stopped: its process has gone
    assert "app serving at" in proc.stdout
    assert not Path(f"/proc/{d['app_pid']}").exists()
