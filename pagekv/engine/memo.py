"""A memo bounded by bytes, least recently used out first, safe across threads.

The app keeps two of them per model (`pagekv.engine.study.Study`): prefilled prompts (their
KV cache dominates: 2 x L x G x n x d floats, about 92 MB for 2000 tokens of the
bundled model in float32) and finished results (about 1 MB each at 2000 tokens, the
plan's masks included). Counting entries would let one long prompt blow the memory a
dozen short ones fit in; counting bytes does not.

    >>> memo = ByteLRU(max_bytes=100, size_of=len)   # size of a value: its length
    >>> memo.put("a", b"x" * 40), memo.put("b", b"y" * 40)
    (True, True)
    >>> _ = memo.get("a")                   # "a" is now the most recently used
    >>> memo.put("c", b"z" * 40)            # 120 bytes > 100: "b" (least recent) goes
    True
    >>> list(memo), memo.nbytes
    (['a', 'c'], 80)
    >>> memo.put("big", b"w" * 200)         # larger than the cap: not stored
    False

A second part, for entries the owner keeps apart (the lessons' prefills, plans and
results, which a class opens again and again): `kept_bytes` caps it, `keep_if(key)` says
which keys go there, and what the first part stores never evicts them.

    >>> memo = ByteLRU(max_bytes=100, size_of=len, kept_bytes=50)
    >>> memo.keep_if = lambda key: key.startswith("lesson")
    >>> memo.put("lesson-1", b"l" * 40), memo.put("x", b"x" * 90), memo.put("y", b"y" * 90)
    (True, True, True)
    >>> list(memo), memo.nbytes, memo.kept_nbytes   # "x" went; the lesson's entry stays
    (['lesson-1', 'y'], 90, 40)

A computation of a missing key announces itself with `computing(key)` and stores its
value with `put`; `get_or_wait(key)` in other threads waits for it and shares the value
(a class running the same lesson costs one computation), even while it streams its
progress.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["ByteLRU", "nbytes"]


def nbytes(obj: Any) -> int:
    """Approximate bytes held by `obj`: every tensor's storage counted once (views of
    one storage share it), plus Python containers, dataclasses and plain objects'
    attributes, recursively. Meant for memo accounting, not an exact RSS figure.

    >>> nbytes(torch.zeros(4, 8))
    128
    >>> t = torch.zeros(1000); nbytes([t, t[:10]]) < 4000 + 200
    True
    """
    seen_storage: set[tuple[str, int]] = set()
    seen_obj: set[int] = set()
    total = 0
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            st = o.untyped_storage()
            key = (str(o.device), st.data_ptr())
            if key not in seen_storage:
                seen_storage.add(key)
                total += int(st.nbytes())
            continue
        if o is None or isinstance(o, (bool, int, float, str, bytes, torch.dtype, torch.device)):
            total += sys.getsizeof(o)
            continue
        if id(o) in seen_obj:
            continue
        seen_obj.add(id(o))
        total += sys.getsizeof(o)
        if isinstance(o, dict):
            stack.extend(o.keys())
            stack.extend(o.values())
        elif isinstance(o, (list, tuple, set, frozenset)):
            stack.extend(o)
        elif dataclasses.is_dataclass(o) and not isinstance(o, type):
            stack.extend(getattr(o, f.name, None) for f in dataclasses.fields(o))
        elif hasattr(o, "__dict__") and not isinstance(o, type):
            stack.extend(vars(o).values())  # e.g. a transformers DynamicCache and its layers
    return total


class ByteLRU:
    """A mapping bounded by the sum of its values' sizes, least recently used out first.

    Args:
        max_bytes: the cap; the sum of the stored sizes never exceeds it. 0 disables
            the memo (nothing is stored).
        size_of: the size of a value in bytes (default `nbytes`), measured when it is
            stored and again by `refresh` (a value that grows after being stored).
        max_entries: an optional cap on the number of entries as well (None: none).
        kept_bytes: the cap of the kept part (module docstring); 0 (default): none,
            every key goes to the first part.

    Every method holds one lock for its few dictionary operations only; a computation
    announced with `computing` runs outside it.
    """

    def __init__(
        self,
        max_bytes: int,
        size_of: Callable[[Any], int] = nbytes,
        max_entries: int | None = None,
        kept_bytes: int = 0,
    ):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0; got {max_bytes}")
        if max_entries is not None and max_entries < 0:
            raise ValueError(f"max_entries must be >= 0 or None; got {max_entries}")
        self.max_bytes = int(max_bytes)
        self.max_entries = max_entries
        self.size_of = size_of
        self._data: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()
        #: The kept part: its own entries, bytes and cap, least recently used out first
        #: among themselves only.
        self.kept_bytes = int(kept_bytes)
        self._kept: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()
        self._kept_total = 0
        #: Which keys go to the kept part (set by the owner; none by default).
        self.keep_if: Callable[[Hashable], bool] = lambda key: False
        self._pending: dict[Hashable, threading.Event] = {}  # computing: done when set
        self._lock = threading.Lock()
        self._bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    # ------------------------------------------------------------------ mapping

    def __len__(self) -> int:
        return len(self._data) + len(self._kept)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._data or key in self._kept

    def __iter__(self):
        return iter(self.keys())

    def keys(self) -> list:
        """The keys, the kept part's first, each part least recently used first (a
        snapshot)."""
        with self._lock:
            return [*self._kept, *self._data]

    def items(self) -> list[tuple[Hashable, Any]]:
        """`(key, value)` pairs, in the order of `keys` (a snapshot)."""
        with self._lock:
            return [(k, v) for part in (self._kept, self._data) for k, (v, _) in part.items()]

    @property
    def nbytes(self) -> int:
        """The sum of the first part's sizes (<= `max_bytes`). Read under the lock:
        a put adds before it evicts, and no reader may see that moment."""
        with self._lock:
            return self._bytes

    @property
    def kept_nbytes(self) -> int:
        """The sum of the kept part's sizes (<= `kept_bytes`)."""
        with self._lock:
            return self._kept_total

    def stats(self) -> dict:
        """Entries, bytes, cap, hits, misses and evictions so far."""
        with self._lock:
            return {
                "entries": len(self._data),
                "bytes": self._bytes,
                "max_bytes": self.max_bytes,
                "kept_entries": len(self._kept),
                "kept_bytes": self._kept_total,
                "max_kept_bytes": self.kept_bytes,
                "hits": self.hits,
                "misses": self.misses,
                "evictions": self.evictions,
            }

    def get(self, key: Hashable, default: Any = None) -> Any:
        """The value of `key` (now the most recently used), else `default`."""
        with self._lock:
            part = self._kept if key in self._kept else self._data
            if key not in part:
                self.misses += 1
                return default
            self.hits += 1
            part.move_to_end(key)
            return part[key][0]

    def put(self, key: Hashable, value: Any) -> bool:
        """Store `value` as the most recently used, evicting the least recently used
        entries until it fits. A value larger than the cap is not stored (and evicts
        nothing); returns whether it was stored."""
        size = int(self.size_of(value))
        with self._lock:
            return self._put_locked(key, value, size)

    def pop(self, key: Hashable, default: Any = None) -> Any:
        with self._lock:
            entry = self._drop_locked(key)
        return default if entry is None else entry[0]

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self._kept.clear()
            self._bytes = self._kept_total = 0

    def keep_now(self) -> None:
        """After the owner changed `keep_if`: move the entries it now names to the kept
        part, and the kept ones it no longer names to the first part (where the least
        recently used may then go)."""
        with self._lock:
            moved = [k for k in self._data if self.keep_if(k)]
            moved += [k for k in self._kept if not self.keep_if(k)]
            for key in moved:
                self._put_locked(key, *self._drop_locked(key))

    def refresh(self, key: Hashable) -> None:
        """Measure `key`'s value again (it grew, e.g. a prefill that memoised more
        scores) and evict to stay under the cap; an absent key is ignored."""
        with self._lock:
            entry = self._kept.get(key) or self._data.get(key)
        if entry is None:
            return
        size = int(self.size_of(entry[0]))
        with self._lock:
            current = self._kept.get(key) or self._data.get(key)
            if current is None or current[0] is not entry[0]:
                return  # replaced or evicted meanwhile
            if not self._put_locked(key, current[0], size):  # it replaces the entry
                self.evictions += 1  # it grew past its part's cap

    @contextmanager
    def computing(self, key: Hashable):
        """Say that the caller is computing `key` (and will `put` it) until the block
        ends: `get_or_wait(key)` in other threads waits for the block to end. Yields
        whether the caller is the only one computing it (a second caller still
        computes; it just does not announce itself again)."""
        with self._lock:
            pending = self._pending.get(key)
            owner = pending is None
            if owner:
                pending = self._pending[key] = threading.Event()
        try:
            yield owner
        finally:
            if owner:
                with self._lock:
                    self._pending.pop(key, None)
                pending.set()

    def get_or_wait(self, key: Hashable, timeout: float | None = None) -> Any:
        """The value of `key`; if another thread is computing it (`computing`), first
        wait up to `timeout` seconds for it to finish. None when absent (not computed,
        failed, too large to store, or still computing at the timeout)."""
        with self._lock:
            pending = self._pending.get(key)
        if pending is not None:
            pending.wait(timeout)
        return self.get(key)

    # ------------------------------------------------------------------ internals

    def _drop_locked(self, key: Hashable) -> tuple[Any, int] | None:
        """Remove `key` from the part that holds it: its `(value, size)`, else None."""
        if key in self._kept:
            value, size = self._kept.pop(key)
            self._kept_total -= size
        elif key in self._data:
            value, size = self._data.pop(key)
            self._bytes -= size
        else:
            return None
        return value, size

    def _put_locked(self, key: Hashable, value: Any, size: int) -> bool:
        self._drop_locked(key)
        if self.kept_bytes and self.keep_if(key):
            if size > self.kept_bytes:
                return False
            self._kept[key] = (value, size)
            self._kept_total += size
            while self._kept_total > self.kept_bytes:
                _, (_, old) = self._kept.popitem(last=False)
                self._kept_total -= old
                self.evictions += 1
            return True
        if size > self.max_bytes or self.max_bytes == 0 or self.max_entries == 0:
            return False  # too large, or a disabled memo (which stores nothing at all)
        self._data[key] = (value, size)
        self._bytes += size
        self._evict_locked()
        return True

    def _evict_locked(self) -> None:
        cap = self.max_entries
        while self._data and (self._bytes > self.max_bytes or (cap and len(self._data) > cap)):
            _, (_, size) = self._data.popitem(last=False)
            self._bytes -= size
            self.evictions += 1
