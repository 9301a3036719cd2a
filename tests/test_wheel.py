"""pagekv as a package (issue 41): the wheel `pip install .` builds holds the library,
its kernels as `pagekv.kernels` and the data it reads, and nothing of the app; installed
into a new virtual environment it imports, kernels and press included, from outside the
checkout.

Offline: the build backend is the dev requirements' setuptools (`--no-build-isolation`),
and the new environment borrows this one's packages (torch, transformers, ...) through a
`.pth` file, so nothing is fetched (`--no-deps --no-index`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Run inside the new environment, from outside the checkout.
PROBE = r"""
import importlib.util, json, sys
import torch
import pagekv
from pagekv import EvictionConfig, plan
from pagekv.kernels.score import score_layers
from pagekv.measurement.integrations import PageEntroKVPress
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


def build_wheel(tmp_path: Path) -> Path:
    """The wheel of a copy of what the build reads (the checkout stays clean)."""
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("pagekv", "kernels"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md", "LICENSE"):
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
    """A new virtual environment that borrows this one's packages after its own; its
    python and its site-packages."""
    env = tmp_path / "env"
    venv.EnvBuilder(with_pip=False).create(env)
    python = env / "bin" / "python"
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    Path(site, "borrowed.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python, site


def _probe(python: Path, cwd: Path) -> dict:
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    out = subprocess.run(
        [python, "-c", PROBE], cwd=cwd, capture_output=True, text=True, timeout=300,
        env={**clean, "TRITON_INTERPRET": "1"},
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


def test_the_wheel_holds_the_library_and_installs_outside_the_checkout(tmp_path):
    wheel = build_wheel(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"pagekv", "pagekv-0.1.0.dist-info"}
    for needed in ("pagekv/kernels/score.py", "pagekv/kernels/paged_decode.py",
                   "pagekv/measurement/peer/requirements-kvpress.txt",
                   "pagekv/views/lessons.md",
                   "pagekv/measurement/integrations/kvpress_press.py"):  # fmt: skip
        assert needed in names, needed
    assert not [n for n in names if n.startswith(("kernels/", "tests/", "assets/"))]
    assert not [n for n in names if n.endswith(("app.py", "conftest.py")) or "bench" in n]

    python, site = _new_env(tmp_path)
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
         "--no-index", str(wheel)],
        check=True, timeout=300,
    )  # fmt: skip
    got = _probe(python, tmp_path)
    assert got["pagekv"].startswith(site) and got["kernels"].startswith(site), got
    assert got["press"] == "pagekv.measurement.integrations.kvpress_press"
    assert got["top_level_kernels"] is False  # no name another package owns
    assert got["backend"] == "triton" and got["kept"] > 0
