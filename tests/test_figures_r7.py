"""The UOR chart's worst case and the stored heatmap's colour scale follow the model's r:
a small random Qwen2 decoder with 14 query heads over 2 KV heads (r = 7, the shape of
qwen-coder-0.5b's groups) under the bundled model's tokenizer, planned as the app plans
a run (`preview_comparison`, `comparison_figures`)."""

from __future__ import annotations

import pytest

from pagekv import EvictionConfig, PromptSpec
from pagekv.app.run_figures import comparison_figures
from pagekv.engine.comparison import Side, preview_comparison
from pagekv.engine.worker import ModelWorker

from .test_worker_stress import _tiny_study, tokenizer  # noqa: F401 (a fixture)


@pytest.fixture(scope="module")
def study_r7(tokenizer):  # noqa: F811
    return _tiny_study(tokenizer, ModelWorker(), n_heads=14, family="qwen2")


def test_uor_worst_case_and_stored_scale_are_r(study_r7):
    assert study_r7.loaded.group_size == 7
    spec = PromptSpec(task="needle", context=300, depth=0.5, seed=2)
    base = EvictionConfig(budget=0.3, page_size=4, window=8)
    a, b = Side(base.replace(policy="head_independent")), Side(base.replace(policy="entropy"))
    comp = preview_comparison(study_r7, spec, a, b)
    figs = comparison_figures(comp, only={"uor", "stored"})
    uor = figs["uor"]
    assert [s["y0"] for s in uor.layout.shapes] == [7]
    assert "r = 7" in uor.layout.annotations[0].text
    assert uor.layout.yaxis.range[1] == pytest.approx(7.2)
    top = max(max(t.y) for t in uor.data if t.name == "head-independent, max")
    assert 1.0 < top <= 7.0  # the union of 7 heads' picks: above 1, at most r
    assert {t.zmax for t in figs["stored"].data if t.type == "heatmap"} == {7.0}
