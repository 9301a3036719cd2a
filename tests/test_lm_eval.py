"""Page-EntroKV as an lm-evaluation-harness model (`pagekv.integrations.lm_eval_model`) on lm-eval's
own RULER task code: the question split on six offline RULER tasks, `simple_evaluate` scoring
equal to `contains`, and one-sentence refusals. An nltk stand-in folder keeps lm-eval's RULER
import from downloading."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from lm_eval.api.instance import Instance
from lm_eval.api.model import LM
from lm_eval.evaluator import simple_evaluate

from pagekv.integrations import lm_eval_model as lem
from pagekv.integrations.lm_eval_model import (
    RULER_OFFLINE_TASKS as TASKS,
)
from pagekv.integrations.lm_eval_model import PageKVLM, split_question
from pagekv.runtime.models import bundled_cache_dir
from pagekv.tasks.base import contains

LENGTH = 1024


@pytest.fixture(scope="module")
def offline_nltk(tmp_path_factory):
    """nltk finds a (stand-in) punkt_tab, so lm-eval's RULER module downloads nothing."""
    import nltk

    root = tmp_path_factory.mktemp("nltk_data")
    (root / "tokenizers" / "punkt_tab").mkdir(parents=True)
    nltk.data.path.insert(0, str(root))
    yield
    nltk.data.path.remove(str(root))


def _metadata() -> dict:
    return {"tokenizer": str(bundled_cache_dir()), "max_seq_lengths": [LENGTH]}


class _Prompts(LM):
    """Records each prompt lm-eval sends and answers nothing."""

    def __init__(self):
        super().__init__()
        self.prompts = []

    def generate_until(self, requests, disable_tqdm=False):
        self.prompts += [r.args[0] for r in requests]
        return ["" for _ in requests]

    def loglikelihood(self, requests, disable_tqdm=False):
        raise NotImplementedError

    def loglikelihood_rolling(self, requests, disable_tqdm=False):
        raise NotImplementedError


@pytest.mark.slow
def test_the_question_split_on_the_six_tasks_real_prompts(offline_nltk, bundled_study):
    rec = _Prompts()
    res = simple_evaluate(model=rec, tasks=list(TASKS), limit=1, metadata=_metadata())
    docs = {t: res["samples"][t][0]["doc"] for t in TASKS}
    assert len(rec.prompts) == len(TASKS)
    for prompt in rec.prompts:
        task = next(t for t in TASKS if docs[t]["input"] in prompt)
        context, question = split_question(prompt)
        assert context + question == prompt and context.endswith("\n"), task
        prefix = docs[task]["gen_prefix"]
        assert question.rstrip().endswith(prefix.rstrip()), (task, question[-200:])
        assert question.startswith("Question:" if task.startswith("ruler") else "What is"), (
            task,
            question[:80],
        )
        assert "\n" not in question.split("Answer:")[0].strip(), (task, question[:200])
        assert prefix.strip() not in context, task  # the context holds none of the question
    with pytest.raises(ValueError, match="one line"):
        split_question("no question here")


@pytest.mark.slow
def test_lm_eval_scores_the_answers_as_the_project_does(offline_nltk, bundled_study):
    lm = PageKVLM(pretrained="bundled", policy="entropy", budget=0.2, page_size=16)
    res = simple_evaluate(model=lm, tasks=["niah_single_1"], limit=2, metadata=_metadata())
    samples = res["samples"]["niah_single_1"]
    assert len(samples) == 2 and all(s["resps"][0][0].strip() for s in samples)  # answered
    ours = []
    for s in samples:
        answer = s["resps"][0][0]
        refs = s["doc"]["outputs"]
        ours.append(sum(contains(answer, [r]) for r in refs) / len(refs))
        assert s[str(LENGTH)] == ours[-1], (answer, refs)
    reported = res["results"]["niah_single_1"][f"{LENGTH},none"]
    assert reported == pytest.approx(sum(ours) / len(ours))
    # The same model answers one prompt directly as lm-eval had it answer.
    prompt = samples[0]["arguments"][0][0]
    assert lm.answer(prompt, 128) == samples[0]["resps"][0][0]


