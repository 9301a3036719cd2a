"""Needle-in-a-haystack tasks, sized in tokens of the model's tokenizer.

A needle is one sentence with a made-up, unguessable answer ("The secret code
word for the blue lighthouse is PELICAN-42."). It goes in at a sentence
boundary at fractional depth ``depth`` of a haystack of about
``context_tokens`` tokens (haystack plus needles). The haystack is the bundled
original prose, cycled deterministically from a seed-chosen paragraph.

Sizing is cheap: every haystack sentence is tokenized once (one batch call,
cached per tokenizer and haystack), the sentences are accumulated to the
target, and the assembled context is tokenized once to measure it; if the
sum of the parts missed the target by more than 1 %, the budget is rescaled
once and the context rebuilt (at most two full tokenizations).

Worked example (depth 0.5, one needle, target 2000)::

    task = make_needle_task(tok, context_tokens=2000, depth=0.5, seed=3)
    task.meta["context_tokens_actual"]   # e.g. 1997
    task.meta["depth_actual"]            # token index of the needle / context tokens
"""

from __future__ import annotations

import itertools
import random
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pagekv.tasks.base import QUESTION_POSITIONS, Task, TaskError, check_custom_prompt
from pagekv.tasks.haystack import (
    Unit,
    insert_at_depth,
    load_haystack,
    paragraph_starts,
    render,
    split_units,
)

_TOLERANCE = 0.01  # rebuild once when the measured size misses the target by more


@dataclass(frozen=True)
class Needle:
    """A needle sentence, the question it answers, and the answer (a substring of it)."""

    text: str
    question: str
    answer: str
    aliases: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for attr in ("text", "question", "answer"):
            if not str(getattr(self, attr)).strip():
                raise TaskError(f"needle {attr} must be a non-empty string")


def _codeword(thing: str, answer: str) -> Needle:
    return Needle(
        f"The secret code word for the {thing} is {answer}.",
        f"What is the secret code word for the {thing}?",
        answer,
    )


# Same-form needles: any of these can serve as distractors for another.
CODEWORD_NEEDLES: tuple[Needle, ...] = tuple(
    _codeword(thing, answer)
    for thing, answer in (
        ("blue lighthouse", "PELICAN-42"),
        ("red windmill", "BADGER-17"),
        ("green observatory", "MARLIN-86"),
        ("yellow ferry", "OTTER-53"),
        ("silver greenhouse", "HERON-29"),
        ("orange signal box", "WALRUS-64"),
    )
)

BUILTIN_NEEDLES: tuple[Needle, ...] = CODEWORD_NEEDLES + (
    Needle(
        "The access number for the archive room in Quellmoor Abbey is 7318.",
        "What is the access number for the archive room in Quellmoor Abbey?",
        "7318",
    ),
    Needle(
        "The magic number chosen by the harbour master Ilse Vantrow is 5927.",
        "What is the magic number chosen by the harbour master Ilse Vantrow?",
        "5927",
    ),
    Needle(
        "The pet tortoise of the clockmaker Oresund Klapp is named Wendelbeck.",
        "What is the name of the pet tortoise of the clockmaker Oresund Klapp?",
        "Wendelbeck",
    ),
    Needle(
        "The password for the Kelderin weather balloon log is AMBERFROST.",
        "What is the password for the Kelderin weather balloon log?",
        "AMBERFROST",
    ),
    Needle(
        "The vault at Ferrowby Station opens with the combination 4-19-33.",
        "What combination opens the vault at Ferrowby Station?",
        "4-19-33",
    ),
    Needle(
        "The favourite snack of the astronomer Petra Lindqvale is pickled quince.",
        "What is the favourite snack of the astronomer Petra Lindqvale?",
        "pickled quince",
    ),
)

NeedleLike = Needle | Sequence[str]


def as_needle(item: NeedleLike) -> Needle:
    """Accept a Needle or a ``(text, question, answer[, aliases])`` tuple."""
    if isinstance(item, Needle):
        return item
    if isinstance(item, str) or len(item) not in (3, 4):
        raise TaskError("a needle is a (needle sentence, question, answer) triple")
    return Needle(*map(str, item[:3]), tuple(item[3]) if len(item) == 4 else ())


