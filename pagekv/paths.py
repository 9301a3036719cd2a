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
