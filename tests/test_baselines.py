"""The full cache answers every curated task and preset on the bundled model (a policy comparison
means something only where it does).

Both question modes decode the same tokens with the full cache, so each task runs in its
strictest listed mode and `test_full_cache_is_mode_independent` checks one task in both;
`PAGEKV_BASELINES_ALL_MODES=1` checks every mode. One module `Study` is shared."""

from __future__ import annotations

import os

import pytest

from pagekv.app.presets import load_presets
from pagekv.tasks import QUESTION_POSITIONS, default_max_new_tokens, load_tasks

ALL_MODES = os.environ.get("PAGEKV_BASELINES_ALL_MODES", "") not in ("", "0")


def _checked_modes(task) -> list[str]:
    modes = task.meta["modes"]
    if ALL_MODES:
        return list(modes)
    return ["after"] if "after" in modes else [modes[0]]


TASK_CASES = [
    pytest.param(task.kind, task.name, mode, id=f"{task.name}-{mode}")
    for task in load_tasks()
    for mode in _checked_modes(task)
]


def _preset_param(p: dict):
    return pytest.param(p, id=p["title"][:60])


#: Presets run on the bundled model (the others are checked on their own model,
#: tests/test_qwen_coder.py).
PRESET_CASES = [_preset_param(p) for p in load_presets() if p["model"] is None]


@pytest.fixture(scope="module")
def study(bundled_study):
    return bundled_study


@pytest.fixture(scope="module")
def tokenizer():
    """The bundled tokenizer alone: the converted cache's copy when it is valid
    (about a second), else the GGUF's own (several seconds)."""
    from pagekv.runtime import models

    transformers = pytest.importorskip("transformers")
    try:
        if models.cache_problem() is None:
            return transformers.AutoTokenizer.from_pretrained(str(models.bundled_cache_dir()))
        path = models.bundled_gguf_path()
    except models.ModelLoadError as e:
        pytest.skip(f"bundled model unavailable: {e}")
    pytest.importorskip("gguf")
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def _full(study, spec) -> tuple:
    """The full cache's record for `spec`, decoding the task's own number of tokens
    (`Study.run_full` memoises it, so a later test on the same prompt reuses it)."""
    prep = study.prepare(spec)
    m = default_max_new_tokens(prep.task)
    return study.run_full(prep, max_new_tokens=m), m


def _why(label: str, out, max_new_tokens: int) -> str:
    return (
        f"{label}: the full cache answered {out.answer!r}, expected {out.expected!r} "
        f"(stopped by {out.stop_reason} after {len(out.tokens)} of {max_new_tokens} tokens)"
    )


def test_every_task_has_enough_new_tokens_and_modes(tokenizer):
    for task in load_tasks():
        n_answer = len(tokenizer(task.answer, add_special_tokens=False)["input_ids"])
        m = default_max_new_tokens(task)
        assert task.max_new_tokens == m, f"{task.name}: no max_new_tokens of its own"
        assert m >= n_answer + 2, f"{task.name}: max_new_tokens {m} < {n_answer} answer tokens + 2"
        modes = task.meta["modes"]
        assert modes and set(modes) <= set(QUESTION_POSITIONS), f"{task.name}: modes {modes}"


@pytest.mark.slow
@pytest.mark.parametrize("kind, name, mode", TASK_CASES)
def test_full_cache_answers_curated_task(study, kind, name, mode):
    from pagekv.engine.study import PromptSpec

    spec = PromptSpec(task=kind, curated=name, mode=mode)
    out, m = _full(study, spec)
    assert out.correct, _why(f"task {name} (question {mode})", out, m)


@pytest.mark.slow
def test_full_cache_is_mode_independent(study):
    """Question inside or after: the same tokens in, so the same answer out. On the
    last task of the set, whose "after" record the test above has just memoised."""
    from pagekv.engine.study import PromptSpec

    task = load_tasks()[-1]
    assert set(task.meta["modes"]) == set(QUESTION_POSITIONS), "pick a task meant for both"
    after, m = _full(study, PromptSpec(task=task.kind, curated=task.name, mode="after"))
    inside, _ = _full(study, PromptSpec(task=task.kind, curated=task.name, mode="inside"))
    assert inside.tokens == after.tokens, (
        f"task {task.name}: inside {inside.answer!r}, after {after.answer!r}"
    )
    assert inside.correct, _why(f"task {task.name} (question inside)", inside, m)


@pytest.mark.slow
@pytest.mark.parametrize("preset", PRESET_CASES)
def test_full_cache_answers_preset(study, preset):
    """The preset's prompt as the app builds it (`app._spec`), with the full cache."""
    from pagekv.engine.study import PromptSpec

    kw = dict(
        task=preset["task"],
        context=int(preset["context"]),
        depth=float(preset["depth"]),
        seed=int(preset["seed"]),
        needles=int(preset["needles"]),
        mode=preset["mode"],
    )
    if preset["task"] in ("qa", "code"):
        kw["curated"] = preset["curated"] or None
    spec = PromptSpec(**kw)
    out, m = _full(study, spec)
    assert out.correct, _why(f"preset {preset['title']!r} ({out.task})", out, m)
