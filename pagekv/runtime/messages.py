"""An exception said in one line, the way every message of the project quotes one.

    >>> one_line(ValueError("bad\\n  value"))
    'ValueError: bad value'
    >>> one_line(KeyError(), limit=5)
    'KeyEr'

(`experiments/peer/kvpress_worker.py` keeps a copy of its own: it runs in the
kvpress environment and imports nothing of `pagekv` it does not need.)
"""

from __future__ import annotations

__all__ = ["one_line"]


def one_line(e: BaseException, bare: tuple = (), limit: int | None = None) -> str:
    """`Type: message` with the message's whitespace collapsed (the type alone for an
    empty message; the message alone for an exception of a type in `bare`, whose
    messages are sentences for people), cut at `limit` characters."""
    text = " ".join(str(e).split())
    if isinstance(e, bare) and text:
        out = text
    else:
        out = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return out if limit is None else out[:limit]
