"""`pagekv.app.allocator`: glibc's allocator settings for a long-running server.

The settings are process-wide and cannot be undone, so the real ones are checked in a
child process; in this process `mallopt` is faked."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from pagekv.app import allocator

#: In a child: a freed 30 MiB block raises glibc's dynamic mmap threshold, so a 20 MiB
#: block then comes from the heap; after `tame()` (threshold 16 MiB) it is mapped on
#: its own (mallinfo2's count of mapped blocks goes up), so freeing it returns it.
#: Then `trim()`: 100 MiB of 64 KiB blocks (below the threshold: on the heap) are
#: written and freed under a block that stays, so `free` cannot shrink the heap from
#: its top and the resident set keeps them; `trim()` must hand them back (resident
#: set from /proc/self/statm before and after).
CHILD = textwrap.dedent(
    """
    import ctypes, os, sys
    from pagekv.app import allocator

    lib = ctypes.CDLL("libc.so.6")
    if not hasattr(lib, "mallinfo2"):
        print("no mallinfo2"); sys.exit(3)

    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
            "uordblks", "fordblks", "keepcost")]

    lib.mallinfo2.restype = Info
    lib.malloc.restype = ctypes.c_void_p
    lib.malloc.argtypes = [ctypes.c_size_t]
    lib.free.argtypes = [ctypes.c_void_p]

    def mapped_after_malloc(size):
        before = lib.mallinfo2().hblks
        p = lib.malloc(size)
        after = lib.mallinfo2().hblks
        lib.free(p)
        return after - before

    lib.free(lib.malloc(30 << 20))  # raises the dynamic threshold to 30 MiB
    plain = mapped_after_malloc(20 << 20)
    tamed = allocator.tame()
    tamed_mapped = mapped_after_malloc(20 << 20)

    page = os.sysconf("SC_PAGE_SIZE")

    def rss_mib():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page / (1 << 20)

    blocks = [lib.malloc(64 << 10) for _ in range(1600)]  # 100 MiB
    for b in blocks:
        ctypes.memset(b, 1, 64 << 10)  # resident
    pin = max(blocks)  # the highest block stays allocated: the heap cannot shrink
    blocks.remove(pin)
    written = rss_mib()
    for b in blocks:
        lib.free(b)
    freed = rss_mib()
    trimmed = allocator.trim()
    after = rss_mib()
    lib.free(pin)
    print(plain, tamed_mapped, tamed, trimmed, round(written - freed), round(freed - after))
    """
)


def test_tame_maps_mid_sized_blocks_and_trim_returns_freed_heap_in_a_child():
    if allocator._glibc() is None:
        pytest.skip("not glibc: tame() and trim() do nothing here (checked below)")
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    if out.returncode == 3:
        pytest.skip("glibc without mallinfo2 (before 2.33)")
    assert out.returncode == 0, out.stderr[-2000:]
    plain, tamed_mapped, tamed, trimmed, by_free, by_trim = out.stdout.split()
    # tame(): mallopt accepted both settings, and a 20 MiB block is now mapped.
    assert (plain, tamed_mapped, tamed) == ("0", "1", "True"), out.stdout
    # trim(): the freed 100 MiB stayed resident until trim() returned most of it.
    assert int(by_free) < 20, f"free alone returned {by_free} MiB: nothing left to trim"
    assert trimmed == "True", out.stdout
    assert int(by_trim) >= 80, f"trim() returned {by_trim} of the 100 MiB freed"


def test_tame_sets_the_threshold_and_the_arena_cap(monkeypatch):
    calls = []
    fake = type(
        "Lib",
        (),
        {
            "mallopt": staticmethod(lambda p, v: calls.append((p, v)) or 1),
            "malloc_trim": staticmethod(lambda pad: calls.append(("trim", pad)) or 1),
        },
    )
    monkeypatch.setattr(allocator, "_libc", fake)
    assert allocator.tame(mmap_threshold=2 << 20, arena_max=4)
    assert calls == [
        (allocator._M_MMAP_THRESHOLD, 2 << 20),
        (allocator._M_ARENA_MAX, 4),
        ("trim", 0),  # free heap space would still serve blocks above the threshold
    ]


def test_not_glibc_does_nothing(monkeypatch):
    monkeypatch.setattr(allocator, "_libc", False)
    assert allocator.tame() is False and allocator.trim() is False
