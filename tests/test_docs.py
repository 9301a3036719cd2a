"""The README and the pages it sends readers to say what is: every path and link they
name exists, every Python block in the README and the researcher's page runs as
written, the README stays short, and its findings are the committed results' numbers."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pagekv.paths import REPLAY_RESULTS_PATH, RULER_RESULTS_PATH

from .test_ruler_bench import _means as ruler_means

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RESEARCH = ROOT / "docs" / "research.md"
#: The pages the README's "Where next" sends its three readers to, checked like it.
GUIDES = [README, RESEARCH, ROOT / "docs" / "app.md", ROOT / "docs" / "testing.md"]

LINK = re.compile(r"\]\(([^)\s]+)\)")
#: A path in backticks: words joined by slashes, or a file name with an extension.
CODE_PATH = re.compile(r"`((?:[\w.-]+/)+[\w.-]*|[\w-]+\.(?:py|md|sh|txt|json|jsonl|toml|csv))`")
#: Named paths that are not this repository's: a hub id, kvpress's own registry file
#: (where its docs say to add the press) and the replay's output file.
NOT_OURS = {
    "HuggingFaceTB/SmolLM2-135M-Instruct",
    "evaluation/evaluate_registry.py",
    "results.json",
}


def named_paths(text: str) -> list[str]:
    """The local paths `text` names: markdown links (no web addresses or anchors) and backticked
    file paths (no venvs, home or output folders)."""
    links = [t.split("#")[0] for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]
    codes = [c for c in CODE_PATH.findall(text) if not c.startswith((".venv", "~", "runs/"))]
    return [p for p in links + codes if p and p not in NOT_OURS]


def missing_paths(text: str, folder: Path) -> list[str]:
    """The paths a page in `folder` names that exist neither beside it nor at the repo root."""
    return [p for p in named_paths(text) if not (folder / p).exists() and not (ROOT / p).exists()]


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, re.S)


def test_named_paths_finds_links_and_code_paths_and_skips_the_web():
    text = (
        "See [a](docs/a.md#x), [b](https://example.org/b.md), `pagekv/maths/plan.py`, "
        "`.venv/bin/python`, `app.py`, `--budget 0.2`."
    )
    assert named_paths(text) == ["docs/a.md", "pagekv/maths/plan.py", "app.py"]


@pytest.mark.parametrize("page", GUIDES, ids=lambda p: p.name)
def test_every_path_and_link_a_guide_names_exists(page):
    text = page.read_text()
    assert missing_paths(text, page.parent) == []
    # The check can fail: the same page naming files that are not there.
    bad = text + "\nSee [gone](docs/no_such_page.md) and `pagekv/gone.py`."
    assert missing_paths(bad, page.parent) == ["docs/no_such_page.md", "pagekv/gone.py"]


#: Every other page of docs/ (and the lessons' words), checked with a looser reading: a
#: name is also found where a tracked file's path ends with it (a page names
#: `maxpool.py` beside its folder, or `T4_detail.csv` of a run's folder).
PAGES = sorted(set((ROOT / "docs").rglob("*.md")) - set(GUIDES)) + [
    ROOT / "pagekv" / "app" / "lessons.md"
]
#: What those pages write in backticks that is not a path of this repository: maths
#: (`1/r`), method names (`reconstruct/`), kvpress's own files and a run's output files.
NOT_PATHS = {
    "design.md": {"1/r", "pagekv/kernels"},  # the kernels' installed path
    "method.md": {"1/r"},
    "ruler.md": {"reconstruct/"},
    "schema.md": {"pagekv_run.json", "pagekv_run.csv"},
    "kvpress.md": {
        "tests/presses/test_presses.py", "tests/test_press_call.py", "tests/test_pipeline.py",
        "tests/test_generate.py", "MaxJeblick/llama2-0b-unit-test", "evaluation/evaluate.py",
        "evaluate.py", "evaluation/",
    },
}  # fmt: skip


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    return out.stdout.split() if out.returncode == 0 else []


def unfound_paths(text: str, folder: Path, tracked: list[str], skip=frozenset()) -> list[str]:
    """`missing_paths`, less the names some tracked file's path ends with."""
    return [
        p
        for p in missing_paths(text, folder)
        if p not in skip
        and not any(t == p or t.endswith("/" + p.rstrip("/")) for t in tracked)
        and not (p.endswith("/") and any(f"/{p}" in f"/{t}" for t in tracked))
    ]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_a_docs_page_names_exists(page):
    tracked = tracked_files()
    if not tracked:
        pytest.skip("not a git checkout")
    skip = NOT_PATHS.get(page.name, set())
    text = page.read_text()
    assert unfound_paths(text, page.parent, tracked, skip) == []
    # It can fail: a module that moved keeps no tracked path ending with its old name.
    moved = text + "\nThe grid is `pagekv/replay/grid.py`."
    assert unfound_paths(moved, page.parent, tracked, skip) == ["pagekv/replay/grid.py"]


def test_the_readme_reads_in_two_minutes():
    """At most 150 lines, the two setup commands, and a way on for each reader."""
    text = README.read_text()
    assert len(text.splitlines()) <= 150
    assert "bash scripts/setup.sh && .venv/bin/python app.py" in text
    assert "\nbash .ci/run\n" in text
    for reader, page in (
        ("Teachers", "docs/app.md"),
        ("Researchers", "docs/research.md"),
        ("Contributors", "docs/design.md"),
    ):
        assert f"**{reader}: [{page}]({page}).**" in text


