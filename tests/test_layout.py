"""The architecture as checks (docs/design.md, "Layers"): what each layer may import, kernels free
of `pagekv`, one policy list, the schema written down. Every rule has a negative control on a
tree planted in `tmp_path`."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

from pagekv.maths.policies import POLICIES, REGISTRY, get_policy
from pagekv.runtime.result import RunResult, json_keys

ROOT = Path(__file__).resolve().parents[1]

#: The folders of `pagekv/`, bottom up (docs/design.md, "Layers"): the library's layers,
#: then the app's own part.
LAYERS = ("maths", "runtime", "tasks", "integrations", "engine", "app")
_EVERY_LAYER = {f"pagekv.{name}" for name in LAYERS} | {"pagekv.paths"}
#: The `pagekv` modules each layer folder (or top-level module) may import, module level
#: or lazily (a name allows its submodules). A folder or top-level module missing here
#: is a violation: a new place needs a rule first.
ALLOWED = {
    "maths": {"pagekv.maths"},
    "runtime": {"pagekv.maths", "pagekv.runtime", "pagekv.kernels"},
    "tasks": {"pagekv.paths", "pagekv.tasks"},
    # The kvpress press and the lm-eval model: the library's, never the app's parts.
    "integrations": {"pagekv.maths", "pagekv.runtime", "pagekv.integrations"},
    # The comparison engine (the worker, its memos, `Study`, the comparison): the library
    # below it and nothing a person sees (figures, lessons, the page's handlers).
    "engine": {"pagekv.maths", "pagekv.runtime", "pagekv.tasks", "pagekv.paths", "pagekv.engine"},
    "app": _EVERY_LAYER - {"pagekv.integrations"},
    "paths.py": set(),
    "progress.py": set(),
    "__init__.py": {"pagekv.maths"},  # the rest of the public names load on first use
    "cli.py": {"pagekv"},
    "__main__.py": {"pagekv"},
}
FRAMEWORKS = {"transformers", "gradio", "plotly", "triton", "gguf", "kvpress"}
#: Frameworks a layer never imports, at module level or lazily.
FORBIDDEN = {
    "maths": FRAMEWORKS,
    "runtime": {"gradio", "plotly"},
    "tasks": {"gradio", "plotly"},
    "integrations": {"gradio", "plotly"},
    "engine": {"gradio", "plotly"},
}
#: The research harness (experiments/, outside the wheel): only the command line's
#: `replay` reaches it, lazily, from a checkout.
HARNESS = "experiments"
HARNESS_USERS = {"cli.py"}
#: The app's serving parts below its views: the model registry, the sessions and the
#: allocator import only the library, the engine and `pagekv.paths`; never what a person
#: sees (figures, lessons, the page's handlers), gradio or plotly.
SERVING = ("allocator", "model_registry", "sessions")
SERVING_ALLOWED = {
    "pagekv.maths",
    "pagekv.runtime",
    "pagekv.tasks",
    "pagekv.paths",
    "pagekv.engine",
} | {f"pagekv.app.{m}" for m in SERVING}
#: Inside the app: where gradio and plotly may be imported (a path, or a folder
#: ending in "/"). gradio belongs to the page's handlers only.
VIEWS_ONLY = {
    "gradio": (
        "pagekv/app/handlers.py",
        "pagekv/app/lesson_handlers.py",
        "pagekv/app/page_assets.py",  # the theme
    ),
    "plotly": ("pagekv/app/figures/",),
}
#: Third-party packages the maths may import at module level (besides the stdlib).
MATHS_THIRD_PARTY = {"torch"}
#: Modules (and packages) directly in `pagekv/` besides `__init__` and `__main__`.
MAX_TOP_MODULES = 9


def _pyfiles(root: Path, folder: str = "pagekv") -> list[str]:
    return sorted(str(p.relative_to(root)) for p in (root / folder).rglob("*.py"))


def _module_exists(root: Path, name: str) -> bool:
    if name == "pagekv.kernels" or name.startswith("pagekv.kernels."):
        name = name.removeprefix("pagekv.")  # the top-level kernels/ (pagekv/__init__.py)
    base = root.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _import_module_arg(node: ast.AST) -> str | None:
    """The string constant given to `importlib.import_module(...)`, if any."""
    if not isinstance(node, ast.Call) or not node.args:
        return None
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    arg = node.args[0]
    if name == "import_module" and isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    return None


def _imports(root: Path, rel: str) -> list[tuple[str, int, bool]]:
    """`(module, line, lazy)` for every absolute import (lazy ones included) and
    `import_module("...")` string; `from a.b import c` is `a.b.c` when a module."""
    found: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, lazy: bool) -> None:
        if isinstance(node, ast.Import):
            found.extend((a.name, node.lineno, lazy) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                mod = sub if _module_exists(root, sub) else node.module
                found.append((mod, node.lineno, lazy))
        elif (target := _import_module_arg(node)) is not None:
            found.append((target, node.lineno, True))
        inner = lazy or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(ast.parse((root / rel).read_text()), False)
    return found


def _place(rel: str) -> str:
    """`pagekv/maths/plan.py` -> `maths`; `pagekv/paths.py` -> `paths.py`."""
    return Path(rel).parts[1]


def _within(module: str, names) -> bool:
    return any(module == a or module.startswith(a + ".") for a in names)


def _is_serving(rel: str) -> bool:
    return rel in {f"pagekv/app/{m}.py" for m in SERVING}


def _layer_violations(root: Path, rel: str) -> list[str]:
    """The `pagekv` imports of one file that its layer does not allow."""
    place = _place(rel)
    if place not in ALLOWED:
        return [f"{rel}: {place} is not a declared layer (add its rule to ALLOWED)"]
    bad = []
    for mod, line, lazy in _imports(root, rel):
        if _within(mod, {HARNESS}) and not (place in HARNESS_USERS and lazy):
            bad.append(f"{rel}:{line} imports {mod}, the research harness")
            continue
        if mod != "pagekv" and not mod.startswith("pagekv."):
            continue
        if _is_serving(rel) and not _within(mod, SERVING_ALLOWED):
            why = " (lazily)" if lazy else ""
            bad.append(f"{rel}:{line} imports {mod}{why}, not the serving parts'")
            continue
        if _within(mod, ALLOWED[place]):
            continue
        bad.append(f"{rel}:{line} imports {mod}{' (lazily)' if lazy else ''}")
    return bad


def _framework_violations(root: Path, rel: str) -> list[str]:
    """Frameworks a file imports that its layer forbids (anywhere in the file), and for
    the maths any module-level third-party import but torch."""
    place = _place(rel)
    bad = []
    for mod, line, lazy in _imports(root, rel):
        top = mod.split(".")[0]
        if top in FORBIDDEN.get(place, ()):
            bad.append(f"{rel}:{line} imports {mod}")
        elif place == "app" and top in VIEWS_ONLY and not rel.startswith(VIEWS_ONLY[top]):
            bad.append(f"{rel}:{line} imports {mod} (the app imports it only in {VIEWS_ONLY[top]})")
        elif (
            place == "maths"
            and not lazy
            and top not in sys.stdlib_module_names
            and top not in MATHS_THIRD_PARTY | {"pagekv"}
        ):
            bad.append(f"{rel}:{line} imports {mod} at module level (the maths: torch only)")
    return bad


def _relative_imports(root: Path, rel: str) -> list[str]:
    tree = ast.parse((root / rel).read_text())
    return [
        f"{rel}:{node.lineno} from {'.' * node.level}{node.module or ''}"
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.level
    ]


def _dynamic_targets(root: Path, rel: str) -> list[tuple[str, int]]:
    """Modules imported by string: `import_module` constants and `_LAZY` values."""
    tree = ast.parse((root / rel).read_text())
    package = ".".join(Path(rel).with_suffix("").parts)
    package = package.removesuffix(".__init__")
    out = [
        (t, node.lineno)
        for node in ast.walk(tree)
        if (t := _import_module_arg(node)) is not None and t.split(".")[0] == "pagekv"
    ]
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "_LAZY" for t in node.targets)
            and isinstance(node.value, ast.Dict)
            and rel.endswith("__init__.py")
        ):
            for v in node.value.values:
                if isinstance(v, ast.Constant) and isinstance(v.value, str):
                    name = v.value if v.value.startswith("pagekv.") else f"{package}.{v.value}"
                    out.append((name, v.lineno))
    return out


def _missing_modules(root: Path, rel: str) -> list[str]:
    return [
        f"{rel}:{line} names {name}, which does not exist"
        for name, line in _dynamic_targets(root, rel)
        if not _module_exists(root, name)
    ]


def _top_modules(root: Path) -> list[str]:
    """Modules and packages directly in `pagekv/`, `__init__` and `__main__` aside."""
    top = root / "pagekv"
    files = [p.stem for p in top.glob("*.py") if p.stem not in ("__init__", "__main__")]
    packages = [p.name for p in top.iterdir() if (p / "__init__.py").is_file()]
    return sorted(files + packages)


def _plant(root: Path, rel: str, text: str) -> str:
    """Write `text` at `root/rel` with the package `__init__.py` files above it."""
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    for parent in path.relative_to(root).parents:
        if str(parent) != "." and not (root / parent / "__init__.py").exists():
            (root / parent / "__init__.py").write_text("")
    return rel


PLACES = sorted({_place(rel) for rel in _pyfiles(ROOT)})


def _files_of(place: str) -> list[str]:
    return [rel for rel in _pyfiles(ROOT) if _place(rel) == place]


def test_the_layers_are_the_folders():
    folders = {p.name for p in (ROOT / "pagekv").iterdir() if (p / "__init__.py").is_file()}
    assert folders == set(LAYERS), "every folder of pagekv/ is a layer with its rules"


@pytest.mark.parametrize("place", PLACES)
def test_layer_imports_stay_in_their_layer(place):
    bad = [v for rel in _files_of(place) for v in _layer_violations(ROOT, rel)]
    assert not bad, "imports outside the layer's allowed set:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    ("rel", "text"),
    [
        ("pagekv/maths/x.py", "def f():\n    from pagekv.engine.study import Study\n"),
        ("pagekv/maths/plan.py", "def f():\n    from pagekv.runtime.backend import pooler\n"),
        ("pagekv/maths/x.py", "def f():\n    from pagekv.runtime.backend import compact_layers\n"),
        ("pagekv/maths/x.py", "def f():\n    from pagekv.kernels.score import score_layers\n"),
        ("pagekv/app/x.py", "import pagekv.kernels.compact\n"),
        ("pagekv/runtime/x.py", "from pagekv.app import worker\n"),
        ("pagekv/tasks/x.py", "from pagekv.maths.config import EvictionConfig\n"),
        ("pagekv/engine/worker.py", "import pagekv.app.figures\n"),
        ("pagekv/engine/study.py", "def f():\n    from pagekv.app.lessons import LESSONS\n"),
        ("pagekv/app/x.py", "def f():\n    import experiments.replay\n"),
        ("pagekv/integrations/x.py", "from pagekv.cli import main\n"),
        ("pagekv/integrations/x.py", "def f():\n    from pagekv.engine.study import Study\n"),
        ("pagekv/cli.py", "import experiments.replay\n"),
        ("pagekv/paths.py", "from pagekv.tasks import base\n"),
        ("pagekv/__init__.py", "from pagekv.runtime.runner import Runner\n"),
        ("pagekv/newlayer/x.py", "import torch\n"),
        (
            "pagekv/runtime/x.py",
            "import importlib\ndef f():\n    importlib.import_module('pagekv.engine.memo')\n",
        ),
    ],
)
def test_the_check_finds_a_layer_violation(tmp_path, rel, text):
    """A reach above the layer, module level or lazy (`plan` reaching for the runtime's
    pooling step included), an undeclared folder, an import by string."""
    _plant(tmp_path, rel, text)
    assert len(_layer_violations(tmp_path, rel)) == 1


def test_a_reach_within_the_layer_passes_the_check(tmp_path):
    rel = _plant(tmp_path, "pagekv/runtime/x.py",
                 "def f():\n    from pagekv.maths.policies import max_pool\n")  # fmt: skip
    assert _layer_violations(tmp_path, rel) == []


@pytest.mark.parametrize("place", PLACES)
def test_layer_frameworks(place):
    bad = [v for rel in _files_of(place) for v in _framework_violations(ROOT, rel)]
    assert not bad, "frameworks the layer does not import:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    ("rel", "text"),
    [
        ("pagekv/maths/x.py", "import transformers\n"),
        ("pagekv/maths/x.py", "import numpy\n"),
        ("pagekv/runtime/x.py", "def f():\n    import plotly.graph_objects\n"),
        ("pagekv/app/x.py", "import gradio as gr\n"),
        ("pagekv/tasks/x.py", "from plotly import io\n"),
        ("pagekv/engine/comparison.py", "import gradio as gr\n"),
        ("pagekv/app/lessons.py", "import plotly\n"),
    ],
)
def test_the_check_finds_a_framework(tmp_path, rel, text):
    _plant(tmp_path, rel, text)
    assert len(_framework_violations(tmp_path, rel)) == 1


def test_the_framework_check_allows_their_places(tmp_path):
    a = _plant(tmp_path, "pagekv/app/figures/x.py", "def f():\n    import plotly.io\n")
    b = _plant(tmp_path, "pagekv/app/handlers.py", "import gradio as gr\n")
    c = _plant(tmp_path, "pagekv/maths/x.py", "import math\nimport torch\n")
    assert [v for rel in (a, b, c) for v in _framework_violations(tmp_path, rel)] == []


def test_no_relative_imports():
    bad = [v for rel in _pyfiles(ROOT) for v in _relative_imports(ROOT, rel)]
    assert not bad, "pagekv uses absolute imports only:\n" + "\n".join(bad)


def test_the_check_finds_a_relative_import(tmp_path):
    rel = _plant(tmp_path, "pagekv/maths/x.py", "from . import entropy\nfrom .paging import x\n")
    assert len(_relative_imports(tmp_path, rel)) == 2


def test_modules_imported_by_name_exist():
    bad = [v for rel in _pyfiles(ROOT) for v in _missing_modules(ROOT, rel)]
    assert not bad, "\n".join(bad)
    named = {name for rel in _pyfiles(ROOT) for name, _ in _dynamic_targets(ROOT, rel)}
    assert "pagekv.runtime.backend" in named, "the check reads pagekv/__init__.py's _LAZY"


def test_the_check_finds_a_missing_module(tmp_path):
    _plant(tmp_path, "pagekv/runtime/backend.py", "")
    a = _plant(tmp_path, "pagekv/integrations/x.py",
               "import importlib\nimportlib.import_module('pagekv.peer.gone')\n"
               "importlib.import_module('pagekv.runtime.backend')\n")  # fmt: skip
    b = _plant(tmp_path, "pagekv/__init__.py",
               "_LAZY = {'A': 'pagekv.runner', 'b': 'pagekv.runtime.backend'}\n")  # fmt: skip
    c = _plant(tmp_path, "pagekv/app/__init__.py", "_LAZY = {'X': 'nowhere', 'Y': 'x'}\n")
    _plant(tmp_path, "pagekv/app/x.py", "")
    assert [len(_missing_modules(tmp_path, rel)) for rel in (a, b, c)] == [1, 1, 1]


def test_few_modules_at_the_top():
    top = _top_modules(ROOT)
    assert len(top) <= MAX_TOP_MODULES, f"pagekv/ holds {len(top)} modules directly: {top}"


def test_the_check_counts_top_modules(tmp_path):
    for i in range(MAX_TOP_MODULES - 1):
        _plant(tmp_path, f"pagekv/m{i}.py", "")
    _plant(tmp_path, "pagekv/__main__.py", "")
    _plant(tmp_path, "pagekv/layer/x.py", "")
    assert len(_top_modules(tmp_path)) == MAX_TOP_MODULES
    _plant(tmp_path, "pagekv/one_too_many.py", "")
    assert len(_top_modules(tmp_path)) == MAX_TOP_MODULES + 1


def _type_checking_lines(tree: ast.AST) -> set[int]:
    """The lines of `if TYPE_CHECKING:` blocks (imports for annotations only)."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def _import_cycles(root: Path) -> list[list[str]]:
    """The import cycles among the modules of `pagekv/` (module level or lazy; not the
    imports for annotations), as the sorted modules of each strongly connected part."""
    mods = {}
    for rel in _pyfiles(root):
        name = rel[:-3].replace("/", ".").removesuffix(".__init__")
        mods[name] = rel
    graph: dict[str, set[str]] = {}
    for name, rel in mods.items():
        skip = _type_checking_lines(ast.parse((root / rel).read_text()))
        deps = set()
        for mod, line, _ in _imports(root, rel):
            parts = mod.split(".")
            while parts and ".".join(parts) not in mods:
                parts.pop()
            target = ".".join(parts)
            if parts and line not in skip and not (name + ".").startswith(target + "."):
                deps.add(target)
        graph[name] = deps
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while (w := stack.pop()) != v:
                part.append(w)
            if part:
                cycles.append(sorted([v, *part]))

    for v in graph:
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycles():
    """No two modules of pagekv import each other, even lazily (model loading's errors
    live in `runtime/model_errors.py`, below `models` and `gguf_parts`)."""
    assert _import_cycles(ROOT) == []


