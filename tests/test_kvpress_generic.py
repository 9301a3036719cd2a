"""kvpress's own generic press tests, applied to pagekv's presses (opt-in).

kvpress (github.com/NVIDIA/kvpress) tests every press the same way: run inside the model
at compression ratios 0.2 and 0.8 on short prompts, wrapped in ``ComposedPress``, through
its context manager and its pipeline. Those tests load ``MaxJeblick/llama2-0b-unit-test``
from the hub (kvpress ``tests/fixtures.py``), impossible here, so
``tests/kvpress_generic/checks.py`` applies the same checks, inside kvpress's own venv
(kvpress 0.5.5, transformers 5.2, where ``PageEntroKVPress`` is a ``kvpress.BasePress``),
to ``PageEntroKVPress`` (``scorer="window"`` and ``"reconstruct"``) and
``MeanPoolPagePress`` (both scorers), on tiny random models built from a config (Llama
with 4 = 4 heads like the unit-test model, Qwen2 with 8 query heads over 2 KV heads, an
eager-attention Llama) and a byte-level tokenizer built in memory, saved to a temporary
folder that stands in for the hub repository. Each test below names the kvpress test it
mirrors; the script's case functions say what each checks beyond kvpress's assertions
(kvpress mostly asserts that a press runs; these also check the kept count and that the
cache holds exactly the planned pages).

What does not apply, and why:

- ``test_presses_run`` with the wrappers ``KeyRerotationPress``, ``AdaKVPress``,
  ``ChunkPress``, ``CriticalKVPress``, ``CriticalAdaKVPress``, ``DMSPress``,
  ``MergingPress``: they wrap a ``ScorerPress`` (per-token scores) and kvpress's test
  returns without wrapping any other press. pagekv's presses select whole pages, not
  per-token scores, so they are not ScorerPresses; the case checks that and that the
  wrappers refuse them. Likewise ``tests/presses/test_head_compression.py``,
  ``tests/test_per_layer_compression_press.py``, ``test_chunk_press`` and
  ``test_chunkkv_press`` (ScorerPress wrappers or head-wise masking presses; pagekv's
  pooled presses keep the same count in every KV head).
- ``ComposedPress`` with ``scorer="reconstruct"``: the reconstruct scorer works after the
  whole prefill, like kvpress's KVzipPress, which kvpress's test skips under
  ComposedPress; it cannot press one layer at a time and raises a ValueError saying so.
- The reconstruct scorer takes batch size 1: kvpress's batched cases
  (``test_context_manager_applies_compression`` on ``model.dummy_inputs``, 3 sequences;
  ``test_presses_keep_highest_score``, 5 sequences) check its clear refusal, and the
  observed-attention case runs it on the first sequence.
- ``tests/test_generate.py::test_generate`` compares ``model.generate`` under a press with
  the pipeline's answer; their prefills differ by one token ("\\n"), which on a random
  model says nothing, so ``generate`` under the press is compared with greedy decoding on
  the cache the press compressed; the reconstruct scorer refuses ``generate``'s decoding
  steps inside its block (it compresses when the block exits).
- ``tests/test_pipeline.py``: the cases that test the pipeline rather than a press
  (``test_pipeline_no_press_works``, ``test_pipeline_context_cache_is_invariant``), need
  a GPU and flash-attention (``TestPipelineFA2``), optimum-quanto
  (``test_pipeline_with_quantized_cache``) or a real model's answer
  (``test_pipeline_answer_is_correct``) are not mirrored.

Run: ``PAGEKV_TEST_KVPRESS=1 python -m pytest -q tests/test_kvpress_generic.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from experiments.peer import kvpress_peer as kp

ROOT = Path(__file__).resolve().parents[1]
CHECKS = ROOT / "tests" / "kvpress_generic" / "checks.py"

pytestmark = [pytest.mark.slow, pytest.mark.kvpress]  # opt-in: tests/conftest.py

VARIANTS = ("entropy-window", "entropy-reconstruct", "meanpool-window", "meanpool-reconstruct")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every case of tests/kvpress_generic/checks.py, run once in kvpress's venv."""
    python = kp.venv_python(kp.ensure_kvpress_env(progress=None))
    out = tmp_path_factory.mktemp("kvpress_generic") / "results.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    proc = subprocess.run(
        [str(python), str(CHECKS), str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
        cwd=ROOT,
    )
    assert out.exists(), (proc.stdout[-2000:], proc.stderr[-3000:])
    return json.loads(out.read_text())


def _check(results: dict, names: list[str]) -> None:
    """Every named case ran (none silently missing) and passed."""
    missing = [n for n in names if n not in results]
    assert not missing, f"cases that did not run: {missing}"
    failed = {n: results[n]["error"] for n in names if not results[n]["ok"]}
    assert not failed, "\n\n".join(f"{n}:\n{e}" for n, e in failed.items())
    for n in names:
        print(f"\n{n}: {json.dumps(results[n]['facts'], default=str)[:300]}")


