"""The `Task` record, how a task becomes token ids, and how its answer is scored.

A task is a long context with a short answer hidden in it (the "needle"), and
a question about it. `Task.build_prompt_ids` renders the prompt with the
tokenizer's chat template and finds, through the tokenizer's offset mapping
(never by searching ids), which prompt tokens spell the answer inside the
context: those are the needle tokens `N` whose retention the eviction metrics
measure (docs/design.md, "The data path", "Needle retention").

Prompt layout (one user turn)::

    <context>            (code tasks: inside a ```python fence)

    Question: <question>
    Answer with only the answer, as briefly as possible.

Question-after mode: `build_prompt_ids(tok, mode="after")` splits that same
token sequence in two: `context_ids` (template prefix + context), which is
prefilled and compressed, then `question_ids` (the question, the end of the
user turn and the assistant prefix), decoded after compression. The split is
made on the tokens of the whole prompt, so `context_ids + question_ids ==
input_ids` always holds exactly. Where a token straddles the end of the
context (some pre-tokenizers glue punctuation to the newline after it) that
token goes to `context_ids` and `split_exact` is False; with the bundled
SmolLM2 tokenizer the split is exact (tests check it).
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

TASK_KINDS = ("needle", "qa", "code", "custom")
QUESTION_POSITIONS = ("inside", "after")
ANSWER_INSTRUCTION = "Answer with only the answer, as briefly as possible."
#: Answer tokens decoded when a task names no ``max_new_tokens`` of its own.
DEFAULT_MAX_NEW_TOKENS = 24


def check_custom_prompt(
    haystack: str | None,
    needle: str | None,
    question: str | None,
    answer: str | None,
    need_haystack: bool = True,
) -> None:
    """The one check of a user's own prompt (CLI flags, the app's fields, a
    `PromptSpec`, `make_custom_task` all come here): the needle, question and answer
    come all together or not at all, each non-empty; with `need_haystack` the
    haystack text must be non-empty. Raises TaskError with a sentence a user can act on.
    """
    if need_haystack and (not isinstance(haystack, str) or not haystack.strip()):
        raise TaskError("the custom prompt is empty: paste a haystack text")
    parts = {"needle": needle, "question": question, "answer": answer}
    given = {k: v for k, v in parts.items() if isinstance(v, str) and v.strip()}
    blank = [k for k, v in parts.items() if v is not None and k not in given]
    if (given or blank or need_haystack) and len(given) < 3:
        missing = ", ".join(k for k in parts if k not in given)
        raise TaskError(
            f"a custom prompt needs {missing}: give the needle, question and answer together"
        )


def needle_depth(haystack: str | None, needle: str | None, depth: float | None) -> float | None:
    """Where to put a custom needle: None (keep it where it is) when the haystack
    already holds it verbatim, else `depth` (insert it there)."""
    if haystack and needle and needle.strip() and needle.strip() in haystack:
        return None
    return depth


class TaskError(ValueError):
    """A task cannot be built or rendered (bad input, needle not in context, ...)."""


@dataclass
class Task:
    """One evaluation item.

    Fields:
        name: a stable identifier (``"needle-d0.50-s0"``, ``"qa_brennholt_founding"``).
        kind: one of ``TASK_KINDS``.
        context: the long text the model reads (haystack with needle, document, code).
        question: the question asked after the context.
        answer: the expected answer string (short: a number, a name, a code word).
        aliases: other acceptable answers (scored like ``answer``).
        needle_text: the exact substring of ``context`` that holds the answer
            (the needle sentence, the evidence sentence or code line), or None.
        meta: free-form details: depth, seed, token counts, difficulty, ...
        max_new_tokens: how many answer tokens to decode for this task, or None
            for ``DEFAULT_MAX_NEW_TOKENS`` (see ``default_max_new_tokens``).
            Curated tasks set it from what the bundled model's full-cache answer
            needs (the model restates the question before the answer).
    """

    name: str
    kind: str
    context: str
    question: str
    answer: str
    aliases: list[str] = field(default_factory=list)
    needle_text: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    max_new_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in TASK_KINDS:
            raise TaskError(f"task kind {self.kind!r} is not one of {TASK_KINDS}")
        for attr in ("context", "question", "answer"):
            value = getattr(self, attr)
            if not isinstance(value, str) or not value.strip():
                raise TaskError(f"task {self.name!r}: {attr} must be a non-empty string")
        self.aliases = [a for a in (self.aliases or []) if isinstance(a, str) and a.strip()]
        m = self.max_new_tokens
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise TaskError(
                f"task {self.name!r}: max_new_tokens must be an integer >= 1; got {m!r}"
            )
        if self.needle_text is not None and self.needle_text not in self.context:
            raise TaskError(
                f"task {self.name!r}: the needle text {_short(self.needle_text)!r} "
                "does not occur in the context"
            )

    # ----------------------------------------------------------------- answers
    @property
    def answers(self) -> list[str]:
        """``answer`` followed by the aliases, duplicates removed."""
        return list(dict.fromkeys([self.answer, *self.aliases]))

    def needle_span(self) -> tuple[int, int] | None:
        """Character span ``[start, end)`` of ``needle_text`` in ``context`` (first match)."""
        if self.needle_text is None:
            return None
        start = self.context.find(self.needle_text)
        if start < 0:  # __post_init__ checks this, but fields are mutable
            raise TaskError(f"task {self.name!r}: the needle text does not occur in the context")
        return start, start + len(self.needle_text)

    def answer_span(self) -> tuple[int, int] | None:
        """Character span of the answer inside the needle, as an offset into ``context``.

        Searches ``answer`` then each alias inside ``needle_text``, first exactly
        and then case-insensitively. None when there is no needle text or no
        answer string occurs inside it (the needle then stands for itself).
        """
        span = self.needle_span()
        if span is None:
            return None
        needle = self.needle_text or ""
        for fold in (False, True):
            hay = needle.casefold() if fold else needle
            for a in self.answers:
                i = hay.find(a.casefold() if fold else a)
                if i >= 0 and len(a) > 0:
                    return span[0] + i, span[0] + i + len(a)
        return None

    # ----------------------------------------------------------------- prompt
    def _context_block(self) -> tuple[str, int]:
        """The context as shown in the prompt, and the context's offset inside it."""
        if self.kind == "code":
            head = "```python\n"
            tail = "```" if self.context.endswith("\n") else "\n```"
            return f"{head}{self.context}{tail}", len(head)
        return self.context, 0

    def user_content(self) -> str:
        """The single user message: context, then question and instruction."""
        block, _ = self._context_block()
        return f"{block}\n\nQuestion: {self.question}\n{ANSWER_INSTRUCTION}"

    def plain_prompt(self) -> str:
        """Fallback prompt for tokenizers without a chat template."""
        block, _ = self._context_block()
        return f"Context:\n{block}\n\nQuestion: {self.question}\nAnswer:"

    def prompt_messages(self, question_position: str = "inside") -> list[dict[str, str]]:
        """Chat messages for ``tokenizer.apply_chat_template``.

        The text is the same for both positions: "after" differs only in where
        the caller cuts the tokens (see ``build_prompt_ids(mode="after")``).
        """
        _check_position(question_position)
        return [{"role": "user", "content": self.user_content()}]

    def render_prompt(self, tokenizer: Any) -> tuple[str, int, bool]:
        """Prompt text, the character offset of ``context`` in it, and whether it is templated.

        With a chat template the text ends with the assistant generation prefix
        (``add_generation_prompt=True``); without one it is ``plain_prompt()``.
        """
        block, ctx_in_block = self._context_block()
        if getattr(tokenizer, "chat_template", None):
            content = self.user_content()
            text = tokenizer.apply_chat_template(
                self.prompt_messages(), tokenize=False, add_generation_prompt=True
            )
            if not isinstance(text, str):
                raise TaskError("apply_chat_template(tokenize=False) did not return a string")
            where = text.find(content)
            if where < 0:
                raise TaskError(
                    "the chat template altered the user message, so the context "
                    "cannot be located in the prompt"
                )
            return text, where + ctx_in_block, True
        return self.plain_prompt(), len("Context:\n") + ctx_in_block, False

    def build_prompt_ids(self, tokenizer: Any, mode: str | None = None) -> dict[str, Any]:
        """Tokenize the prompt and locate the needle's answer tokens.

        Args:
            tokenizer: a fast Hugging Face tokenizer (offset mapping needed).
            mode: "inside" or "after"; None takes ``meta["question_position"]``
                (default "inside").

        Returns a dict with
            input_ids: list[int], the whole prompt, ending with the assistant prefix;
            needle_token_positions: list[int], indices into input_ids of the tokens
                that overlap the answer string inside the context (the whole needle
                text when the answer is not inside it, see ``needle_positions_of``;
                empty when the task has no needle text);
            needle_text_positions: list[int], tokens overlapping the whole needle text;
            needle_positions_of: "answer", "needle" or None;
            context_token_range: (first, end) token indices covering the context;
            text: the prompt string; templated: bool; mode: str;
        and, for mode "after",
            context_ids: input_ids[:k] (template prefix + context),
            question_ids: input_ids[k:] (question, end of turn, assistant prefix),
            split_exact: whether no token straddles the end of the context.
        """
        mode = mode or self.meta.get("question_position", "inside")
        _check_position(mode)
        text, ctx_start, templated = self.render_prompt(tokenizer)
        ctx_end = ctx_start + len(self.context)
        try:
            enc = tokenizer(
                text,
                add_special_tokens=not templated,  # a template already holds BOS etc.
                return_offsets_mapping=True,
            )
        except NotImplementedError as exc:  # slow (Python) tokenizers have no offsets
            raise TaskError("a fast tokenizer is needed to locate the needle tokens") from exc
        ids = list(enc["input_ids"])
        offsets = [tuple(o) for o in enc["offset_mapping"]]

        def overlapping(lo: int, hi: int) -> list[int]:
            # (0, 0) offsets are special tokens; they never overlap a span
            return [i for i, (s, e) in enumerate(offsets) if e > s and s < hi and e > lo]

        def in_context(span: tuple[int, int] | None) -> list[int]:
            return [] if span is None else overlapping(ctx_start + span[0], ctx_start + span[1])

        out: dict[str, Any] = {"input_ids": ids, "text": text, "templated": templated, "mode": mode}
        ctx_tokens = overlapping(ctx_start, ctx_end)
        out["context_token_range"] = (ctx_tokens[0], ctx_tokens[-1] + 1) if ctx_tokens else (0, 0)

        needle_span, answer_span = self.needle_span(), self.answer_span()
        out["needle_text_positions"] = in_context(needle_span)
        if answer_span is not None:  # the answer inside the needle
            out["needle_token_positions"] = in_context(answer_span)
            out["needle_positions_of"] = "answer"
        else:  # the needle stands for itself (no needle text: no answer span either)
            out["needle_token_positions"] = list(out["needle_text_positions"])
            out["needle_positions_of"] = None if needle_span is None else "needle"

        if mode == "after":
            # k = one past the last token that touches the context; a token that
            # straddles the context's end stays on the context side.
            k = out["context_token_range"][1]
            out["context_ids"], out["question_ids"] = ids[:k], ids[k:]
            out["split_exact"] = k == 0 or offsets[k - 1][1] <= ctx_end
            assert out["context_ids"] + out["question_ids"] == ids
            if not out["question_ids"]:
                raise TaskError("the question part of the prompt is empty")
        return out

    # -------------------------------------------------------------- plumbing
    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready copy (for exports; `asdict` copies every value)."""
        return asdict(self)


def default_max_new_tokens(task: Task | None, fallback: int = DEFAULT_MAX_NEW_TOKENS) -> int:
    """The answer tokens to decode for `task` when the caller gives no number:
    the task's own ``max_new_tokens`` (curated tasks carry one, sized for their
    expected answer), else `fallback`.

    >>> default_max_new_tokens(Task("t", "custom", "ctx", "q?", "a", max_new_tokens=30))
    30
    >>> default_max_new_tokens(None)
    24
    """
    m = getattr(task, "max_new_tokens", None)
    return int(m) if m is not None else int(fallback)


def _check_position(position: str) -> None:
    if position not in QUESTION_POSITIONS:
        raise TaskError(f"question position {position!r} is not one of {QUESTION_POSITIONS}")


def _short(text: str, n: int = 60) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


# ------------------------------------------------------------------------------ scoring
# Scoring a model's answer against a task, honestly.
#
# Normalisation (``normalize``), applied to prediction and answers alike:
#
# 1. Unicode NFKC, then every dash-like character becomes ``-`` and curly
#    quotes become straight ones; then casefold.
# 2. Thousands separators between digits go: ``1,865`` -> ``1865``.
# 3. The text is cut into word tokens: runs of letters/digits/underscore,
#    joined by ``-``, ``.``, ``:`` or ``/`` only when a letter or digit sits on
#    both sides (so ``PELICAN-42``, ``3.5``, ``8:30``, ``LARK-HY`` stay whole),
#    with a trailing ``%`` kept (``12%`` is not ``12``). Everything else
#    (surrounding punctuation, quotes, apostrophes, ``&``, currency signs) is a
#    separator.
# 4. Tokens are joined by single spaces.
#
# ``contains`` then asks whether the answer's tokens occur as a contiguous run
# of the prediction's tokens: word boundaries come for free, so "4" does not
# match "42" and "42" does not match "PELICAN-42". Deliberately strict:
# "PELICAN 42" does not match "PELICAN-42", and "41" does not match "41.0"
# unless the task lists it as an alias; a strict scorer can only understate
# recall. An empty prediction (or an answer that normalises to nothing) never
# matches.
#
# ``score`` also reports ``hedged``: the prediction contains the answer of a
# distractor needle (multi-needle tasks). A hedged prediction is not counted
# correct: listing every code word is not retrieving the right one.

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
