"""Models by name (`pagekv.app.model_registry`): a model that is not installed is said at
once, without asking the hub, and the run goes on with the default model, which the
model box then shows."""

from __future__ import annotations

import dataclasses

import pytest

from pagekv.app import handlers
from pagekv.app.model_registry import ModelRegistry
from pagekv.runtime import models

from .test_handlers import SHORT

STATUS = handlers.RUN_VIEWS.index("status")


@pytest.fixture
def qwen_missing(monkeypatch, tmp_path):
    """qwen-coder-0.5b neither installed nor converted; the hub, if asked, fails loudly."""
    spec = models.BUNDLED_MODELS["qwen-coder-0.5b"]
    parts = dataclasses.replace(spec.parts, packages=("pagekv_no_such_part_1",))
    absent = dataclasses.replace(spec, parts=parts, cache_name="pagekv-test-not-converted")
    monkeypatch.setitem(models.BUNDLED_MODELS, "qwen-coder-0.5b", absent)
    asked = []

    def hub(*args, **kwargs):
        asked.append(args[0])
        raise models.ModelLoadError("the hub was asked")

    monkeypatch.setattr(models, "_load_hub", hub)
    return asked


def test_a_model_not_installed_is_said_at_once_without_the_hub(qwen_missing, bundled_study):
    """Without the hub a missing install is said at once and the default serves."""
    from pagekv.engine.study import Study

    def factory(name):
        if name == "bundled":
            return bundled_study
        return Study(models.load_model(name, device="cpu", hub_copy=registry.allow_hub))

    registry = ModelRegistry(factory=factory)
    why = registry.unavailable("qwen-coder-0.5b")
    assert why is not None and "setup.sh --models" in why, why
    study = registry.get("qwen-coder-0.5b")
    assert study.loaded.fell_back and study.loaded.name == "bundled"
    assert qwen_missing == []  # no hub attempt
    assert registry.serving("qwen-coder-0.5b") == "bundled"
    assert registry.serving("bundled") == "bundled"
    hub = ModelRegistry(factory=factory, allow_hub=True)
    registry = hub
    assert hub.unavailable("qwen-coder-0.5b") is None  # the hub copy may serve it
    assert hub.get("qwen-coder-0.5b").loaded.fell_back
    assert qwen_missing == ["Qwen/Qwen2.5-Coder-0.5B-Instruct"], qwen_missing


@pytest.mark.slow
def test_the_run_does_not_say_loading_for_a_model_that_cannot_load(
    qwen_missing, monkeypatch, bundled_study
):
    """The app's run: no 'Loading the model' line for a model that is not installed; it
    runs on the default model, says why, and the model box goes back to it."""
    from pagekv.engine.study import Study

    def factory(name):  # as the app's: no hub copy without hub models
        if name == "bundled":
            return bundled_study
        return Study(models.load_model(name, device="cpu", hub_copy=False))

    registry = ModelRegistry(factory=factory)
    monkeypatch.setattr(handlers, "MODELS", registry)
    steps = list(handlers.run_comparison(**SHORT, budget_pct=100, model="qwen-coder-0.5b"))
    statuses = [s[STATUS] for s in steps if isinstance(s[STATUS], str)]
    assert not any("Loading the model" in s for s in statuses), statuses
    assert "setup.sh --models" in statuses[-1] and "fell back" in statuses[-1], statuses[-1]
    assert handlers.model_that_ran("qwen-coder-0.5b") == "bundled"
    assert qwen_missing == []
