"""qwen-coder-0.5b (Qwen2.5-Coder-0.5B-Instruct, r = 7) on its real weights. Opt-in
(`PAGEKV_TEST_QWEN=1`, after `bash scripts/setup.sh --models`): opted in, a missing model fails."""

from __future__ import annotations

import json
import os

import pytest

from pagekv.app.lessons import get_lesson, run_lesson
from pagekv.app.presets import check_preset, compare_preset, load_presets, preset_matches
from pagekv.engine.study import PromptSpec, Study
from pagekv.runtime.models import QWEN_CODER, ModelLoadError, bundled_cache_dir

OPT_IN = "PAGEKV_TEST_QWEN"
QWEN_PRESETS = [p for p in load_presets() if p["model"] == QWEN_CODER]
pytestmark = pytest.mark.skipif(
    os.environ.get(OPT_IN) != "1",
    reason=f"opt-in: {OPT_IN}=1 runs the qwen-coder-0.5b tests "
    "(install the model with bash scripts/setup.sh --models)",
)


@pytest.fixture(scope="module")
def qwen() -> Study:
    try:
        return Study.load(QWEN_CODER, allow_fallback=False)
    except ModelLoadError as e:  # opted in: a missing model is a failure, not a skip
        pytest.fail(f"{OPT_IN}=1 but qwen-coder-0.5b does not load: {e}")


def test_facts_of_the_model(qwen):
    lm = qwen.loaded
    assert (lm.name, lm.n_layers, lm.n_heads, lm.n_kv_heads, lm.group_size) == (
        QWEN_CODER, 24, 14, 2, 7
    )  # fmt: skip
    assert lm.source in ("cache", "gguf") and "registry parts" in lm.origin and not lm.caveat
    manifest = json.loads((bundled_cache_dir(QWEN_CODER) / "manifest.json").read_text())
    assert (manifest["source_file"], manifest["source_size"]) == (
        "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf", 491_400_064
    )  # fmt: skip


@pytest.mark.parametrize("mode", ["inside", "after"])
def test_full_cache_finds_the_needle(qwen, mode):
    prep = qwen.prepare(PromptSpec(task="needle", context=1000, depth=0.5, mode=mode))
    rec = qwen.run_full(prep)
    assert rec.correct, rec.answer


@pytest.mark.parametrize("lesson_id", ["gqa-cost", "sink-masquerade"])
def test_lessons_1_and_3_hold_on_this_model(qwen, lesson_id):
    """The figures README.md reports for lessons 1 and 3 on qwen-coder-0.5b."""
    run = run_lesson(qwen, get_lesson(lesson_id))
    assert run.verdict.holds, run.verdict.measured
    v = run.verdict.values
    if lesson_id == "gqa-cost":
        assert v["r"] == 7 and 2.0 <= v["max_ratio"] <= 7.0
    else:
        assert v["raw"] >= 2.0 > 1.5 > v["isolated"]


@pytest.mark.parametrize("preset", QWEN_PRESETS, ids=[p["title"][:50] for p in QWEN_PRESETS])
def test_the_models_presets_show_their_difference(qwen, preset):
    """Each qwen-coder-0.5b preset, run as the app's preset picker runs it, on this model:
    the verdicts its title names (one where mean wins, one where entropy wins)."""
    comp = compare_preset(qwen, preset)
    assert preset_matches(preset, comp)
    found = check_preset(preset, comp)
    assert found.holds, found.measured
