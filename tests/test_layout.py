"""The architecture as checks: one policy list, the maths above no framework, the
kernels free of `pagekv`, one result schema written down, one rule per place."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from pagekv.maths.policies import POLICIES, REGISTRY, get_policy
from pagekv.runtime.result import RunResult, json_keys

ROOT = Path(__file__).resolve().parents[1]
#: The maths: imports torch and each other only (DESIGN.md section 4).
MATHS = [
    "pagekv/config.py",
    "pagekv/profiles.py",
    "pagekv/entropy.py",
    "pagekv/pooling.py",
    "pagekv/paging.py",
    "pagekv/metrics.py",
    "pagekv/plan.py",
    "pagekv/constructed.py",
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "pagekv" / "policies").glob("*.py")),
]
FRAMEWORKS = {"transformers", "gradio", "plotly", "kernels", "triton", "gguf", "kvpress"}


def _module_imports(path: Path) -> set[str]:
    """Top-level names imported at module level (not inside functions)."""
    tree = ast.parse(path.read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def _all_imports(path: Path) -> set[str]:
    """Every absolute import anywhere in the file, lazy ones included."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("rel", MATHS)
def test_maths_imports_no_framework(rel):
    found = _module_imports(ROOT / rel) & FRAMEWORKS
    assert not found, f"{rel} imports {sorted(found)} at module level"


@pytest.mark.parametrize("rel", sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("kernels/*.py")))
def test_kernels_import_nothing_from_pagekv(rel):
    found = {m for m in _all_imports(ROOT / rel) if m == "pagekv" or m.startswith("pagekv.")}
    assert not found, f"{rel} imports {sorted(found)}"


def _policy_name_lists(path: Path) -> list[int]:
    """Line numbers of tuple/list/set literals that name three or more policies."""
    hits = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            names = {
                e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in POLICIES
            }
            if len(names) >= 3:
                hits.append(node.lineno)
    return hits


def test_the_policy_list_is_written_once():
    sources = [*ROOT.glob("pagekv/**/*.py"), ROOT / "app.py", *ROOT.glob("benchmarks/*.py")]
    offenders = {
        str(p.relative_to(ROOT)): lines
        for p in sources
        if "policies" not in p.parts and (lines := _policy_name_lists(p))
    }
    assert not offenders, f"policy lists written outside pagekv/policies: {offenders}"


def test_the_check_finds_a_policy_list(tmp_path):
    """The detector above is not vacuous: it flags a hand-written list."""
    f = tmp_path / "x.py"
    f.write_text('CHOICES = ("entropy", "mean", "max")\nOTHER = ("entropy", "x")\n')
    assert _policy_name_lists(f) == [1]


def test_registry_is_one_file_per_policy():
    files = {
        p.stem for p in (ROOT / "pagekv" / "policies").glob("*.py") if p.stem not in ("__init__",)
    } - {"base"}
    modules = {REGISTRY[name].page_scores.__module__.rsplit(".", 1)[-1] for name in POLICIES}
    assert modules == files, "every policy file defines exactly one registered policy"
    assert POLICIES[0] == "entropy" and len(set(POLICIES)) == len(POLICIES)
    with pytest.raises(ValueError, match="policy must be one of"):
        get_policy("nope")


def test_schema_doc_lists_every_json_key():
    doc = (ROOT / "docs" / "schema.md").read_text()
    documented = set(re.findall(r"^\| `([a-z_]+)` \|", doc, flags=re.M))
    missing = [k for k in json_keys() if k not in documented]
    assert not missing, f"docs/schema.md lacks {missing}"
    extra = documented - set(json_keys())
    assert not extra, f"docs/schema.md documents keys RunResult does not have: {sorted(extra)}"


def test_to_dict_has_exactly_the_schema_keys():
    fields = {name: None for name in json_keys() if name != "kept_tokens"}
    fields.update(stored_tokens=[[5, 5], [7, 7]], tokens=[], answer="")
    res = RunResult(**fields)
    d = res.to_dict()
    assert list(d) == json_keys()
    assert d["kept_tokens"] == [5, 7]
    assert "plan" not in d and "logits" not in d


ENV_READ = re.compile(
    r"(?:environ\.get|getenv|setenv|delenv|environ\.pop|environ\.setdefault)\(\s*"
    r"[\"'](PAGEKV_\w+)|environ\[\s*[\"'](PAGEKV_\w+)"
)


def test_env_variables_are_documented():
    """Every PAGEKV_* environment variable the code or the tests read is named in the
    README (the one list of them)."""
    readme = (ROOT / "README.md").read_text()
    used = set()
    for p in [*ROOT.glob("pagekv/**/*.py"), ROOT / "app.py", *ROOT.glob("tests/*.py")]:
        used |= {a or b for a, b in ENV_READ.findall(p.read_text())}
    assert "PAGEKV_CACHE_DIR" in used, "the pattern finds the variables the code reads"
    undocumented = sorted(v for v in used if v not in readme)
    assert not undocumented, f"README does not document {undocumented}"
