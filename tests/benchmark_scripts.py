"""Load a script of `benchmarks/` or `experiments/` as a module, for its tests."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = (ROOT / "benchmarks", ROOT / "experiments")


def load(name: str):
    """`benchmarks/<name>.py` or `experiments/<name>.py`, executed anew as `name`."""
    path = next(p for p in (f / f"{name}.py" for f in FOLDERS) if p.is_file())
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