def test_the_check_finds_an_import_cycle(tmp_path):
    _plant(tmp_path, "pagekv/runtime/a.py", "from pagekv.runtime.b import x\n")
    _plant(tmp_path, "pagekv/runtime/b.py", "def f():\n    from pagekv.runtime.a import y\n")
    _plant(tmp_path, "pagekv/runtime/c.py", "from pagekv.runtime.a import z\n")
    # d and e import each other, but d only for its annotations: no cycle.
    typed = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pagekv.runtime.e\n"
    _plant(tmp_path, "pagekv/runtime/d.py", typed)
    _plant(tmp_path, "pagekv/runtime/e.py", "import pagekv.runtime.d\n")
    assert _import_cycles(tmp_path) == [["pagekv.runtime.a", "pagekv.runtime.b"]]


def _pagekv_in_kernels(root: Path, rel: str) -> list[str]:
    return sorted(m for m, _, _ in _imports(root, rel) if m == "pagekv" or m.startswith("pagekv."))


@pytest.mark.parametrize("rel", _pyfiles(ROOT, "kernels"))
def test_kernels_import_nothing_from_pagekv(rel):
    found = _pagekv_in_kernels(ROOT, rel)
    assert not found, f"{rel} imports {found}"


def test_the_check_finds_pagekv_in_kernels(tmp_path):
    rel = _plant(tmp_path, "kernels/x.py", "def f():\n    from pagekv.maths import paging\n")
    assert _pagekv_in_kernels(tmp_path, rel) == ["pagekv.maths"]