@pytest.mark.slow
def test_bad_arguments_are_refused_in_one_sentence(bundled_study, caplog):
    with pytest.raises(ValueError, match=r"does not take bogus: it takes pretrained"):
        PageKVLM.create_from_arg_string("pretrained=bundled,bogus=1")
    with pytest.raises(ValueError, match="question must be 'inside' or 'after'"):
        PageKVLM(question="before")
    lm = PageKVLM.create_from_arg_string(
        "pretrained=bundled,budget=0.1,page_size=8,question=after", {"batch_size": 1}
    )
    assert (lm.config.budget, lm.config.page_size, lm.question) == (0.1, 8, "after")
    # No tokenizer= for a bundled model: one warning naming the folder to give.
    told = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert told == [
        f"lm-eval's RULER tasks load the tokenizer that tokenizer= (else pretrained=) names, "
        f"and 'bundled' is pagekv's name, not a hub id: add tokenizer={bundled_cache_dir()} "
        f"(python -m pagekv eval adds it)"
    ]
    caplog.clear()
    PageKVLM.create_from_arg_string(f"pretrained=bundled,tokenizer={bundled_cache_dir()}")
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    request = Instance("loglikelihood", {}, ("a", " b"), 0)
    with pytest.raises(NotImplementedError, match="only generates"):
        lm.loglikelihood([request])


def _answering_lm(log: list) -> PageKVLM:
    """A `PageKVLM` without a model whose answers are logged, for its request loop."""
    lm = PageKVLM.__new__(PageKVLM)
    LM.__init__(lm)
    lm.answer = lambda prompt, max_new_tokens, until=(): log.append(("answer", prompt)) or prompt
    return lm


def _requests(n: int) -> list[Instance]:
    return [Instance("generate_until", {}, (f"p{i}", {"until": ["\n"]}), i) for i in range(n)]


def test_generate_until_shows_a_bar_that_advances_once_a_request(monkeypatch, capsys):
    log = []

    class Bar(lem.tqdm):
        def __init__(self, *args, **kwargs):
            log.append(("bar", kwargs["total"], kwargs["disable"]))
            super().__init__(*args, **kwargs)

        def update(self, n=1):
            log.append(("update", n))
            return super().update(n)

    monkeypatch.setattr(lem, "tqdm", Bar)
    lm = _answering_lm(log)
    assert lm.generate_until(_requests(3)) == ["p0", "p1", "p2"]
    steps = [("answer", f"p{i}") for i in range(3)]
    assert log == [("bar", 3, False)] + [x for a in steps for x in (a, ("update", 1))]
    err = capsys.readouterr().err
    assert "Running generate_until requests" in err and "3/3" in err, err
    log.clear()
    lm.generate_until(_requests(2), disable_tqdm=True)  # as lm-eval asks, never drawn
    assert log[0] == ("bar", 2, True) and "generate_until" not in capsys.readouterr().err
    lm._rank = 1  # only the first process draws it
    log.clear()
    lm.generate_until(_requests(1))
    assert log[0] == ("bar", 1, True) and "generate_until" not in capsys.readouterr().err


def test_the_command_line_names_a_bundled_models_tokenizer(monkeypatch):
    folder = str(bundled_cache_dir())
    assert lem.with_tokenizer("pretrained=bundled,policy=mean") == (
        f"pretrained=bundled,policy=mean,tokenizer={folder}"
    )
    assert lem.with_tokenizer("pretrained=bundled,tokenizer=x") == "pretrained=bundled,tokenizer=x"
    assert lem.with_tokenizer("pretrained=/some/folder") == "pretrained=/some/folder"
    seen = {}
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # cli sets it for lm-eval's parser
    monkeypatch.setattr("lm_eval.__main__.cli_evaluate", lambda: seen.update(argv=list(sys.argv)))
    assert lem.cli(["--model", "pagekv", "--model_args", "pretrained=bundled"]) == 0
    assert seen["argv"] == ["lm-eval", "--model", "pagekv", "--model_args",
                            f"pretrained=bundled,tokenizer={folder}"]  # fmt: skip


def test_the_command_line_refuses_a_bad_argument_in_one_line(monkeypatch, capsys):
    """`python -m pagekv eval` with a bad model argument: one line on stderr and exit
    status 2, as pagekv's other commands (not lm-eval's traceback)."""
    from pagekv.cli import EXIT_USAGE, main

    monkeypatch.setattr(sys, "argv", list(sys.argv))  # cli sets it for lm-eval's parser
    args = ["eval", "--model", "pagekv", "--model_args", "pretrained=bundled,question=before",
            "--tasks", "niah_single_1", "--limit", "1"]  # fmt: skip
    assert main(args) == EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "pagekv: error: question must be 'inside' or 'after', not 'before'"