def test_the_ci_script_runs_the_readme_s_test_command():
    """The README's test command is CI's: `.ci/run` installs and runs pytest."""
    script = (ROOT / ".ci" / "run").read_text()
    assert "scripts/setup.sh --dev" in script and "python -m pytest" in script


def _run_block(block: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-"], input=block, text=True, capture_output=True, cwd=ROOT,
        env=env, timeout=600,
    )  # fmt: skip


def test_the_maths_block_runs_as_written_and_prints_what_it_says():
    """The researcher's page's `plan` block: run as written, it prints a keep mask of
    [L, G, n] and kept counts within the budget (floor(0.2 * 256) = 51)."""
    blocks = python_blocks(RESEARCH.read_text())
    maths = next(b for b in blocks if "from pagekv import EvictionConfig, plan" in b)
    out = _run_block(maths)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[0] == "torch.Size([2, 2, 256])"
    kept = [int(x) for x in re.findall(r"\d+", lines[1])]
    assert len(kept) == 4 and all(0 < k <= 51 for k in kept), lines[1]


@pytest.mark.slow
def test_every_python_block_runs_as_written(bundled_study):
    """Every Python block of the README and the researcher's page, run as written from
    the checkout; the model-to-answer example keeps pages and answers right."""
    blocks = python_blocks(README.read_text()) + python_blocks(RESEARCH.read_text())
    assert len(blocks) >= 2
    for block in blocks:
        out = _run_block(block)
        assert out.returncode == 0, (block, out.stderr[-2000:])
        if "runner.evaluate" in block:
            shape, answer = out.stdout.strip().splitlines()[-2:]
            assert re.fullmatch(r"torch\.Size\(\[30, 3, \d+\]\) \[0, [\d, ]+\]", shape), shape
            assert " True [" in answer, answer  # scored right by the task's own scoring


def memory_finding(m: dict) -> str:
    """The README's sentence on RULER at equal memory, from lesson 8's numbers
    (`pagekv.app.lessons.memory_numbers`, read from `RULER_MEMORY_PATH`)."""
    return (
        f"On {m['mem_model']} (RULER, question after, which neither side sees), kvpress's "
        "KVzip against Page-EntroKV scored by the reconstruction pass (pages of 16, one "
        "budget shared by every (layer, KV head)), matched per prompt at equal memory, with "
        "95 % intervals: where the cache gathers what it keeps (pagekv's own decode pool, "
        f"KVzip's cache), {m['mem_gathered']}; where a paged cache frees whole pages in "
        f"place, {m['mem_in_place']}; where every KV head of a layer gets the fullest "
        f"one's pages, {m['mem_uniform']}"
    )


def test_the_readme_s_findings_are_the_committed_results():
    """Each number of the README's "What was found" comes from the file it cites."""
    from pagekv.app.lessons import ruler_numbers, search_numbers

    readme = " ".join(README.read_text().split())
    t1 = json.loads(REPLAY_RESULTS_PATH.read_text())["tables"]["T1_uor"]
    uor = max(r["uor_max"] for r in t1 if r["uor_max"] is not None)
    assert f"up to {uor:.2f}x the budget of a possible 3x" in readme
    s = search_numbers()
    assert (
        f"different right/wrong verdicts on {s['search_differ']} of {s['search_measured']} "
        f"prompt-settings: mean alone right on {s['search_mean']}, entropy alone on "
        f"{s['search_entropy']}"
    ) in readme
    from pagekv.app.lessons import memory_numbers

    assert memory_finding(memory_numbers()) in readme
    ruler = (ROOT / "docs" / "ruler.md").read_text()
    inside = ruler_means(ruler, "inside", model="qwen-coder-0.5b")
    after = ruler_means(ruler, "after", model="qwen-coder-0.5b")
    assert inside["mean 10%"] == inside["entropy 10%"]  # "both score"
    assert f"both score {inside['mean 10%']} at 10 % of the tokens, the full cache " \
        f"{inside['full']}" in readme  # fmt: skip
    assert f"the same two score {after['mean 10%']} and {after['entropy 10%']} at 10 %" in readme
    from pagekv.app.lessons import capacity_numbers

    c = capacity_numbers()
    assert (
        f"entropy at 20 % held {c['cap_held_e20']} sequences at once against "
        f"{c['cap_held_full']}, and the batched decode made {c['cap_tps_x20']}x the full "
        f"cache's tokens per second on the bundled model ({c['cap_run_x20']}x for the whole "
        f"run with its prefills), on a 2-core CPU; answers right fell from {c['cap_ok_full']} "
        f"to {c['cap_ok_e20']}"
    ) in readme
    rows = [json.loads(x) for x in RULER_RESULTS_PATH.read_text().splitlines() if x]
    r = ruler_numbers(rows)
    assert r["ruler_press_mean"] == r["ruler_press_entropy"]  # "both poolings"
    assert (
        f"KVzip scores {r['ruler_press_kvzip']} at 10 % (the full cache "
        f"{r['ruler_press_full']}, both poolings {r['ruler_press_mean']}), but its kept "
        f"tokens touch at least {r['ruler_kvzip_pages']} % of the prompt's 16-token pages"
    ) in readme


def test_the_replay_s_page_is_the_tables_of_the_results_the_app_reads():
    """docs/results.md is what the replay writes as its tables.md for the committed
    results (`REPLAY_RESULTS_PATH`), heading and command included."""
    from experiments.replay.report import tables_markdown

    results = json.loads(REPLAY_RESULTS_PATH.read_text())
    page = (ROOT / "docs" / "results.md").read_text()
    assert page == tables_markdown(results)
    assert page.startswith("# The replay's tables: the `full` grid on `bundled`")
    assert f"Made by `{results['meta']['command']}`" in page
