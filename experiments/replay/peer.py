"""The kvpress peer behind a small adapter, so the replay runs whether or not it works.

The bridge itself is `experiments.peer.kvpress_peer` (kvpress runs in its own environment
on the converted bundled model, fed the very token ids the replay uses). This adapter
only imports it, asks whether it can run, sends one batch of requests and turns every
failure (module missing, kvpress not installable, a request error) into a recorded
reason: `{"available": False, "reason": ...}` in results.json.

Besides kvpress's presses the replay runs pagekv's own presses through kvpress
(`pagekv_entropy` = `PageEntroKVPress`, `pagekv_mean` = `MeanPoolPagePress`, from
`pagekv.integrations.kvpress_press`) at the replay's default geometry (pages of 16,
window 32), so T4 and T6 compare every method in one pipeline.
"""

from __future__ import annotations

import importlib
import logging

from pagekv.runtime.messages import one_line

log = logging.getLogger(__name__)

#: kvpress's presses the replay asks for, in the bridge's `PRESSES` spelling.
KVPRESS_WANTED = ("snapkv", "expected_attention", "knorm", "streaming_llm", "kvzip", "keydiff")
#: pagekv's presses run inside kvpress (the bridge's `PAGEKV_PRESSES`).
PAGEKV_WANTED = ("pagekv_entropy", "pagekv_mean")
#: Every press the replay asks for.
WANTED = KVPRESS_WANTED + PAGEKV_WANTED
#: SnapKV's observation window set to ours (32); its default of 64 differs. pagekv's
#: presses at the runner's default geometry (EvictionConfig: pages of 16, window 32).
_GEOMETRY = {"page_size": 16, "window": 32, "n_sink": 4, "tau": 1.0}
PRESS_KWARGS = {"snapkv": {"window_size": 32}} | {p: dict(_GEOMETRY) for p in PAGEKV_WANTED}


class PeerAdapter:
    """`status()` -> {"available", "reason", "presses"}; `run(requests)` -> results."""

    def __init__(self, enabled: bool, quick: bool, model_dir=None, progress=None):
        self.enabled = enabled
        self.quick = quick
        self.model_dir = model_dir
        self.progress = progress or (lambda msg: log.info("%s", msg))
        self.module = None
        self.available = False
        self.reason = ""
        self.presses: list[str] = []
        self._probe()

    def _probe(self) -> None:
        if not self.enabled:
            self.reason = "disabled (--no-peer)"
            return
        try:
            self.module = importlib.import_module("experiments.peer.kvpress_peer")
        except Exception as e:  # ImportError, or the module failing at import
            self.reason = (
                f"experiments.peer.kvpress_peer is not importable: {one_line(e, limit=300)}"
            )
            return
        if self.quick and not self.module.env_ready()[0]:
            self.reason = "skipped in --quick: the kvpress environment is not installed yet"
            return
        if not self.quick:  # create the environment once (pip; fails clearly offline)
            try:
                self.module.ensure_kvpress_env(progress=self.progress)
            except Exception as e:  # PeerUnavailable or anything else
                self.reason = f"kvpress environment not ready: {one_line(e, limit=300)}"
                return
        try:
            ok, why = self.module.kvpress_available()
        except Exception as e:
            self.reason = f"kvpress_available() failed: {one_line(e, limit=300)}"
            return
        if not ok:
            self.reason = f"kvpress unavailable: {why}"
            return
        names = set(self.module.PRESSES) | set(self.module.PAGEKV_PRESSES)
        self.presses = [p for p in WANTED if p in names]
        self.available = True
        self.reason = why or "ok"

    def status(self) -> dict:
        return {"available": self.available, "reason": self.reason, "presses": self.presses}

    def request(self, rid: str, press: str, budget: float, ids: dict, max_new: int) -> dict:
        """One request on the replay's own token ids (the bridge converts the budget)."""
        kw = {"budget": budget, "max_new_tokens": max_new}
        if "context_ids" in ids:
            kw |= {"context_ids": ids["context_ids"], "question_ids": ids["question_ids"]}
        else:
            kw["input_ids"] = ids["input_ids"]
        return self.module.make_request(rid, press, press_kwargs=PRESS_KWARGS.get(press), **kw)

    def run(self, requests: list[dict], timeout: float = 3600.0) -> list[dict]:
        """Send the requests; on a failure of the whole batch every result carries it."""
        if not requests:
            return []
        if not self.available:
            return [{"id": r["id"], "error": self.reason} for r in requests]
        try:
            return list(self.module.run_kvpress(self.model_dir, requests, timeout=timeout))
        except Exception as e:
            msg = f"run_kvpress failed: {one_line(e, limit=300)}"
            self.reason = msg
            return [{"id": r["id"], "error": msg} for r in requests]
