"""Per-session state of a shared server, bounded and dropped when a session ends.

A session's runs go one at a time (its slider events each keep only their last
request, and a second run waits for the first): `SessionGate.turn(session_id)` is
that turn. The gate holds one small lock per live session, at most `max_sessions`
of them (the least recently used idle ones go first), and `end(session_id)` drops a
session's entry (the app calls it when the browser tab closes).

A turn never waits for the model while holding what the model needs: the session
locks are taken by request threads only, and no job on the model worker takes one
(docs/design.md, "One model worker").

    gate = SessionGate()
    with gate.turn(request.session_hash):   # None (a Python caller): no turn needed
        ...                                 # the session's run
    gate.end(request.session_hash)          # the tab closed

A session's `ticket`s number its requests in the order they arrive; `is_latest` tells
a request whether a later one has come since (the lessons' Next and Previous: the
last press's lesson is the one the screen ends on).

A session's entry also keeps a few values of its last finished run (`remember`,
`recall`): the budgets its results were computed at, which a refused budget puts back
in the boxes (pagekv/app/handlers.py).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from contextlib import contextmanager

__all__ = ["MAX_SESSIONS", "SessionGate"]

#: Sessions with an entry at most (a classroom is a few dozen).
MAX_SESSIONS = 256


class _Entry:
    __slots__ = ("lock", "users", "values", "tickets")

    def __init__(self):
        self.lock = threading.Lock()
        self.users = 0  # threads holding or waiting for the turn
        self.values: dict = {}  # of the session's last finished run (`remember`)
        self.tickets = 0  # the last `ticket` handed out


class SessionGate:
    """One turn at a time per session, for at most `max_sessions` sessions."""

    def __init__(self, max_sessions: int = MAX_SESSIONS):
        self.max_sessions = int(max_sessions)
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._guard = threading.Lock()  # the dictionary only; never held while waiting

    def __len__(self) -> int:
        with self._guard:
            return len(self._entries)

    @contextmanager
    def turn(self, session_id: str | None):
        """The session's turn: waits for the session's previous run to end."""
        if session_id is None:
            yield
            return
        with self._guard:
            entry = self._entries.setdefault(session_id, _Entry())
            self._entries.move_to_end(session_id)
            entry.users += 1  # before trimming: an entry in use is never dropped
            self._trim_locked()
        try:
            with entry.lock:
                yield
        finally:
            with self._guard:
                entry.users -= 1
                self._trim_locked()

    def ticket(self, session_id: str | None) -> int:
        """A number for a request of the session, larger than every one before: with
        `is_latest`, a request that a later one of the same session has overtaken
        (several lesson requests waiting for the turn, which takes them in no set
        order) can leave the screen to the later one."""
        if session_id is None:
            return 0
        with self._guard:
            entry = self._entries.setdefault(session_id, _Entry())
            self._entries.move_to_end(session_id)
            entry.tickets += 1
            self._trim_locked()
            return entry.tickets

    def is_latest(self, session_id: str | None, ticket: int) -> bool:
        """Whether `ticket` is the session's last (always, without a session)."""
        if session_id is None:
            return True
        with self._guard:
            entry = self._entries.get(session_id)
            return entry is None or entry.tickets <= ticket

    def remember(self, session_id: str | None, **values) -> None:
        """Keep `values` for the session (a live entry only: its turn holds one)."""
        if session_id is None:
            return
        with self._guard:
            entry = self._entries.get(session_id)
            if entry is not None:
                entry.values = dict(values)

    def recall(self, session_id: str | None) -> dict:
        """What `remember` kept for the session ({} if nothing)."""
        with self._guard:
            entry = self._entries.get(session_id) if session_id is not None else None
            return dict(entry.values) if entry is not None else {}

    def end(self, session_id: str | None) -> None:
        """Forget a session (its tab closed). A run still going keeps its own entry."""
        if session_id is None:
            return
        with self._guard:
            entry = self._entries.get(session_id)
            if entry is not None and entry.users == 0:
                del self._entries[session_id]

    def _trim_locked(self) -> None:
        """Drop the least recently used idle sessions above the cap (busy ones stay)."""
        if len(self._entries) <= self.max_sessions:
            return
        for sid in [s for s, e in self._entries.items() if e.users == 0]:
            if len(self._entries) <= self.max_sessions:
                break
            del self._entries[sid]
