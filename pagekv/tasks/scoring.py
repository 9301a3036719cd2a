"""Scoring a model's answer against a task, honestly.

Normalisation (``normalize``), applied to prediction and answers alike:

1. Unicode NFKC, then every dash-like character becomes ``-`` and curly
   quotes become straight ones; then casefold.
2. Thousands separators between digits go: ``1,865`` -> ``1865``.
3. The text is cut into word tokens: runs of letters/digits/underscore,
   joined by ``-``, ``.``, ``:`` or ``/`` only when a letter or digit sits on
   both sides (so ``PELICAN-42``, ``3.5``, ``8:30``, ``LARK-HY`` stay whole),
   with a trailing ``%`` kept (``12%`` is not ``12``). Everything else
   (surrounding punctuation, quotes, apostrophes, ``&``, currency signs) is a
   separator.
4. Tokens are joined by single spaces.

``contains`` then asks whether the answer's tokens occur as a contiguous run
of the prediction's tokens: word boundaries come for free, so "4" does not
match "42" and "42" does not match "PELICAN-42". Deliberately strict:
"PELICAN 42" does not match "PELICAN-42", and "41" does not match "41.0"
unless the task lists it as an alias; a strict scorer can only understate
recall. An empty prediction (or an answer that normalises to nothing) never
matches.

``score`` also reports ``hedged``: the prediction contains the answer of a
distractor needle (multi-needle tasks). A hedged prediction is not counted
correct: listing every code word is not retrieving the right one.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable
from typing import Any

_DASHES = "\u2010\u2011\u2012\u2013\u2014\u2015\u2212\ufe58\ufe63\uff0d"
_TRANSLATE = str.maketrans(
    {
        **{c: "-" for c in _DASHES},
        **{c: "'" for c in "\u2018\u2019\u201a\u201b\u2032"},
        **{c: '"' for c in "\u201c\u201d\u201e\u201f\u2033"},
    }
)
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_TOKEN = re.compile(r"\w+(?:[-.:/]\w+)*%?")


def _tokens(text: str | None) -> list[str]:
    if not text:
        return []
    text = unicodedata.normalize("NFKC", text).translate(_TRANSLATE).casefold()
    text = _THOUSANDS.sub("", text)
    return _TOKEN.findall(text)


def normalize(text: str | None) -> str:
    """Canonical form used for matching (see the module docstring).

    >>> normalize("  The code is “PELICAN–42”. ")
    'the code is pelican-42'
    >>> normalize("1,865 pounds; Orrin & Vale's")
    '1865 pounds orrin vale s'
    """
    return " ".join(_tokens(text))


def _answers(answers: str | Iterable[str]) -> list[list[str]]:
    items = [answers] if isinstance(answers, str) else list(answers)
    return [t for t in (_tokens(a) for a in items) if t]


def exact_match(pred: str | None, answers: str | Iterable[str]) -> bool:
    """The whole normalised prediction equals one normalised answer."""
    p = _tokens(pred)
    return bool(p) and any(p == a for a in _answers(answers))


def contains(pred: str | None, answers: str | Iterable[str]) -> bool:
    """One normalised answer occurs in the prediction as a whole-token run."""
    p = _tokens(pred)
    for a in _answers(answers):
        k = len(a)
        if any(p[i : i + k] == a for i in range(len(p) - k + 1)):
            return True
    return False


def score(pred: str | None, task: Any) -> dict[str, bool]:
    """Score one prediction for a Task.

    Returns ``{"correct", "exact", "contains", "hedged"}``; ``correct`` is
    ``contains and not hedged`` for every task kind.
    """
    answers = task.answers
    has = contains(pred, answers)
    distractors = task.meta.get("distractor_answers", []) if task.meta else []
    hedged = any(contains(pred, d) for d in distractors)
    return {
        "correct": has and not hedged,
        "exact": exact_match(pred, answers),
        "contains": has,
        "hedged": hedged,
    }