def test_presses_run(results):
    """Mirrors kvpress tests/presses/test_presses.py::test_presses_run (wrapper_press=None,
    every press at ratios 0.2 and 0.8, one sequence of 128 ids from randint(0, 1024)),
    and, on the same runs, what test_presses_keep_highest_score checks of a ScorerPress:
    the kept keys and values are exactly the ones the press selected."""
    _check(
        results,
        [
            f"presses_run[{m}-{v}-{r}]"
            for m in ("llama_mha", "qwen2_gqa")
            for v in VARIANTS
            for r in (0.2, 0.8)
        ],
    )
    small = results["presses_run[qwen2_gqa-entropy-window-0.8]"]["facts"]
    assert small == {"kept": 48, "k": 25, "warned": 1}  # protected pages only, one warning


def test_presses_run_wrapped_in_composed_press(results):
    """Mirrors kvpress tests/presses/test_presses.py::test_presses_run with
    wrapper_press=ComposedPress (the reconstruct scorer refuses, as KVzipPress is skipped)."""
    _check(results, [f"presses_run_composed[{v}-{r}]" for v in VARIANTS for r in (0.2, 0.8)])


def test_presses_run_other_wrappers_do_not_apply(results):
    """Mirrors kvpress tests/presses/test_presses.py::test_presses_run with the other
    wrapper presses: they take a ScorerPress only, which pagekv's presses are not."""
    _check(results, ["presses_run_other_wrappers"])


def test_composed_press(results):
    """Mirrors kvpress tests/presses/test_presses.py::test_composed_press (two presses
    chained; here PageEntroKVPress then KnormPress)."""
    _check(results, ["composed_press"])
    assert results["composed_press"]["facts"]["128"]["after_knorm"] == 32


def test_presses_run_observed_attention(results):
    """Mirrors kvpress tests/presses/test_presses.py::test_presses_run_observed_attention
    (an eager-attention model, ``model.dummy_inputs``, ratios 0.2 and 0.8)."""
    _check(results, [f"observed_attention[{v}-{r}]" for v in VARIANTS for r in (0.2, 0.8)])


def test_presses_keep_planned_pages(results):
    """Mirrors kvpress tests/presses/test_presses.py::test_presses_keep_highest_score
    (a batch of 5 x 256 ids, ratios 0.0 to 0.8: the kept keys are the selected ones)."""
    _check(results, ["keep_planned[entropy-window]", "keep_planned[meanpool-window]"])


def test_context_manager_adds_and_removes_hook(results):
    """Mirrors kvpress tests/test_press_call.py::test_context_manager_adds_and_removes_hook."""
    _check(results, [f"context_manager_adds_and_removes_hook[{v}]" for v in VARIANTS])


def test_context_manager_applies_compression(results):
    """Mirrors kvpress tests/test_press_call.py::test_context_manager_applies_compression."""
    _check(results, [f"context_manager_applies_compression[{v}]" for v in VARIANTS])


def test_pipeline(results):
    """Mirrors kvpress tests/test_pipeline.py: test_pipeline, test_pipeline_with_cache,
    test_pipeline_single_or_no_question and test_pipeline_compresses_context."""
    _check(results, [f"pipeline[{m}-{v}]" for m in ("llama_mha", "qwen2_gqa") for v in VARIANTS])


def test_generate(results):
    """Mirrors kvpress tests/test_generate.py::test_generate (``model.generate`` under
    ``with press(model):``)."""
    _check(results, [f"generate[{v}]" for v in VARIANTS])


def test_reconstruct_scorer_matches_pagekv_under_basepress(results):
    """Not a kvpress test: under kvpress's BasePress, ``scorer="reconstruct"`` keeps in
    every layer the pages pagekv picks from its reconstruction pass computed on its own
    (the instruction tokenised by the model's tokenizer), and the window scorer differs."""
    _check(
        results,
        [
            f"reconstruct_matches_pagekv[{m}-{v}]"
            for m in ("llama_mha", "qwen2_gqa")
            for v in ("entropy-reconstruct", "meanpool-reconstruct")
        ],
    )


def test_every_case_is_asserted(results):
    """No case of the script goes unchecked by a test above."""
    prefixes = (
        "presses_run[",
        "presses_run_composed[",
        "presses_run_other_wrappers",
        "composed_press",
        "observed_attention[",
        "keep_planned[",
        "context_manager_adds_and_removes_hook[",
        "context_manager_applies_compression[",
        "pipeline[",
        "generate[",
        "reconstruct_matches_pagekv[",
    )
    assert all(name.startswith(prefixes) for name in results), sorted(results)
    assert len(results) == 60
