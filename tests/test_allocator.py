"""`pagekv.serving.allocator`: glibc's allocator settings for a long-running server.

The settings are process-wide and cannot be undone, so the real ones are checked in a
child process; in this process `mallopt` is faked."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from pagekv.serving import allocator

#: In a child: a freed 30 MiB block raises glibc's dynamic mmap threshold, so a 20 MiB
#: block then comes from the heap; after `tame()` (threshold 16 MiB) it is mapped on
#: its own (mallinfo2's count of mapped blocks goes up), so freeing it returns it.
CHILD = textwrap.dedent(
    """
    import ctypes, sys
    from pagekv.serving import allocator

    lib = ctypes.CDLL("libc.so.6")
    if not hasattr(lib, "mallinfo2"):
        print("no mallinfo2"); sys.exit(3)

    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
            "uordblks", "fordblks", "keepcost")]

    lib.mallinfo2.restype = Info
    lib.malloc.restype = ctypes.c_void_p
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
    print(plain, mapped_after_malloc(20 << 20), tamed, allocator.trim() in (True, False))
    """
)


def test_tame_maps_mid_sized_blocks_in_a_child_process():
    if allocator._glibc() is None:
        pytest.skip("not glibc: tame() and trim() do nothing here (checked below)")
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    if out.returncode == 3:
        pytest.skip("glibc without mallinfo2 (before 2.33)")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["0", "1", "True", "True"], out.stdout


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
