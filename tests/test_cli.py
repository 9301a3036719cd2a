"""`python -m pagekv run`: one JSON object, a readable table, one-line errors with exit 2."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from pagekv.cli import format_table, main

ROOT = Path(__file__).resolve().parents[1]

REQUIRED = {
    "answer", "expected", "correct", "policy", "prompt_tokens", "budget_tokens", "kept_tokens",
    "uor", "backend", "device", "timings",
}  # fmt: skip


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["run", "--policy", "snapkv"], "invalid choice"),
        (["run", "--budget", "0"], "budget must be in (0, 1]"),
        (["run", "--budget", "abc"], "invalid float value"),
        (["run", "--page-size", "0"], "page_size must be an integer >= 1"),
        (["run", "--smoothing", "2"], "smoothing must be an odd integer"),
        (["run", "--needle", "x"], "needs question, answer"),
        (["run", "--haystack-file", "/nonexistent/file.txt", "--needle", "a", "--question", "b",
          "--answer", "c"], "nonexistent"),
        (["run", "--model", "no-such-org/no-such-model"], "bundled"),
        (["run", "--max-new-tokens", "0"], "max-new-tokens"),
        ([], "command"),
    ],
    ids=["policy", "budget0", "budget-text", "page", "smoothing", "partial-needle", "haystack",
         "model", "max-new", "no-command"],
)  # fmt: skip
def test_bad_arguments_one_line_exit_2(argv, fragment, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("pagekv: error:") and err.count("\n") == 1, err
    assert fragment in err


def test_subprocess_exit_code_and_single_line():
    proc = subprocess.run(
        [sys.executable, "-m", "pagekv", "run", "--budget", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "budget" in proc.stderr
    assert proc.stdout == ""


@pytest.mark.slow
def test_json_run_on_bundled_model(capsys):
    argv = ["run", "--model", "bundled", "--task", "needle", "--context", "600", "--depth", "0.5",
            "--budget", "0.2", "--page-size", "16", "--policy", "entropy", "--seed", "0",
            "--max-new-tokens", "12", "--json"]  # fmt: skip
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert REQUIRED <= set(out)
    assert out["policy"] == "entropy" and out["backend"] == "torch" and out["device"] == "cpu"
    n = out["prompt_tokens"]
    assert out["budget_tokens"] == int(0.2 * n)
    assert len(out["kept_tokens"]) == 30  # one entry per layer of SmolLM2
    assert all(k == out["kept_tokens"][0] <= out["budget_tokens"] for k in out["kept_tokens"])
    assert set(out["timings"]) >= {"load_s", "prefill_s", "evict_s", "decode_s"}
    # The count, from the geometry alone (defaults: 4 sinks, a window of 32): the pages
    # of 16 holding a sink or a window token, then as many whole pages as fit in k.
    first_window_page = (n - 32) // 16
    protected = 16 + n - 16 * first_window_page if first_window_page > 0 else n
    expected = protected + (out["budget_tokens"] - protected) // 16 * 16
    assert out["kept_tokens"] == [expected] * 30
    assert out["stored_tokens"] == out["union_tokens"] == [[expected] * 3] * 30
    assert isinstance(out["correct"], bool) and out["expected"]


@pytest.mark.slow
def test_policy_all_table_and_json(capsys):
    base = ["run", "--context", "400", "--budget", "0.3", "--page-size", "8", "--policy", "all",
            "--max-new-tokens", "6", "--question-after"]  # fmt: skip
    assert main([*base, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    runs = {r["policy"]: r for r in out["runs"]}
    assert set(runs) == {"entropy", "entropy_nosink", "mean", "max", "head_independent",
                         "streaming", "full"}  # fmt: skip
    assert all(REQUIRED <= set(r) for r in runs.values())
    # Question after compression: the cache holds the context; full keeps all of it.
    assert runs["full"]["mode"] == "after"
    assert runs["full"]["kept_tokens"][0] == runs["full"]["context_tokens"]
    assert runs["full"]["prompt_tokens"] > runs["full"]["context_tokens"]
    # Head-independent UOR = union / k', k' the tokens each head keeps: the count every
    # pooled policy keeps at this budget (same pages, same protected set).
    hi, k_head = runs["head_independent"], runs["entropy"]["kept_tokens"][0]
    unions = [u for row in hi["union_tokens"] for u in row]
    assert hi["uor"]["max"] == pytest.approx(max(unions) / k_head)
    assert hi["uor"]["mean"] == pytest.approx(sum(unions) / len(unions) / k_head)
    assert 1.0 < hi["uor"]["max"] <= 3.0  # r = 3; SmolLM2's heads disagree somewhere
    assert len({r["prompt_tokens"] for r in runs.values()}) == 1  # one prefill, one prompt
    # What the command prints without --json, from the same runs (their JSON objects
    # hold every field of a RunResult that the table reads).
    table = format_table([SimpleNamespace(**r) for r in out["runs"]])
    assert "policy" in table and "head_independent" in table and "expected" in table
    # Which tokens the budgets count: the context alone, with the question after.
    full = runs["full"]
    question = full["prompt_tokens"] - full["context_tokens"]
    assert (
        f"{full['prompt_tokens']} prompt tokens: {full['context_tokens']} of context (evicted, "
        f"and what the budgets count) and {question} of question"
    ) in table


def test_eval_without_lm_eval_says_what_to_install_in_one_line(tmp_path):
    """`pagekv eval` without lm-eval: one sentence naming the install, exit 2, no traceback."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "lm_eval.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'lm_eval'\", name='lm_eval')\n"
    )
    code = "import sys; from pagekv.cli import main; sys.exit(main(['eval', '--tasks', 'x']))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(hide), str(ROOT)])},
    )  # fmt: skip
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
    assert 'pip install ".[eval]"' in out.stderr and out.stderr.startswith("pagekv: error:")


@pytest.mark.parametrize(
    "argv, said",
    [
        (["run", "--task", "qa", "--name", "nope"], "unknown qa task 'nope'; choose from"),
        (["run", "--task", "code", "--name", "qa_larkspur_wifi"], "unknown code task"),
        (["run", "--model", "no-such-model"], "cannot load model 'no-such-model'"),
        (["run", "--model", "no-org/no-model"], "the Hugging Face hub is unreachable"),
        (["run", "--budget", "0.01"], "--budget 0.01 keeps fewer tokens than the protected"),
        (["run", "--budget", "0.05", "--context", "300"], "of about 300 tokens hold: at least"),
    ],
)
def test_the_cli_refuses_a_task_or_model_before_loading_any_model(argv, said, monkeypatch, capsys):
    """An unknown task or model, or a budget no prompt of about `--context` tokens can
    take, is refused in one line before any model loads."""
    import pagekv.runtime.models as models
    from pagekv.cli import main

    def no_load(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(models, "load_model", no_load)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("pagekv: error:") and err.count("\n") == 1, err
    assert said in err and "a model was loaded" not in err