# ------------------------------------------------------------------ counting
_COUNT_CACHE: weakref.WeakKeyDictionary[Any, dict[int, list[int]]] = weakref.WeakKeyDictionary()


def _count_tokens(tokenizer: Any, texts: list[str]) -> list[int]:
    if not texts:
        return []
    enc = tokenizer(texts, add_special_tokens=False)
    return [len(ids) for ids in enc["input_ids"]]


def _unit_counts(tokenizer: Any, units: list[Unit], key: int) -> list[int]:
    """Token count of every unit, tokenized once per (tokenizer, haystack)."""
    try:
        per_tok = _COUNT_CACHE.setdefault(tokenizer, {})
    except TypeError:  # tokenizer not weak-referenceable: no cache
        per_tok = {}
    if key not in per_tok:
        per_tok[key] = _count_tokens(tokenizer, [u.text for u in units])
    return per_tok[key]


def _measure(tokenizer: Any, text: str, char_starts: list[int]) -> tuple[int, list[int]]:
    """Token count of ``text`` and the token index at each character start."""
    try:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = enc["offset_mapping"]
    except NotImplementedError:  # slow tokenizer: size only
        enc, offsets = tokenizer(text, add_special_tokens=False), None
    n = len(enc["input_ids"])
    if offsets is None:
        return n, [-1] * len(char_starts)
    return n, [next((i for i, (s, e) in enumerate(offsets) if e > c), n) for c in char_starts]


# ----------------------------------------------------------------- assembly
def _select(counts: list[int], start: int, budget: float) -> list[int]:
    """Unit indices (cycling from ``start``) whose summed count is closest to ``budget``."""
    chosen: list[int] = []
    total = 0.0
    i = start
    while True:
        cost = counts[i]  # a joining space is absorbed into the next word's token
        if total + cost > budget and abs(total + cost - budget) >= abs(total - budget):
            break
        chosen.append(i)
        total += cost
        i = (i + 1) % len(counts)
        if len(chosen) > 10_000_000:  # a guard, never reached for sane inputs
            raise TaskError("haystack assembly did not terminate")
    return chosen


def _assemble(
    units: list[Unit],
    counts: list[int],
    chosen: list[int],
    needles: list[Needle],
    depths: list[float],
) -> tuple[str, list[int]]:
    """Render the chosen units with each needle at the boundary nearest its depth.

    Boundaries are measured in estimated tokens of the haystack alone. Returns
    the context and the character start of each needle (in ``needles`` order).
    """
    picked = []
    for j, idx in enumerate(chosen):
        u = units[idx]
        # wrapping around the haystack (or the last chosen unit) closes a paragraph
        wraps = j + 1 < len(chosen) and chosen[j + 1] != idx + 1
        picked.append(Unit(u.text, u.ends_paragraph or wraps))
    cum = [0, *itertools.accumulate(counts[idx] for idx in chosen)]
    placements = []  # (boundary, sequence, needle index)
    for seq, k in enumerate(sorted(range(len(needles)), key=lambda k: (depths[k], k))):
        target = depths[k] * cum[-1]
        b = min(range(len(cum)), key=lambda b: (abs(cum[b] - target), b))
        placements.append((b, seq, k))
    placements.sort()
    inserts: dict[int, list[str]] = {}
    for b, _, k in placements:
        inserts.setdefault(b, []).append(needles[k].text)
    # render() reports starts by ascending boundary, then list order
    text, starts_sorted = render(picked, inserts)
    starts = [0] * len(needles)
    for (_, _, k), s in zip(placements, starts_sorted, strict=True):
        starts[k] = s
    return text, starts


