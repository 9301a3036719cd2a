"""Presets: the built-ins and the replay harness's format come out in one shape."""

import json

from pagekv.views.presets import BUILTIN, FIELDS, load_presets, normalize


def test_builtins_are_complete():
    presets = [normalize(p) for p in BUILTIN]
    assert all(set(p) == set(FIELDS) for p in presets)
    assert presets[0]["policy_a"] == "mean" and presets[0]["policy_b"] == "entropy"
    assert len({p["title"] for p in presets}) == len(presets)


def test_replay_format_is_mapped(tmp_path):
    entry = {
        "task": "needle", "context_tokens": 2000, "depth": 0.25, "seed": 4, "n_needles": 2,
        "name": None, "haystack": None, "needle": None, "question": None, "answer": None,
        "mode": "after", "policy": "entropy", "budget": 0.05, "page_size": 8, "n_sink": 4,
        "window": 16, "tau": 1.0, "smoothing": 1, "smoothing_kind": "max",
        "page_reduction": "max", "sink_threshold": 0.5, "title": "x", "compare_policy": "mean",
        "winner": "entropy", "observed": {},
    }  # fmt: skip
    path = tmp_path / "presets.json"
    path.write_text(json.dumps([entry, {"junk": 1}]))
    p, *rest = load_presets(path)
    assert (p["policy_a"], p["policy_b"], p["budget"], p["window"]) == ("mean", "entropy", 0.05, 16)
    assert p["n_needles"] == 2 and p["depth"] == 0.25
    assert p["title"] == (
        "Measured: 2 needles, 2000 tokens, depth 0.25, question after, 5%, page 8"
    )
    assert [r["title"] for r in rest] == [b["title"] for b in BUILTIN]  # built-ins follow
    entry["observed"] = {"entropy": {"needle_retention": 0.5}, "mean": {"needle_retention": 0.25}}
    path.write_text(json.dumps([entry]))
    assert load_presets(path)[0]["title"].endswith("(entropy keeps 0.50 of the needle, mean 0.25)")


def test_missing_or_broken_file_falls_back(tmp_path):
    assert load_presets(tmp_path / "none.json")[0]["title"] == BUILTIN[0]["title"]
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert load_presets(bad)[0]["title"] == BUILTIN[0]["title"]


def test_a_prompt_the_full_cache_gets_wrong_is_no_preset(tmp_path):
    """The replay observed the full cache answering wrongly: that prompt is left out."""
    good = {"task": "needle", "seed": 1, "policy": "entropy", "title": "x",
            "observed": {"full": {"correct": True}, "entropy": {}, "mean": {}}}  # fmt: skip
    bad = dict(good, seed=2, observed={"full": {"correct": False}})
    path = tmp_path / "presets.json"
    path.write_text(json.dumps([good, bad]))
    seeds = [p["seed"] for p in load_presets(path) if p["title"].startswith("Measured")]
    assert seeds == [1]
