"""What a long command is doing, on a terminal: the step, the seconds so far and a bar.

    steps = Steps(total=3)                 # three steps counted on the bar
    with steps.step("loading bundled"):
        ...
    with steps.step("prefilling the prompt"):
        ...

On a terminal (`stream.isatty()`), one line of `stream` is redrawn in place every
`EVERY_S`: `[##----] 1 of 3 loading bundled: 4 s`, and each finished step stays as a
line with its seconds. Elsewhere (a pipe, a file, a test's capture) nothing is written:
`--json` output and logs stay as they were. The caller's thread does the work; a
daemon thread only redraws the line, holding nothing the work needs.
"""

from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager

#: Seconds between redraws of the step's line.
EVERY_S = 0.5
#: Characters of the bar.
BAR = 10


class Steps:
    """Steps of one command, counted on a bar of `total` (see the module docstring)."""

    def __init__(self, total: int, stream=None):
        self.total = max(int(total), 1)
        self.stream = sys.stderr if stream is None else stream
        self.on = bool(getattr(self.stream, "isatty", lambda: False)())
        self.done = 0

    def line(self, what: str, elapsed: float, final: bool = False) -> str:
        """`[###-------] 2 of 7 what: 12 s` (the bar counts finished steps)."""
        filled = round(BAR * self.done / self.total)
        bar = "#" * filled + "-" * (BAR - filled)
        n = min(self.done + (0 if final else 1), self.total)
        return f"[{bar}] {n} of {self.total} {what}: {elapsed:.0f} s"

    @contextmanager
    def step(self, what: str):
        """One step: its line redrawn while the body runs, then kept with its seconds."""
        if not self.on:
            yield
            self.done += 1
            return
        t0 = time.perf_counter()
        stop = threading.Event()

        def redraw():
            while not stop.wait(EVERY_S):
                self._write("\r\x1b[K" + self.line(what, time.perf_counter() - t0))

        self._write("\r\x1b[K" + self.line(what, 0.0))
        ticker = threading.Thread(target=redraw, name="pagekv-progress", daemon=True)
        ticker.start()
        try:
            yield
        finally:
            stop.set()
            ticker.join()
            self.done += 1
            self._write("\r\x1b[K" + self.line(what, time.perf_counter() - t0, final=True) + "\n")

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()