def make_needle_task(
    tokenizer: Any,
    context_tokens: int = 2000,
    depth: float = 0.5,
    seed: int = 0,
    needle: str | None = None,
    question: str | None = None,
    answer: str | None = None,
    haystack: str | None = None,
    question_position: str = "inside",
    needles: Sequence[NeedleLike] | None = None,
    depths: Sequence[float] | None = None,
    target: int = 0,
    name: str | None = None,
) -> Task:
    """A needle-in-a-haystack task of about ``context_tokens`` tokens.

    Args:
        tokenizer: a Hugging Face tokenizer; sizes are counted in its tokens
            (context alone, without template or question).
        context_tokens: target size of haystack + needle(s).
        depth: where the needle goes, 0 = start, 1 = end (single-needle mode).
        seed: picks the built-in needle (when none is given) and the paragraph
            the haystack starts from. Same inputs and seed give the same task.
        needle, question, answer: a custom needle; all three or none.
        haystack: text to use instead of the bundled haystack.
        question_position: "inside" or "after", stored in ``meta`` as the
            default mode of ``Task.build_prompt_ids``.
        needles: multi-needle mode: several ``(needle, question, answer)``
            triples (or ``Needle``); the task asks about ``needles[target]``,
            the others are distractors. Overrides needle/question/answer/depth.
        depths: one depth per needle (default evenly spread:
            ``(i + 1) / (k + 1)``).
        target: index of the needle the question asks about.
        name: task name (default derived from depth and seed).
    """
    if question_position not in QUESTION_POSITIONS:
        raise TaskError(f"question_position must be one of {QUESTION_POSITIONS}")
    if int(context_tokens) != context_tokens or context_tokens < 32:
        raise TaskError(f"context_tokens must be an integer >= 32, got {context_tokens}")
    context_tokens = int(context_tokens)
    rng = random.Random(seed)

    if needles is not None:
        items = [as_needle(x) for x in needles]
        if not 1 <= len(items) <= 16:
            raise TaskError("give between 1 and 16 needles")
        if len({n.text for n in items}) != len(items):
            raise TaskError("needle sentences must be distinct")
        if not 0 <= target < len(items):
            raise TaskError(f"target {target} is not an index into {len(items)} needles")
        if depths is None:
            depths = [(i + 1) / (len(items) + 1) for i in range(len(items))]
    else:
        check_custom_prompt(None, needle, question, answer, need_haystack=False)
        given = [needle is not None, question is not None, answer is not None]
        chosen = Needle(needle, question, answer) if all(given) else rng.choice(BUILTIN_NEEDLES)
        items, depths, target = [chosen], [depth], 0
    depths = [float(d) for d in depths]
    if len(depths) != len(items):
        raise TaskError(f"{len(items)} needles but {len(depths)} depths")
    if any(not 0.0 <= d <= 1.0 for d in depths):
        raise TaskError(f"depths must be within [0, 1], got {depths}")

    hay_text = load_haystack() if haystack is None else haystack
    units = split_units(hay_text)
    for n in items:
        if n.text in hay_text:
            raise TaskError(f"the haystack already contains the needle {n.text!r}")
    counts = _unit_counts(tokenizer, units, hash((hay_text, len(units))))
    needle_counts = _count_tokens(tokenizer, [n.text for n in items])
    budget = context_tokens - sum(needle_counts)
    if budget < 1:
        raise TaskError(f"context_tokens={context_tokens} leaves no room beside the needles")
    starts_at = paragraph_starts(units)
    # its own stream, so the start does not depend on how the needle was chosen
    start = starts_at[random.Random(f"haystack-{seed}").randrange(len(starts_at))]

    best: tuple[int, str, list[int], list[int]] | None = None
    for _ in range(2):
        chosen_units = _select(counts, start, budget)
        text, char_starts = _assemble(units, counts, chosen_units, items, depths)
        n_tok, tok_starts = _measure(tokenizer, text, char_starts)
        if best is None or abs(n_tok - context_tokens) < abs(best[0] - context_tokens):
            best = (n_tok, text, char_starts, tok_starts)
        if abs(n_tok - context_tokens) <= _TOLERANCE * context_tokens:
            break
        # the parts' sum was off (joins merge or split tokens): rescale once
        estimated = sum(counts[i] for i in chosen_units) + sum(needle_counts)
        budget = budget + (context_tokens - n_tok) * (estimated / max(n_tok, 1))
    assert best is not None
    n_tok, text, char_starts, tok_starts = best

    tgt = items[target]
    meta: dict[str, Any] = {
        "seed": seed,
        "depth": depths[target],
        "depth_actual": tok_starts[target] / n_tok if tok_starts[target] >= 0 else None,
        "context_tokens": context_tokens,
        "context_tokens_actual": n_tok,
        "question_position": question_position,
        "n_needles": len(items),
        "needle_depths": depths,
        "needle_depths_actual": [t / n_tok if t >= 0 else None for t in tok_starts],
        "needle_char_starts": char_starts,
        "target": target,
        "distractors": [n.text for i, n in enumerate(items) if i != target],
        "distractor_answers": [n.answer for i, n in enumerate(items) if i != target],
        "haystack": "bundled" if haystack is None else "custom",
        "tokenizer": getattr(tokenizer, "name_or_path", type(tokenizer).__name__),
    }
    if name is None:
        stem = "needle" if len(items) == 1 else f"multineedle{len(items)}"
        name = f"{stem}-t{context_tokens}-d{depths[target]:.2f}-s{seed}"
    return Task(
        name=name,
        kind="needle",
        context=text,
        question=tgt.question,
        answer=tgt.answer,
        aliases=list(tgt.aliases),
        needle_text=tgt.text,
        meta=meta,
    )


