"""The public names and the calls outside checks make, as they call them. `import pagekv` loads the
maths only; `Runner`, `Study`, `PromptSpec` and `load_model` load on first use."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _fresh(code: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


def test_import_pagekv_loads_the_runtime_only_when_a_runtime_name_is_used():
    code = (
        "import sys, pagekv\n"
        "lazy = ('transformers', 'pagekv.engine.study', 'pagekv.runtime.runner')\n"
        "print([m in sys.modules for m in lazy])\n"
        "from pagekv import EvictionConfig, plan, Runner, Study, PromptSpec, load_model\n"
        "print([m in sys.modules for m in lazy[1:]])\n"
        "import pagekv.engine.study as s, pagekv.runtime.runner as r, pagekv.runtime.models as m\n"
        "print(Study is s.Study, Runner is r.Runner, load_model is m.load_model,"
        " PromptSpec is s.PromptSpec)\n"
    )
    assert _fresh(code).splitlines() == [
        "[False, False, False]",
        "[True, True]",
        "True True True True",
    ]


def test_unknown_names_raise_attribute_error():
    import pagekv

    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        pagekv.Nope  # noqa: B018
    assert {"Study", "Runner", "load_model", "PromptSpec", "plan"} <= set(dir(pagekv))


@pytest.mark.slow
def test_the_calls_outside_checks_make():
    from pagekv import EvictionConfig, PromptSpec, Runner, Study, load_model
    from pagekv.runtime.models import ModelLoadError

    try:
        loaded = load_model("bundled")
    except ModelLoadError as e:
        pytest.skip(f"bundled model unavailable: {e}")
    assert loaded.model is not None and loaded.tokenizer is not None
    study = Study.load("bundled")
    prep = study.prepare(PromptSpec(task="needle", context=200, depth=0.5, mode="after"))
    a = EvictionConfig(policy="mean", budget=0.5, page_size=16)
    b = a.replace(policy="entropy")
    one = study.run(prep, b)
    ra, rb = study.run_pair(prep, a, b)
    assert rb.answer == one.answer and ra.policy == "mean"
    assert isinstance(one.correct, bool) and one.timings["decode_s"] > 0
    assert one.to_dict()["answer"] == one.answer  # its JSON object (docs/schema.md)

    runner = Runner(loaded.model, loaded.tokenizer)
    ids = loaded.tokenizer("The vault code is 4417. " * 12)["input_ids"]
    question = loaded.tokenizer(" What is the vault code?")["input_ids"]
    pre = runner.prefill(ids, window_max=32, question_ids=question)
    res = runner.evaluate(pre, b, max_new_tokens=4, stop_at_eos=False)
    assert isinstance(res.answer, str) and len(res.tokens) == 4
    assert res.timings["decode_s"] > 0