#: benchmarks/ and experiments/ stand on the library; neither imports the other (what
#: both need lives in `pagekv`, or is copied).
HARNESSES = ("benchmarks", "experiments")


def _harness_names(root: Path, folder: str) -> set[str]:
    """The names `folder`'s code is imported by: the package, and the bare name of each of
    its scripts and subpackages (a script's own folder is on `sys.path` when it runs)."""
    top = root / folder
    scripts = {p.stem for p in top.glob("*.py") if p.stem != "__init__"}
    return {folder} | scripts | {p.name for p in top.iterdir() if (p / "__init__.py").is_file()}


def _cross_imports(root: Path, rel: str) -> list[str]:
    """The modules of the other harness that `rel` (a file of one of them) imports."""
    (other,) = (h for h in HARNESSES if h != rel.split("/")[0])
    names = _harness_names(root, other)
    return sorted({m for m, _, _ in _imports(root, rel) if m.split(".")[0] in names})


@pytest.mark.parametrize("rel", [r for h in HARNESSES for r in _pyfiles(ROOT, h)])
def test_benchmarks_and_experiments_do_not_import_each_other(rel):
    found = _cross_imports(ROOT, rel)
    assert not found, f"{rel} imports {found}"


def test_the_check_finds_a_cross_import(tmp_path):
    _plant(tmp_path, "experiments/replay/tables.py", "def quantile(xs, q): ...\n")
    _plant(tmp_path, "benchmarks/bench_decode.py", "def cpu_facts(): ...\n")
    lazy = "def f():\n    from experiments.replay.tables import quantile\n"
    assert _cross_imports(tmp_path, _plant(tmp_path, "benchmarks/a.py", lazy)) == [
        "experiments.replay.tables"
    ]
    bare = "import bench_decode\nfrom pagekv import plan\n"
    assert _cross_imports(tmp_path, _plant(tmp_path, "experiments/b.py", bare)) == ["bench_decode"]
    own = "from experiments.replay.tables import quantile\n"
    assert _cross_imports(tmp_path, _plant(tmp_path, "experiments/c.py", own)) == []


