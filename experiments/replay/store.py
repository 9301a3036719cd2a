"""A resumable store of finished units: one JSON object per line in `DIR/units.jsonl`.

A unit is the smallest piece of work whose result is worth keeping (one prompt's
profile-only measurements, one decoded configuration, one peer request). Its key is
a canonical JSON string of what determines the result (model, table, prompt spec,
configuration), so a re-run with the same grid skips it and a changed grid recomputes
only what changed. A line cut short by an interrupted run is ignored.
"""

from __future__ import annotations

import json
import math
from pathlib import Path


def unit_key(**parts) -> str:
    """A canonical key: sorted JSON of the parts (floats as repr, no spaces)."""
    return json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str)


def clean(obj):
    """JSON-safe copy: NaN and inf become None (JSON has no NaN)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean(v) for v in obj]
    return obj


class UnitStore:
    """Finished units of one output folder; `put` appends and flushes at once."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.path = self.folder / "units.jsonl"
        self._data: dict[str, dict] = {}
        self.computed = 0
        self.reused = 0
        self._fresh: set[str] = set()
        if self.path.exists():
            for line in self.path.read_text(encoding="utf-8").splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut short by an interrupted run
                if isinstance(rec, dict) and "key" in rec and "data" in rec:
                    self._data[rec["key"]] = rec["data"]
        self.loaded = len(self._data)

    def __contains__(self, key: str) -> bool:
        return key in self._data

    def get(self, key: str) -> dict:
        """A finished unit; counted as reused when an earlier run computed it."""
        if key not in self._fresh:
            self._fresh.add(key)  # count each key once
            self.reused += 1
        return self._data[key]

    def put(self, key: str, data: dict) -> dict:
        data = clean(data)
        self._data[key] = data
        self._fresh.add(key)
        self.computed += 1
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps({"key": key, "data": data}, separators=(",", ":")) + "\n")
        return data

    def stats(self) -> dict:
        return {"loaded": self.loaded, "computed": self.computed, "reused": self.reused}
