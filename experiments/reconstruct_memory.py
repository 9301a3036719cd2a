"""Time and peak memory of the reconstruction pass against the prefill, on the bundled
model (CPU), for the prompt lengths given.

    python experiments/reconstruct_memory.py [--contexts 500 1000 2000] [--chunk 256]

For each prompt (the replay's T4 needle prompt at that length, question after), a
thread samples the process's resident memory (``/proc/self/statm``) every 2 ms while
the prefill runs and then while the reconstruction pass runs (`Runner.reconstruction`,
into a new cache over the prefill's tensors); each phase's peak is reported above the
memory in use when the phase began, with its seconds. The cache itself and the model
are in the baseline of both, so the numbers are what each phase adds. Linux only
(``/proc``).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagekv.engine.study import PromptSpec, Study  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * PAGE


class PeakSampler:
    """Peak resident memory while the block runs (sampled every 2 ms), and its seconds."""

    def __enter__(self):
        self.start = self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self.t0 = time.perf_counter()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(0.002)

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.t0
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())

    @property
    def added_mib(self) -> float:
        return (self.peak - self.start) / 2**20


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[500, 1000, 2000])
    ap.add_argument("--chunk", type=int, default=256)
    args = ap.parse_args(argv)
    study = Study.load("bundled")
    runner = study.runner
    print(f"{'context':>8} {'tokens':>7} {'prefill s':>10} {'+MiB':>7} {'reconstruct s':>14} "
          f"{'+MiB':>7}")  # fmt: skip
    for ctx in args.contexts:
        spec = PromptSpec(context=ctx, depth=0.5, seed=0, mode="after")
        prep = study.prepare(spec)  # the prompt's ids (its own prefill is not measured)
        with PeakSampler() as pre_mem:
            pre = runner.prefill(prep.prefill.ids, question_ids=prep.prefill.question_ids)
        with PeakSampler() as rec_mem:
            runner.reconstruction(pre, chunk=args.chunk)
        print(f"{ctx:>8} {pre.n:>7} {pre_mem.seconds:>10.2f} {pre_mem.added_mib:>7.0f} "
              f"{rec_mem.seconds:>14.2f} {rec_mem.added_mib:>7.0f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