def _run_probe(code: str, cwd: Path, *args: str) -> list[str]:
    """`code` run in a new Python with the checkout on its path; its stdout's lines."""
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", code, *args], cwd=cwd, capture_output=True, text=True,
        timeout=300, env={**os.environ, "PYTHONPATH": str(root)},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.splitlines()


#: Loads the hook file as the wheel's top-level `pagekv_lm_eval` does, installs it twice
#: and looks lm-eval's models up without importing them; then imports lm-eval's registry
#: and asks it for a model of lm-eval's own and for `pagekv`.
HOOK_PROBE = r"""
import importlib.util, json, sys
start = set(sys.modules)
spec = importlib.util.spec_from_file_location("pagekv_lm_eval", sys.argv[1])
hook = importlib.util.module_from_spec(spec)
spec.loader.exec_module(hook)
hook.install(); hook.install()
imported_by_hook = sorted(set(sys.modules) - start)
finders = sum(isinstance(f, hook.RegisterPagekv) for f in sys.meta_path)
found = importlib.util.find_spec("lm_eval.models") is not None  # looked up, not imported
from lm_eval.api.registry import get_model, model_registry
empty = len(model_registry) == 0  # lm-eval fills it with its own models on first use
own = get_model("dummy").__name__
left = sum(isinstance(f, hook.RegisterPagekv) for f in sys.meta_path)
lazy = ["pagekv" in model_registry, "pagekv" in sys.modules, "torch" in sys.modules]
model = get_model("pagekv")
hook.install()  # lm-eval's models already loaded: nothing new, no error
print(json.dumps([imported_by_hook, finders, found, empty, own, left, *lazy,
                  f"{model.__module__}:{model.__name__}"]))
"""


def test_the_hook_registers_pagekv_lazily_beside_lm_evals_own_models(tmp_path):
    """`lm_eval_hook.install()` imports nothing and leaves lm-eval's registry empty until lm-eval
    fills it; then `pagekv` is a lazy entry beside them."""
    import pagekv.integrations.lm_eval_hook as hook

    got = json.loads(_run_probe(HOOK_PROBE, tmp_path, hook.__file__)[-1])
    assert set(got[0]) <= {"__future__"}, got[0]  # at most the annotations' future import
    assert got[1:] == [1, True, True, "DummyLM", 0, True, False, False, hook.TARGET]
    assert hook.TARGET == f"{PageKVLM.__module__}:PageKVLM"


#: The hook installed, its registration broken (as a later lm-eval without
#: `model_registry` would break it): lm-eval still imports and serves its own models.
BROKEN_HOOK_PROBE = r"""
import importlib.util, sys, warnings
spec = importlib.util.spec_from_file_location("pagekv_lm_eval", sys.argv[1])
hook = importlib.util.module_from_spec(spec)
spec.loader.exec_module(hook)
def register():
    raise ImportError("no model_registry here")
hook.register = register
hook.install()
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    from lm_eval.api.registry import get_model, model_registry
    print(get_model("dummy").__name__, "pagekv" in model_registry)
print(*[str(w.message) for w in seen if "pagekv" in str(w.message)], sep="\n")
"""


def test_a_failing_registration_leaves_lm_eval_working(tmp_path):
    """Should registering `pagekv` fail (another lm-eval), importing lm-eval's models
    still works: one warning says pagekv's model is not registered."""
    import pagekv.integrations.lm_eval_hook as hook

    assert _run_probe(BROKEN_HOOK_PROBE, tmp_path, hook.__file__) == [
        "DummyLM False",
        "pagekv's lm-eval model is not registered: ImportError('no model_registry here')",
    ]


#: pagekv's lm-eval model imported: lm-eval's own models still resolve by name.
OWN_MODELS_PROBE = r"""
import pagekv.integrations.lm_eval_model as m
from lm_eval.api.registry import get_model
print(get_model("dummy").__name__, get_model("pagekv") is m.PageKVLM)
"""


def test_importing_the_model_keeps_lm_evals_own_models(tmp_path):
    """Registering `PageKVLM` keeps lm-eval's own models: `--model dummy` resolves."""
    assert _run_probe(OWN_MODELS_PROBE, tmp_path) == ["DummyLM True"]
