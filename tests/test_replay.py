"""The replication harness (`experiments.replay`): store, peer adapter, and a --quick run whose
invariants hold: pooled UOR 1, the r = 2 identity, the bounds, exact cardinality, files written,
and a second run computing nothing."""

from __future__ import annotations

import json

import pytest
import torch

from experiments.replay import run_replay
from experiments.replay.measure import POOLED_CHECKED, overlap_measurements
from experiments.replay.peer import PeerAdapter
from experiments.replay.store import UnitStore, unit_key
from pagekv import EvictionConfig
from pagekv.runtime import models
from pagekv.runtime.runner import Runner
from tests.test_runner import prompt, tiny_model


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
        if name == "experiments.peer.kvpress_peer":
            raise ImportError("no bridge here")
        return real(name, *a, **k)

    monkeypatch.setattr(importlib, "import_module", fail)
    ad = PeerAdapter(enabled=True, quick=False)
    st = ad.status()
    assert st["available"] is False and "no bridge here" in st["reason"]
    assert ad.run([{"id": "x"}]) == [{"id": "x", "error": st["reason"]}]


@pytest.fixture(scope="module")
def tiny():
    """A random r = 4 decoder (3 layers, 2 groups) and an 83-token prefill."""
    runner = Runner(tiny_model("llama"))
    return runner, runner.prefill(prompt(83), window_max=8)


#: n = 83, pages of 4 (the last holds 3), k = floor(0.4 * 83) = 33. Protected: page 0
#: (sinks 0, 1) and the window 75..82 (pages 18, 19, 20: 4 + 4 + 3) = 15 tokens; the 18
#: left admit four more whole pages: every pooled policy keeps 31 per (layer, group).
T1_CFG = EvictionConfig(budget=0.4, page_size=4, window=8, n_sink=2)
T1_KEPT = 31


def test_pooled_uor_is_measured_on_the_decode_cache(tiny):
    runner, pre = tiny
    m = overlap_measurements(runner, pre, T1_CFG)
    assert m["feasible"] and m["k"] == 33
    assert set(m["pooled"]) == set(POOLED_CHECKED)
    for pol, pm in m["pooled"].items():
        assert pm["uor_min"] == pm["uor_max"] == 1.0, pol
        assert pm["stored_eq_plan"] and pm["dense"] and pm["within_budget"], pol
        assert pm["kept"] == T1_KEPT, pol


def _miscompact(kind):
    """A `Runner.decode_cache` whose cache is wrong in layer 1 (kind): every group one
    token more or less than planned, or group 0's sixth row an evicted token's key."""
    real = Runner.decode_cache

    def decode_cache(self, evs, pre, max_new):
        ev = evs[0]
        idx = ev.kept_indices[1]
        if kind == "one_extra":  # a padded / duplicated row: one token more than planned
            ev.kept_indices[1] = torch.cat([idx, idx[:, -1:]], 1)
            ev.stored_tokens[1] = [s + 1 for s in ev.stored_tokens[1]]
        elif kind == "one_missing":
            ev.kept_indices[1] = idx[:, :-1]
            ev.stored_tokens[1] = [s - 1 for s in ev.stored_tokens[1]]
        cache = real(self, evs, pre, max_new)
        if kind == "wrong_token":  # the right count, one row from an evicted token
            t = int(ev.plan.keep[1, 0].logical_not().nonzero()[0])
            cache.read(1, 0, 0)[0][5] = pre.cache.layers[1].keys[0, 0, t]
        return cache

    return decode_cache


@pytest.mark.parametrize(
    "kind, uor_min, uor_max",
    [
        ("one_extra", 1.0, (T1_KEPT + 1) / T1_KEPT),
        ("one_missing", (T1_KEPT - 1) / T1_KEPT, 1.0),
        ("wrong_token", 1.0, 1.0),
    ],
)
def test_pooled_uor_sees_an_eviction_bug(tiny, monkeypatch, kind, uor_min, uor_max):
    """Negative control: the measurement reads the decode cache, not the plan."""
    runner, pre = tiny
    monkeypatch.setattr(Runner, "decode_cache", _miscompact(kind))
    m = overlap_measurements(runner, pre, T1_CFG)
    for pol, pm in m["pooled"].items():
        assert (pm["uor_min"], pm["uor_max"]) == pytest.approx((uor_min, uor_max)), pol
        assert not pm["stored_eq_plan"], pol


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    try:
        models.load_model("bundled")
    except models.ModelLoadError as e:
        pytest.skip(f"bundled model unavailable: {e}")

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
    # Pooled UOR was measured on compacted caches that store exactly the planned rows.
    units = [json.loads(line) for line in (out / "units.jsonl").read_text().splitlines()]
    profiles = [u["data"] for u in units if json.loads(u["key"])["unit"] == "profile"]
    cells = [m for u in profiles for m in u["t1"].values() if m["feasible"]]
    assert cells and all(set(m["pooled"]) == set(POOLED_CHECKED) for m in cells)
    for m in cells:
        for pol, pm in m["pooled"].items():
            assert pm["stored_eq_plan"] and pm["uor_min"] == pm["uor_max"] == 1.0, pol
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
    # QUICK also decodes the question-agnostic setting beside the window scorer.
    got = {(r["budget"], r["scoring"]) for r in tabs["T4_recall"] if r["policy"] == "entropy"}
    assert got == {(b, s) for b in (0.2, 0.5) for s in ("window/uniform", "reconstruct/global, w8")}
    # Stored tokens: a uniform pooled plan stores its pages exactly; a global one keeps
    # L G k tokens of pages at most, its dense layers padded to their longest group.
    for u in units:
        key = json.loads(u["key"])
        if key["unit"] != "decode" or key["config"]["policy"] == "full":
            continue
        d, c = u["data"], key["config"]
        assert d["feasible"] and d["page_tokens"] <= 30 * 3 * d["k"], c
        # A paged cache of 16-token pages: the kept pages whole (a short last page too).
        P = c["page_size"]
        if P == 16:
            assert d["page_tokens"] <= d["physical_tokens"] < d["page_tokens"] + 16 * 90, c
            assert d["physical_tokens"] % 16 == 0, c
        if c["allocation"] == "uniform":
            assert d["stored_tokens"] == d["page_tokens"], c
        else:
            assert d["stored_tokens"] >= d["page_tokens"], c
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
        assert {"task", "context", "mode", "policy", "budget", "page_size"} <= set(p)
        assert {"entropy", "mean"} <= set(p["observed"])


@pytest.mark.slow
def test_quick_replay_is_resumable(quick_run):
    _, first, second = quick_run
    assert first["meta"]["units"]["computed"] > 0
    assert second["meta"]["units"]["computed"] == 0
    assert second["meta"]["units"]["reused"] == first["meta"]["units"]["computed"]
    assert second["tables"]["T1_uor"] == first["tables"]["T1_uor"]
    assert second["headline"] == first["headline"]
