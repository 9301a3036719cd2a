"""The `>>>` examples in `pagekv/` pass; modules are found by reading the files, so a new example
runs unlisted and a module that fails to import fails."""

import doctest
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def modules_with_examples() -> list[str]:
    found = []
    for path in sorted((ROOT / "pagekv").rglob("*.py")):
        if ">>>" in path.read_text(encoding="utf-8"):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            found.append(".".join(parts))
    return found


MODULES = modules_with_examples()


def test_the_examples_of_config_and_models_are_found():
    assert {"pagekv.maths.config", "pagekv.runtime.models"} <= set(MODULES), MODULES


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    res = doctest.testmod(module, optionflags=doctest.ELLIPSIS, report=True)
    assert res.attempted > 0, f"{name}: '>>>' in the source but no example ran"
    assert res.failed == 0, f"{name}: {res.failed} of {res.attempted} examples failed (see stdout)"
