"""Keep a long-running server's resident memory near what it actually holds.

A prefill of a few thousand tokens allocates and frees hundreds of megabytes of
tensors. With glibc's defaults two things make a server's resident set creep up run
after run although the memos stay within their caps:

- the mmap threshold grows each time a large block is freed (up to 32 MiB), so later
  blocks of a few MiB come from the heap, where freed space is rarely returned;
- every thread that allocates may get an arena of its own (up to 8 per core), each
  fragmented separately; a web server runs its handlers on many threads.

`trim()` returns the heaps' free pages to the system; the app calls it after each
computed run. `tame()` fixes the mmap threshold (blocks from `MMAP_THRESHOLD` up are
mapped, and unmapped when freed) and caps the arenas; the app does not call it: it
lowered the peak but not the memory after 100 varied runs (2.14 GB with it, 2.18 GB
with the trim alone, `python benchmarks/load_app.py`) and slowed the batched decode
(`python benchmarks/bench_pair_decode.py --mmap-threshold-mib 16`).
Both do nothing where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger(__name__)

__all__ = ["MMAP_THRESHOLD", "ARENA_MAX", "tame", "trim"]

#: Blocks of this size and more are mapped, and unmapped when freed. A decode step grows
#: each layer's KV cache by concatenation (blocks of 1-4 MiB at a few thousand tokens),
#: and mapping those anew each step is slow: `python benchmarks/bench_pair_decode.py
#: --budgets 0.1,0.4` decoded the pair in 1.38 / 4.77 s with `--mmap-threshold-mib 1`,
#: 1.54-1.76 / 3.06-4.47 s with 16, and 1.03-1.12 / 1.76-2.09 s untouched.
MMAP_THRESHOLD = 16 << 20
#: At most this many malloc arenas.
ARENA_MAX = 2

# mallopt parameters (malloc.h)
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8

_libc = None


def _glibc():
    """glibc's handle, or None (another C library, another system)."""
    global _libc
    if _libc is None:
        if not sys.platform.startswith("linux"):
            _libc = False
        else:
            try:
                lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
                lib.gnu_get_libc_version.restype = ctypes.c_char_p
                lib.gnu_get_libc_version()
                _libc = lib
            except (OSError, AttributeError):
                _libc = False
    return _libc or None


def tame(mmap_threshold: int = MMAP_THRESHOLD, arena_max: int = ARENA_MAX) -> bool:
    """Set glibc's mmap threshold and arena cap for this process, then `trim()` (free
    heap space would otherwise still serve blocks above the threshold); whether the
    settings applied."""
    lib = _glibc()
    if lib is None:
        log.info("allocator left as it is (not glibc)")
        return False
    ok = bool(lib.mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold)))
    ok = bool(lib.mallopt(_M_ARENA_MAX, int(arena_max))) and ok
    trim()
    return ok


def trim() -> bool:
    """Return free heap pages to the system (glibc `malloc_trim(0)`); whether any were."""
    lib = _glibc()
    if lib is None:
        return False
    return bool(lib.malloc_trim(0))