#: A citation of a section of the design document: `docs/design.md, "The data path"`.
DESIGN_CITATION = re.compile(r'docs/design\.md[^"\n]{0,20}"([^"\n]+)"')
#: The original brief lives outside the repository; nothing cites it.
OUTSIDE_BRIEF = "DESIGN" + ".md"


def _citing_files(root: Path) -> list[Path]:
    globs = ("pagekv/**/*.py", "kernels/*.py", "tests/*.py", "benchmarks/*.py", "docs/*.md")
    return sorted({p for g in globs for p in root.glob(g)} | {root / "app.py", root / "README.md"})


def _bad_citations(root: Path) -> list[str]:
    doc = root / "docs" / "design.md"
    headings = set(re.findall(r"^## (.+?)\s*$", doc.read_text(), flags=re.M))
    bad = []
    for p in _citing_files(root):
        if not p.is_file() or p.name == Path(__file__).name:  # this file plants examples
            continue
        text = p.read_text()
        rel = p.relative_to(root)
        bad += [f"{rel}: cites {OUTSIDE_BRIEF}" for _ in [0] if OUTSIDE_BRIEF in text]
        bad += [
            f'{rel}: no section "{h}"' for h in DESIGN_CITATION.findall(text) if h not in headings
        ]
    return bad


