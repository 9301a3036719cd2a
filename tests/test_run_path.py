"""One app run's path (`scripts/run_path.py`): at most `MAX_FILES` files, and the library never
calls back into the app except the token callback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_FILES = 30
#: The one call the library may make into the app: the greedy decode's `on_token`.
TOKEN_CALLBACK = "pagekv/runtime/decode.py:greedy -> "

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def path() -> dict:
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "run_path.py"), "--json"],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_one_run_enters_few_files_from_the_handler_to_the_answer(path):
    files = list(path["files"])
    assert len(files) <= MAX_FILES, "\n".join(files)
    # It is the whole run: the page's handler, the engine, the maths, the decode, a figure.
    for needed in ("pagekv/app/handlers.py", "pagekv/engine/study.py", "pagekv/maths/plan.py",
                   "pagekv/runtime/decode.py", "pagekv/app/figures/eviction.py"):  # fmt: skip
        assert needed in files, needed


def test_the_library_never_calls_back_into_the_app(path):
    climbs = {k: v for k, v in path["climbs"].items() if not k.startswith(TOKEN_CALLBACK)}
    assert climbs == {}, climbs
