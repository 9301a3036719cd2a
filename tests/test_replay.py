"""The replication harness (`pagekv.replay`): store, peer adapter, and a --quick run.

The quick run loads the bundled model and decodes on the CPU (slow marker); it checks
the outputs' structure and the invariants every run must satisfy: pooled UOR exactly
1, the r = 2 identity on every pair and the bounds never violated, exact cardinality,
files written, and resumability (a second run computes nothing).
"""

from __future__ import annotations

import json

import pytest

from pagekv.replay.peer import PeerAdapter
from pagekv.replay.store import UnitStore, unit_key


def test_store_resumes_and_skips_a_cut_line(tmp_path):
    s = UnitStore(tmp_path)
    k1 = unit_key(unit="a", x=1)
    s.put(k1, {"v": 1.0, "bad": float("nan")})
    with s.path.open("a") as f:
        f.write('{"key": "cut sho')  # an interrupted write
    s2 = UnitStore(tmp_path)
    assert k1 in s2 and s2.loaded == 1
    assert s2.get(k1) == {"v": 1.0, "bad": None}
    assert s2.stats() == {"loaded": 1, "computed": 0, "reused": 1}


def test_unit_key_is_canonical():
    assert unit_key(b=1, a=[1, 2]) == unit_key(a=[1, 2], b=1)


def test_peer_adapter_records_why_it_is_unavailable(monkeypatch):
    off = PeerAdapter(enabled=False, quick=True)
    assert off.status() == {"available": False, "reason": "disabled (--no-peer)", "presses": []}
    import importlib

    real = importlib.import_module

    def fail(name, *a, **k):
        if name == "pagekv.peer.kvpress_peer":
            raise ImportError("no bridge here")
        return real(name, *a, **k)

    monkeypatch.setattr(importlib, "import_module", fail)
    ad = PeerAdapter(enabled=True, quick=False)
    st = ad.status()
    assert st["available"] is False and "no bridge here" in st["reason"]
    assert ad.run([{"id": "x"}]) == [{"id": "x", "error": st["reason"]}]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    models = pytest.importorskip("pagekv.models")
    try:
        models.load_model("bundled")
    except models.ModelLoadError as e:
        pytest.skip(f"bundled model unavailable: {e}")
    from pagekv.replay import run_replay

    out = tmp_path_factory.mktemp("replay")
    first = run_replay(model="bundled", out=out, quick=True, peer=False)
    second = run_replay(model="bundled", out=out, quick=True, peer=False)
    return out, first, second


@pytest.mark.slow
def test_quick_replay_files_and_invariants(quick_run):
    out, res, _ = quick_run
    for name in ("results.json", "presets.json", "tables.md", "units.jsonl", "T1_uor.csv"):
        assert (out / name).exists(), name
    on_disk = json.loads((out / "results.json").read_text())
    assert on_disk["meta"]["grid"] == "quick"
    assert on_disk["peer"]["available"] is False and on_disk["peer"]["reason"]
    assert any(f.endswith(".html") for v in on_disk["figures"].values() for f in v if "/" in f)
    tabs = on_disk["tables"]
    # T1: every feasible cell measured every (layer, group) of every prompt; pooled UOR == 1.
    t1 = [r for r in tabs["T1_uor"] if r["measurements"]]
    assert t1
    for r in t1:
        assert r["measurements"] == r["feasible_prompts"] * 30 * 3
        assert r["pooled_uor_min"] == 1.0 and r["pooled_uor_max"] == 1.0
        assert r["pooled_dense_and_within_budget"]
        assert 1.0 <= r["uor_mean"] <= r["uor_max"] <= 3.0
    for r in tabs["T1_uor"]:  # infeasible cells say what budget would be feasible
        if r["infeasible_prompts"]:
            assert r["smallest_feasible_budget_max"] > r["budget"]
    # T2: the r = 2 identity on every pair and the two-sided bounds.
    for r in tabs["T2_bounds"]:
        if r["measurements"]:
            assert r["pair_identity_max_abs_err"] < 1e-12
            assert r["lower_bound_violations"] == 0 and r["upper_bound_violations"] == 0
            assert r["lower_slack_min"] > -1e-12 and r["upper_slack_min"] > -1e-12
    # T3: one row per layer.
    assert len(tabs["T3_sinks_per_layer"]) == 30
    # T4: every policy decoded; the full cache is the reference.
    assert {r["policy"] for r in tabs["T4_recall"]} >= {"entropy", "mean", "full"}
    assert tabs["T4_cache"]
    # T5: exact cardinality wherever feasible, every page size present.
    t5 = tabs["T5_cardinality"]
    assert {r["page_size"] for r in t5} == {1, 2, 4, 8, 16, 32, 64}
    assert all(r["exact"] for r in t5 if r["feasible"])
    assert res["headline"]["cardinality_exact"] is True
    assert res["headline"]["pooled_uor_exactly_1"] is True
    # T7 and the presets the app loads.
    assert tabs["T7_answers"] and tabs["T7_cache"]
    presets = json.loads((out / "presets.json").read_text())
    assert presets
    for p in presets:
        assert {"task", "context_tokens", "mode", "policy", "budget", "page_size"} <= set(p)
        assert {"entropy", "mean"} <= set(p["observed"])


@pytest.mark.slow
def test_quick_replay_is_resumable(quick_run):
    _, first, second = quick_run
    assert first["meta"]["units"]["computed"] > 0
    assert second["meta"]["units"]["computed"] == 0
    assert second["meta"]["units"]["reused"] == first["meta"]["units"]["computed"]
    assert second["tables"]["T1_uor"] == first["tables"]["T1_uor"]
    assert second["headline"] == first["headline"]
