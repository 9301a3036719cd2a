"""pagekv as a package: the wheel holds the library, `pagekv.kernels` and its data, nothing of the
app; installed in a new venv it imports outside the checkout, and lm-eval's own command line runs
`--model pagekv`. Offline: `--no-build-isolation`, and the venv borrows this one's packages
through a `.pth`."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: Run inside the new environment, from outside the checkout.
PROBE = r"""
import importlib.util, json, sys
import torch
import pagekv
from pagekv import EvictionConfig, plan
from pagekv.kernels.score import score_layers
from pagekv.integrations import PageEntroKVPress
from pagekv.runtime.backend import resolve_backend
torch.manual_seed(0)
prof = torch.softmax(torch.randn(2, 4, 64), -1)
p = plan(prof, n_groups=2, config=EvictionConfig(budget=0.5, page_size=8, window=8, n_sink=2))
print(json.dumps({
    "pagekv": pagekv.__file__,
    "kernels": sys.modules["pagekv.kernels.score"].__file__,
    "press": PageEntroKVPress.__module__,
    "top_level_kernels": importlib.util.find_spec("kernels") is not None,
    "backend": resolve_backend("triton", torch.zeros(1)),
    "kept": int(p.keep.sum()),
}))
"""


#: Run inside the new environment: lm-eval's registry before its models load (empty),
#: then what it holds once a model of lm-eval's own is asked for, then `pagekv`.
REGISTRY_PROBE = r"""
import json, sys
from lm_eval.api.registry import get_model, model_registry
empty = len(model_registry) == 0
own = get_model("dummy").__name__
lazy = ["pagekv" in model_registry, "pagekv" in sys.modules, "torch" in sys.modules]
model = get_model("pagekv")
print(json.dumps([empty, own, *lazy, f"{model.__module__}:{model.__name__}",
                  sys.modules["pagekv"].__file__]))
