"""Presets: the curated ones and the replay harness's format come out in one shape, and
every preset names a difference and carries the checks that measure it (no model here;
`test_presets_bundled.py` runs them on the bundled model)."""

import json

import pytest

from pagekv.app.handlers import _preset_run_args
from pagekv.app.presets import (
    CHECK_KINDS,
    CHECKS,
    CURATED,
    FIELDS,
    KEYS,
    QWEN_CODER_PRESETS,
    SHOWS,
    load_presets,
    normalize,
    observation_of,
    preset_inputs,
    preset_matches,
)

#: A replay entry (the format `python -m pagekv replay` writes to assets/presets.json).
ENTRY = {
    "task": "needle", "context": 2000, "depth": 0.25, "seed": 4, "needles": 2,
    "curated": None, "haystack": None, "needle": None, "question": None, "answer": None,
    "mode": "after", "policy": "entropy", "budget": 0.05, "page_size": 8, "n_sink": 4,
    "window": 16, "tau": 1.0, "smoothing": 1, "smoothing_kind": "max",
    "page_reduction": "max", "sink_threshold": 0.5, "title": "x", "compare_policy": "mean",
    "winner": "entropy", "observed": {},
}  # fmt: skip


def _observed(entropy: bool, mean: bool, full: bool = True) -> dict:
    return {
        "entropy": {"correct": entropy, "needle_retention": 0.5},
        "mean": {"correct": mean, "needle_retention": 0.25},
        "full": {"correct": full},
    }


def _write(tmp_path, entries):
    path = tmp_path / "presets.json"
    path.write_text(json.dumps(entries))
    return path


def test_curated_presets_are_complete():
    presets = [normalize(p) for p in CURATED]
    assert 3 <= len(presets) <= 5
    assert all(set(p) == set(KEYS) and set(FIELDS) <= set(p) for p in presets)
    assert len({p["title"] for p in presets}) == len(presets)
    assert presets[0]["task"] == "needle"  # the app's first preset is a needle prompt


@pytest.mark.parametrize(
    "p", [normalize(e) for e in CURATED + QWEN_CODER_PRESETS], ids=lambda p: p["title"][:40]
)
def test_every_curated_preset_names_a_difference_and_checks_it(p):
    """Two different policies, both named in the title; a sentence for the page; checks
    of known kinds that build into one observation (without running anything)."""
    assert p["policy_a"] != p["policy_b"]
    assert p["policy_a"] in p["title"] and p["policy_b"] in p["title"]
    assert len(p[SHOWS]) > 80
    assert p[CHECKS] and all(c["kind"] in CHECK_KINDS for c in p[CHECKS])
    obs = observation_of(p)
    assert obs.statement and callable(obs.check)
    assert preset_matches(p, None) is False  # nothing ran yet


def test_a_preset_without_checks_is_refused():
    p = normalize({"title": "no difference"})
    assert p[CHECKS] == () and p[SHOWS] == ""
    with pytest.raises(ValueError, match="shows no difference"):
        observation_of(p)


def test_replay_format_is_mapped(tmp_path):
    entry = dict(ENTRY, observed=_observed(entropy=True, mean=False))
    p, *rest = load_presets(_write(tmp_path, [entry, {"junk": 1}]))
    assert (p["policy_a"], p["policy_b"], p["budget"], p["window"]) == ("mean", "entropy", 0.05, 16)
    assert p["needles"] == 2 and p["depth"] == 0.25
    assert p["title"] == (
        "Measured: 2 needles, 2000 tokens, depth 0.25, question after, 5%, page 8: "
        "entropy right, mean wrong (entropy keeps 0.50 of the needle, mean 0.25)"
    )
    assert p[CHECKS] == ({"kind": "answers", "full": True, "a": False, "b": True},)
    assert "entropy answered right, mean wrong" in p[SHOWS]
    curated = [c["title"] for c in CURATED + QWEN_CODER_PRESETS]
    assert [r["title"] for r in rest] == curated  # curated follow


def test_a_tie_is_no_preset(tmp_path):
    """The replay observed both policies answering alike (right or wrong), or did not
    record the answers: no difference to show, so no preset."""
    ties = [
        dict(ENTRY, seed=1, observed=_observed(entropy=False, mean=False)),
        dict(ENTRY, seed=2, observed=_observed(entropy=True, mean=True)),
        dict(ENTRY, seed=3, observed={"full": {"correct": True}, "entropy": {}, "mean": {}}),
        dict(ENTRY, seed=5),  # observed {}
    ]
    assert [p["title"] for p in load_presets(_write(tmp_path, ties))] == [
        c["title"] for c in CURATED + QWEN_CODER_PRESETS
    ]


def test_the_committed_replay_presets_are_all_ties():
    """assets/presets.json (the replay on the bundled model) holds only ties today, so
    the app offers the curated presets alone."""
    from pagekv.paths import PRESETS_PATH

    raw = json.loads(PRESETS_PATH.read_text(encoding="utf-8"))
    assert raw and all(e["winner"] == "tie" for e in raw)
    want = [c["title"] for c in CURATED + QWEN_CODER_PRESETS]
    assert [p["title"] for p in load_presets()] == want


def test_a_preset_of_another_model_runs_there_and_is_checked_only_there():
    """A qwen-coder-0.5b preset sets the model control; its verdict is given only for a
    comparison that ran on that model (not on the bundled model standing in for it)."""
    qwen = next(p for p in load_presets() if p["model"] == "qwen-coder-0.5b")
    assert _preset_run_args(qwen, model="bundled").model == "qwen-coder-0.5b"
    curated = load_presets()[0]
    assert curated["model"] is None
    assert _preset_run_args(curated, model="qwen-coder-0.5b").model == "qwen-coder-0.5b"
    spec, a, b = preset_inputs(qwen)

    class Ran:
        def __init__(self, model):
            self.model = model

        def ran(self, *args):
            return args == (spec, a, b)

    assert preset_matches(qwen, Ran("qwen-coder-0.5b"))
    assert not preset_matches(qwen, Ran("bundled"))
    assert preset_matches(curated, Ran("qwen-coder-0.5b")) is False  # other settings
    assert preset_matches(dict(qwen, model=None), Ran("bundled"))


def test_missing_or_broken_file_falls_back(tmp_path):
    assert load_presets(tmp_path / "none.json")[0]["title"] == CURATED[0]["title"]
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert load_presets(bad)[0]["title"] == CURATED[0]["title"]


def test_a_prompt_the_full_cache_gets_wrong_is_no_preset(tmp_path):
    """The replay observed the full cache answering wrongly: that prompt is left out."""
    good = dict(ENTRY, seed=1, observed=_observed(entropy=True, mean=False))
    bad = dict(ENTRY, seed=2, observed=_observed(entropy=True, mean=False, full=False))
    seeds = [
        p["seed"] for p in load_presets(_write(tmp_path, [good, bad]))
        if p["title"].startswith("Measured")
    ]  # fmt: skip
    assert seeds == [1]
