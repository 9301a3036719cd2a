"""Where the project's files are: the one place asset paths are written.

`assets/` sits beside the `pagekv` package in the repository (and in a Space). The
wheel holds the prompts' data of it (the haystack and the curated tasks) as
`pagekv/assets`, which is read where it exists.
"""

from __future__ import annotations

from pathlib import Path

#: The repository root (the folder that holds `pagekv/`, `assets/`, `app.py`).
ROOT = Path(__file__).resolve().parents[1]
_INSTALLED_ASSETS = Path(__file__).resolve().parent / "assets"
ASSETS_DIR = _INSTALLED_ASSETS if _INSTALLED_ASSETS.is_dir() else ROOT / "assets"
#: Presets measured by the replay (`python -m pagekv replay --update-presets`).
PRESETS_PATH = ASSETS_DIR / "presets.json"
#: The app's stylesheet.
CSS_PATH = ASSETS_DIR / "app.css"
#: The CC0 haystack text and the curated task sets.
HAYSTACK_DIR = ASSETS_DIR / "haystack"
TASKS_DIR = ASSETS_DIR / "tasks"
#: The committed results the app's lessons read (a command writes each; see docs/research.md).
RESULTS_DIR = ASSETS_DIR / "results"
#: The replay's full grid (`python -m pagekv replay --model bundled`, its `results.json`).
REPLAY_RESULTS_PATH = RESULTS_DIR / "replay.json"
#: Mean against entropy pooling on qwen-coder-0.5b (`python experiments/pooling_search.py`):
#: its rows (one JSON line per prompt and setting) and their summary.
POOLING_SEARCH_ROWS_PATH = RESULTS_DIR / "pooling_search.jsonl"
POOLING_SEARCH_PATH = RESULTS_DIR / "pooling_search.json"
#: RULER on lm-eval's task code (`python experiments/ruler.py`): one JSON line per answer.
RULER_RESULTS_PATH = RESULTS_DIR / "ruler.jsonl"
#: The comparison at equal memory of those answers (`experiments/ruler.py --figure`).
RULER_MEMORY_PATH = RESULTS_DIR / "ruler_memory.json"
#: What a fixed pool holds and decodes per budget (benchmarks/bench_capacity.py writes it).
CAPACITY_RESULTS_PATH = RESULTS_DIR / "capacity.json"