def test_design_citations_name_a_section():
    """Every citation of a section of docs/design.md names one of its headings, and
    nothing cites the brief outside the repository."""
    assert DESIGN_CITATION.findall((ROOT / "pagekv" / "__init__.py").read_text())
    bad = _bad_citations(ROOT)
    assert not bad, "\n".join(bad)


def test_the_check_finds_a_bad_citation(tmp_path):
    _plant(tmp_path, "docs/design.md", "# Design\n\n## The data path\n\ntext\n")
    _plant(tmp_path, "pagekv/maths/a.py", '"""(docs/design.md, "The data path")."""\n')
    assert _bad_citations(tmp_path) == []
    _plant(tmp_path, "pagekv/maths/b.py", '"""docs/design.md ("Layers")."""\n')
    _plant(tmp_path, "tests/test_x.py", "# " + OUTSIDE_BRIEF + " section 2\n")
    assert len(_bad_citations(tmp_path)) == 2


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
        if p.name != "policies.py" and (lines := _policy_name_lists(p))
    }
    assert not offenders, f"policy lists written outside pagekv/maths/policies: {offenders}"


def test_the_check_finds_a_policy_list(tmp_path):
    """The detector above is not vacuous: it flags a hand-written list."""
    f = tmp_path / "x.py"
    f.write_text('CHOICES = ("entropy", "mean", "max")\nOTHER = ("entropy", "x")\n')
    assert _policy_name_lists(f) == [1]


def test_the_registry_holds_every_policy_once():
    assert POLICIES[0] == "entropy" and len(set(POLICIES)) == len(POLICIES)
    assert all(REGISTRY[name].name == name for name in POLICIES)
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
    """Every PAGEKV_* variable the code or tests read is named in docs/testing.md."""
    readme = (ROOT / "docs" / "testing.md").read_text()
    used = set()
    for p in [*ROOT.glob("pagekv/**/*.py"), ROOT / "app.py", *ROOT.glob("tests/*.py")]:
        used |= {a or b for a, b in ENV_READ.findall(p.read_text())}
    assert "PAGEKV_CACHE_DIR" in used, "the pattern finds the variables the code reads"
    undocumented = sorted(v for v in used if v not in readme)
    assert not undocumented, f"docs/testing.md does not document {undocumented}"