"""
LM_EVAL_MODEL = "pagekv.integrations.lm_eval_model:PageKVLM"


def build_wheel(tmp_path: Path) -> Path:
    """The wheel of a copy of what the build reads (the checkout stays clean)."""
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("pagekv", "kernels", "assets"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps",
         str(src), "-w", str(dist)],
        check=True, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    (wheel,) = dist.glob("pagekv-*.whl")
    return wheel


def _new_env(tmp_path: Path) -> tuple[Path, str]:
    """A new venv borrowing this one's packages; its python and site-packages."""
    env = tmp_path / "env"
    venv.EnvBuilder(with_pip=False).create(env)
    python = env / "bin" / "python"
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    Path(site, "borrowed.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python, site


def _clean_env() -> dict:
    """This environment without PYTHONPATH or PYTHONHOME."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}


def _probe(python: Path, cwd: Path) -> dict:
    out = subprocess.run(
        [python, "-c", PROBE], cwd=cwd, capture_output=True, text=True, timeout=300,
        env={**_clean_env(), "TRITON_INTERPRET": "1"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _registry(python: Path, cwd: Path) -> list:
    """REGISTRY_PROBE's answer: empty registry, lm-eval's `dummy`, then `pagekv` listed, imports
    seen, the model's "module:Class" and pagekv's file."""
    out = subprocess.run(
        [python, "-c", REGISTRY_PROBE], cwd=cwd, capture_output=True, text=True,
        env=_clean_env(), timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_an_editable_install_imports_the_checkout(tmp_path):
    """`pip install -e .`: the installed name is the checkout, kernels included."""
    python, _ = _new_env(tmp_path)
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
         "--no-build-isolation", "-e", str(ROOT)],
        check=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    got = _probe(python, tmp_path)
    assert got["pagekv"] == str(ROOT / "pagekv" / "__init__.py")
    assert got["kernels"] == str(ROOT / "kernels" / "score.py")
    assert got["top_level_kernels"] is False and got["kept"] > 0
    assert _registry(python, tmp_path) == [
        True, "DummyLM", True, False, False, LM_EVAL_MODEL, got["pagekv"]
    ]  # fmt: skip


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path, str]:
    """The wheel, and a new environment it is installed in: its python, site-packages."""
    tmp_path = tmp_path_factory.mktemp("wheel")
    wheel = build_wheel(tmp_path)
    python, site = _new_env(tmp_path)
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
         "--no-index", str(wheel)],
        check=True, timeout=300,
    )  # fmt: skip
    return wheel, python, site


def test_the_wheel_holds_the_library_and_installs_outside_the_checkout(installed, tmp_path):
    wheel, python, site = installed
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {
        "pagekv", "pagekv-0.1.0.dist-info", "pagekv_lm_eval.py", "pagekv_lm_eval.pth"
    }  # fmt: skip
    for needed in ("pagekv/kernels/score.py", "pagekv/kernels/paged_decode.py",
                   "pagekv/integrations/kvpress_press.py",
                   "pagekv/integrations/lm_eval_model.py"):  # fmt: skip
        assert needed in names, needed
    assert not [n for n in names if n.startswith(("kernels/", "tests/", "assets/"))]
    # Of assets/, the prompts' data only (the haystack, the curated tasks).
    packaged = {n.split("/")[2] for n in names if n.startswith("pagekv/assets/")}
    assert packaged == {"haystack", "tasks"}, packaged
    assert not [n for n in names if n.endswith(("app.py", "conftest.py")) or "bench" in n]
    # The research harness (experiments/: the replay, the kvpress peer, the studies) and
    # the app's parts (pagekv/app) are not the library's.
    assert not [n for n in names if "experiments" in n or "replay/" in n or "peer/" in n]
    assert not [n for n in names if n.startswith("pagekv/app/")]

    got = _probe(python, tmp_path)
    assert got["pagekv"].startswith(site) and got["kernels"].startswith(site), got
    assert got["press"] == "pagekv.integrations.kvpress_press"
    assert got["top_level_kernels"] is False  # no name another package owns
    assert got["backend"] == "triton" and got["kept"] > 0
    # Installed, the commands that need the research harness (`replay`) or the app's
    # parts (`lessons`) say in one line that they run from a checkout.
    for command in (["replay", "--out", str(tmp_path / "replay")], ["lessons"]):
        out = subprocess.run(
            [python, "-m", "pagekv", *command], cwd=tmp_path, capture_output=True, text=True,
            timeout=300, env=_clean_env(),
        )  # fmt: skip
        assert out.returncode == 2, out.stderr[-3000:]
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and f"{command[0]} runs from a checkout" in lines[0], lines


ENGINE_PROBE = r"""
import json
from pagekv import PromptSpec, Study
from pagekv.tasks import load_haystack
print(json.dumps([Study.__module__, PromptSpec().task, len(load_haystack())]))
"""


def test_the_installed_engine_runs_a_comparison(installed, tmp_path):
    """From the wheel outside the checkout: `from pagekv import Study, PromptSpec` and `pagekv run
    --budget 0.1` print the verdict and answer."""
    _, python, site = installed
    out = subprocess.run(
        [python, "-c", ENGINE_PROBE], cwd=tmp_path, capture_output=True, text=True,
        timeout=300, env=_clean_env(),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    module, task, chars = json.loads(out.stdout.strip().splitlines()[-1])
    assert module == "pagekv.engine.study" and task == "needle" and chars > 30_000
    out = subprocess.run(
        [python.parent / "pagekv", "run", "--budget", "0.1", "--max-new-tokens", "8"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
        env={**_clean_env(), "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    (row,) = [line for line in out.stdout.splitlines() if line.startswith("entropy ")]
    assert row.split()[7] in ("yes", "no") and len(row.split()) > 8, out.stdout  # an answer


@pytest.mark.slow
def test_lm_evals_own_command_line_runs_the_installed_pagekv_model(installed, tmp_path):
    """The wheel's `.pth` registers `pagekv` lazily; `lm_eval run --model pagekv` on two samples
    reports `contains` of its logged answers."""
    from pagekv.runtime.models import bundled_cache_dir
    from pagekv.tasks.base import contains

    _, python, site = installed
    *registry, where = _registry(python, tmp_path)
    assert registry == [True, "DummyLM", True, False, False, LM_EVAL_MODEL]
    assert where.startswith(site)

    nltk_data = tmp_path / "nltk_data"  # a stand-in punkt_tab: lm-eval's RULER fetches none
    (nltk_data / "tokenizers" / "punkt_tab").mkdir(parents=True)
    args = ("pretrained=bundled,policy=entropy,budget=0.2,page_size=16,question=inside,"
            f"tokenizer={bundled_cache_dir()}")  # fmt: skip
    run = subprocess.run(
        [python, "-m", "lm_eval", "run", "--model", "pagekv", "--model_args", args,
         "--tasks", "niah_single_1", "--limit", "2", "--metadata", '{"max_seq_lengths": [1024]}',
         "--output_path", str(tmp_path / "out"), "--log_samples"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
        env={**_clean_env(), "NLTK_DATA": str(nltk_data), "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    row = re.search(r"^\|niah_single_1\|.*\|\s*1024\|[^|]*\|\s*([\d.]+)\|", run.stdout, re.M)
    assert row, run.stdout[-2000:]  # lm-eval's own table
    (results,) = (tmp_path / "out").rglob("results_*.json")
    reported = json.loads(results.read_text())["results"]["niah_single_1"]["1024,none"]
    (logged,) = (tmp_path / "out").rglob("samples_niah_single_1_*.jsonl")
    ours = []
    for line in logged.read_text().splitlines():
        sample = json.loads(line)
        refs = sample["doc"]["outputs"]
        ours.append(sum(contains(sample["resps"][0][0], [r]) for r in refs) / len(refs))
    assert len(ours) == 2
    assert reported == pytest.approx(sum(ours) / len(ours))
    assert float(row.group(1)) == pytest.approx(reported, abs=1e-4)