def make_multi_needle_task(
    tokenizer: Any,
    n_needles: int = 3,
    context_tokens: int = 2000,
    seed: int = 0,
    target: int | None = None,
    depths: Sequence[float] | None = None,
    **kwargs: Any,
) -> Task:
    """Several same-form code-word needles; the question asks about one of them.

    The needles are drawn from ``CODEWORD_NEEDLES`` by ``seed`` (2 to 6), and
    the target (default: drawn by ``seed``) is the one asked about; the others
    are distractors whose answers a hedging reply may also list (the scorer
    flags that). Other keyword arguments go to ``make_needle_task``.
    """
    if not 2 <= n_needles <= len(CODEWORD_NEEDLES):
        raise TaskError(f"n_needles must be within 2..{len(CODEWORD_NEEDLES)}")
    rng = random.Random(f"multi-{seed}")
    picked = rng.sample(CODEWORD_NEEDLES, n_needles)
    if target is None:
        target = rng.randrange(n_needles)
    return make_needle_task(
        tokenizer,
        context_tokens=context_tokens,
        seed=seed,
        needles=picked,
        depths=depths,
        target=target,
        **kwargs,
    )


def make_custom_task(
    haystack_text: str,
    needle: str,
    question: str,
    answer: str,
    depth: float | None = None,
    name: str = "custom",
    aliases: Sequence[str] = (),
) -> Task:
    """A task from a user's own haystack, needle, question and answer.

    With ``depth`` the needle is inserted at the sentence boundary nearest that
    fraction of the text (by characters; no tokenizer needed). With
    ``depth=None`` the needle must already occur in the haystack verbatim,
    else TaskError. The answer should occur inside the needle so that its
    tokens can be tracked; ``meta["answer_in_needle"]`` records whether it does.
    """
    check_custom_prompt(haystack_text, needle, question, answer)
    needle = needle.strip()
    if depth is None:
        pos = haystack_text.find(needle)
        if pos < 0:
            raise TaskError(
                "the needle does not occur in the haystack; give a depth to insert it "
                "or paste the exact sentence"
            )
        context = haystack_text
    else:
        if needle in haystack_text:
            raise TaskError("the haystack already contains the needle; use depth=None")
        context, pos = insert_at_depth(haystack_text, needle, float(depth))
    in_needle = any(a.casefold() in needle.casefold() for a in [answer, *aliases] if a)
    meta = {
        "depth": depth,
        "depth_actual_chars": pos / max(len(context), 1),
        "needle_char_start": pos,
        "answer_in_needle": in_needle,
        "question_position": "inside",
    }
    return Task(
        name=name,
        kind="custom",
        context=context,
        question=question.strip(),
        answer=answer.strip(),
        aliases=list(aliases),
        needle_text=needle,
        meta=meta,
    )
