"""Haystack text: loading, splitting into sentences, and inserting needles.

The bundled haystack (``assets/haystack/*.txt``) is original CC0 prose written
for this project; see ``assets/haystack/LICENSE``. A user haystack comes from
``load_haystack_file`` (the CLI's ``--haystack-file PATH``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from pagekv.paths import HAYSTACK_DIR  # noqa: E402  (re-exported)
from pagekv.tasks.base import TaskError

_PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n\s*")
# A sentence ends at . ! or ? (optionally followed by a closing quote or
# bracket) and the next one starts with a capital, digit, quote or bracket.
_SENTENCE_BREAK = re.compile(r"(?<=[.!?])([\"')\]]?)\s+(?=[A-Z0-9\"'(\[])")


@dataclass(frozen=True)
class Unit:
    """One haystack sentence; ``ends_paragraph`` marks the last sentence of a paragraph."""

    text: str
    ends_paragraph: bool


@lru_cache(maxsize=4)
def _read_dir(folder: str) -> str:
    files = sorted(Path(folder).glob("*.txt"))
    if not files:
        raise TaskError(f"no haystack .txt files in {folder}")
    return "\n\n".join(f.read_text(encoding="utf-8").strip() for f in files)


def load_haystack(path: str | Path | None = None) -> str:
    """The bundled haystack (all files joined, in name order), or a folder's/file's text."""
    if path is None:
        return _read_dir(str(HAYSTACK_DIR))
    p = Path(path)
    if p.is_dir():
        return _read_dir(str(p))
    return load_haystack_file(p)


def load_haystack_file(path: str | Path, max_bytes: int = 20_000_000) -> str:
    """Read a user haystack (``--haystack-file PATH``): UTF-8 text, non-empty.

    Raises TaskError with a readable message for a missing, huge, binary or
    empty file.
    """
    p = Path(path)
    if not p.is_file():
        raise TaskError(f"haystack file not found: {p}")
    size = p.stat().st_size
    if size > max_bytes:
        raise TaskError(f"haystack file {p} is {size} bytes; the limit is {max_bytes}")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise TaskError(f"haystack file {p} is not UTF-8 text") from exc
    if "\x00" in text:
        raise TaskError(f"haystack file {p} looks binary")
    if not text.strip():
        raise TaskError(f"haystack file {p} is empty")
    return text


def split_paragraphs(text: str) -> list[str]:
    """Paragraphs separated by blank lines, inner whitespace collapsed to single spaces."""
    paras = (" ".join(p.split()) for p in _PARAGRAPH_BREAK.split(text.strip()))
    return [p for p in paras if p]


def split_sentences(paragraph: str) -> list[str]:
    """Sentences of one paragraph (a simple rule; good enough for plain prose).

    >>> split_sentences('It rained. "Yes," she said. Then it stopped!')
    ['It rained.', '"Yes," she said.', 'Then it stopped!']
    """
    out, last = [], 0
    for m in _SENTENCE_BREAK.finditer(paragraph):
        out.append(paragraph[last : m.start() + len(m.group(1))])
        last = m.end()
    out.append(paragraph[last:])
    return [s.strip() for s in out if s.strip()]


def split_units(text: str) -> list[Unit]:
    """The haystack as a flat list of sentences with paragraph ends marked."""
    units: list[Unit] = []
    for para in split_paragraphs(text):
        sents = split_sentences(para)
        units.extend(Unit(s, i == len(sents) - 1) for i, s in enumerate(sents))
    if not units:
        raise TaskError("the haystack has no text")
    return units


def paragraph_starts(units: list[Unit]) -> list[int]:
    """Indices of the units that open a paragraph."""
    return [0] + [i + 1 for i, u in enumerate(units[:-1]) if u.ends_paragraph]


def render(units: list[Unit], inserts: dict[int, list[str]] | None = None) -> tuple[str, list[int]]:
    """Join units into text, inserting extra sentences before given unit indices.

    ``inserts[b]`` are sentences placed at boundary ``b`` (before ``units[b]``;
    ``b == len(units)`` appends at the end), in the same paragraph as the unit
    that follows (or precedes, at the very end). Returns the text and the
    character start of every inserted sentence, in insertion order
    (boundaries ascending, then list order).

    >>> u = [Unit("A b.", False), Unit("C d.", True), Unit("E f.", True)]
    >>> render(u, {1: ["X."], 3: ["Y."]})
    ('A b. X. C d.\\n\\nE f. Y.', [5, 19])
    """
    inserts = inserts or {}
    bad = [b for b in inserts if not 0 <= b <= len(units)]
    if bad:
        raise TaskError(f"insert positions {bad} outside 0..{len(units)}")
    parts: list[str] = []
    starts: list[int] = []
    length = 0
    para_open = False  # whether the current paragraph already has a sentence

    def emit(sentence: str) -> int:
        nonlocal length, para_open
        sep = " " if para_open else ("\n\n" if parts else "")
        parts.append(sep + sentence)
        start = length + len(sep)
        length += len(sep) + len(sentence)
        para_open = True
        return start

    for i in range(len(units) + 1):
        if i == len(units) and units:
            para_open = True  # sentences appended at the end join the last paragraph
        for s in inserts.get(i, []):
            starts.append(emit(s))
        if i < len(units):
            emit(units[i].text)
            if units[i].ends_paragraph:
                para_open = False
    return "".join(parts), starts


def insert_at_depth(text: str, needle: str, depth: float) -> tuple[str, int]:
    """Insert ``needle`` into arbitrary text at the sentence boundary nearest ``depth``.

    Depth is a fraction of the text's characters (no tokenizer needed). The
    original text is kept byte for byte apart from the insertion: the needle
    and one space go in at the start of a sentence, or after a space at the
    very end. Returns the new text and the needle's character offset.
    """
    if not 0.0 <= depth <= 1.0:
        raise TaskError(f"depth must be within [0, 1], got {depth}")
    body = text.rstrip()
    if not body:
        raise TaskError("the haystack is empty")
    lead = len(text) - len(text.lstrip())
    # candidate boundaries: start of text, start of every sentence/paragraph, end
    cands = [lead]
    cands += [m.end() for m in _SENTENCE_BREAK.finditer(body)]
    cands += [m.end() for m in _PARAGRAPH_BREAK.finditer(body)]
    cands.append(len(body))
    target = lead + depth * (len(body) - lead)
    pos = min(sorted(set(cands)), key=lambda c: (abs(c - target), c))
    if pos >= len(body):
        return f"{body} {needle}{text[len(body) :]}", len(body) + 1
    return f"{text[:pos]}{needle} {text[pos:]}", pos
