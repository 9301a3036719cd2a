"""Curated QA and code tasks shipped in ``assets/tasks/{qa,code}.json``.

Each record names a context file (original CC0 text or code under
``assets/tasks/``), a question, a short answer, aliases, the ``evidence``
(the exact sentence or code fragment holding the answer, which becomes
``Task.needle_text``) and a ``difficulty`` guess for a ~100M-parameter model.
Loading checks that the evidence occurs in the context and the answer in the
evidence, so the set stays honest.

Every curated task is a baseline: the bundled model (SmolLM2-135M-Instruct)
answers it correctly with the full cache, in each question mode it lists.
Two fields say how it is run:

- ``max_new_tokens`` (required): answer tokens to decode. The model restates
  the question before the answer ("The default port in `ServerConfig` is
  7341."), so it is the tokens the full-cache answer needed before it held the
  expected answer, measured on the bundled model, plus 8; it is also at least
  the answer's own length plus 2. ``default_max_new_tokens(task)`` reads it.
- ``modes`` (optional, default both): the question modes ("inside", "after")
  the task is meant for (``meta["modes"]``; the first is the default
  ``question_position``). With the full cache both modes decode from the same
  token sequence; measured, they give the same answer on every task.

``tests/test_baselines.py`` checks both fields on the model.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from pagekv.paths import ASSETS_DIR, TASKS_DIR
from pagekv.tasks.base import QUESTION_POSITIONS, Task, TaskError

CURATED_KINDS = ("qa", "code")
DIFFICULTIES = ("easy", "medium", "hard")


@lru_cache(maxsize=4)
def _records(kind: str) -> tuple[dict[str, Any], ...]:
    path = TASKS_DIR / f"{kind}.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise TaskError(f"task file not found: {path}") from exc
    except json.JSONDecodeError as exc:
        raise TaskError(f"task file {path} is not valid JSON: {exc}") from exc
    out = []
    for rec in data.get("tasks", []):
        rec = dict(rec)
        ctx_path = TASKS_DIR / rec.pop("context_file")
        text = ctx_path.read_text(encoding="utf-8")
        # prose: no trailing whitespace (it would glue onto the prompt's "\n\n");
        # code: exactly one final newline before the closing fence
        rec["context"] = text.strip() if kind == "qa" else text.rstrip() + "\n"
        rec["context_file"] = str(ctx_path.relative_to(ASSETS_DIR))
        out.append(rec)
    return tuple(out)


def _to_task(kind: str, rec: dict[str, Any]) -> Task:
    name = rec.get("name", "?")
    evidence = rec["evidence"]
    if not any(a in evidence for a in [rec["answer"], *rec.get("aliases", [])]):
        raise TaskError(f"curated task {name!r}: the answer is not in its evidence")
    if rec.get("difficulty") not in DIFFICULTIES:
        raise TaskError(f"curated task {name!r}: difficulty must be one of {DIFFICULTIES}")
    if "max_new_tokens" not in rec:
        raise TaskError(f"curated task {name!r}: max_new_tokens is missing")
    modes = list(rec.get("modes", QUESTION_POSITIONS))
    if not modes or any(m not in QUESTION_POSITIONS for m in modes):
        raise TaskError(
            f"curated task {name!r}: modes must be a non-empty subset of "
            f"{QUESTION_POSITIONS}; got {modes}"
        )
    return Task(
        name=name,
        kind=kind,
        context=rec["context"],
        question=rec["question"],
        answer=rec["answer"],
        aliases=list(rec.get("aliases", [])),
        needle_text=evidence,  # Task checks that it occurs in the context
        meta={
            "difficulty": rec["difficulty"],
            "context_file": rec["context_file"],
            "question_position": modes[0],
            "modes": modes,
        },
        max_new_tokens=rec["max_new_tokens"],  # Task checks it is an integer >= 1
    )


def load_tasks(kind: str = "all") -> list[Task]:
    """All curated tasks of a kind: "qa", "code" or "all" (fresh objects each call)."""
    kinds = CURATED_KINDS if kind == "all" else (kind,)
    if any(k not in CURATED_KINDS for k in kinds):
        raise TaskError(f"curated task kind must be one of {CURATED_KINDS} or 'all'")
    return [_to_task(k, rec) for k in kinds for rec in _records(k)]


def task_names(kind: str = "all") -> list[str]:
    """Names of the curated tasks, in file order."""
    return [t.name for t in load_tasks(kind)]


def curated_name(kind: str, name: str | None) -> str:
    """The curated task of `kind` ("qa" or "code") that `name` designates (None: the
    first); TaskError listing that kind's names for any other name."""
    names = task_names(kind)
    if name is None or name == "":
        return names[0]
    if name not in names:
        raise TaskError(f"unknown {kind} task {name!r}; choose from {', '.join(names)}")
    return name


def get_task(name: str) -> Task:
    """One curated task by name; TaskError listing the valid names otherwise."""
    for task in load_tasks("all"):
        if task.name == name:
            return task
    raise TaskError(f"no curated task named {name!r}; known: {', '.join(task_names())}")
