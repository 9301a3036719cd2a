"""The replay's model work runs as jobs on the model worker (docs/design.md, "One model
worker"): the units that read a prefill's tensors (`profile_unit`, `cardinality_unit`)
run on the thread that owns the study's worker, as its decodes (`Study.run`) do."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from experiments.replay import harness
from experiments.replay.grid import GRIDS
from experiments.replay.jobs import PromptJob
from experiments.replay.store import UnitStore
from pagekv import PromptSpec
from pagekv.engine.worker import ModelWorker

from .test_worker_stress import _tiny_study, tokenizer  # noqa: F401 (a fixture)

pytestmark = pytest.mark.slow


def test_the_replays_units_run_on_the_model_worker(tokenizer, tmp_path, monkeypatch):  # noqa: F811
    study = _tiny_study(tokenizer, ModelWorker())
    grid = GRIDS["quick"]
    on_worker = {}

    def watched(name, fn):
        def unit(*args, **kwargs):
            on_worker[name] = study.worker.on_worker()
            return fn(*args, **kwargs)

        return unit

    monkeypatch.setattr(harness, "profile_unit", watched("profile", harness.profile_unit))
    monkeypatch.setattr(harness, "cardinality_unit", watched("t5", harness.cardinality_unit))
    job = PromptJob(PromptSpec(task="needle", context=300, depth=0.5, seed=3))
    job.cardinality = True
    keys = harness._job_keys("tiny-llama", grid, job)
    store = UnitStore(tmp_path)
    harness._compute_job(SimpleNamespace(study=study), store, grid, job, keys)
    assert on_worker == {"profile": True, "t5": True}, on_worker
    assert keys["profile"] in store and keys["t5"] in store
