"""What the page says: the introduction, the views' captions, message labels and a
lesson's heading. Plain strings (Markdown), no model and no Gradio."""

from __future__ import annotations


def message(kind: str, text: str) -> str:
    """A status line: "**Error:**", "**Note:**" or "**Done:**" and the text."""
    # Words, not emoji: emoji depend on the viewer's fonts.
    label = {"error": "**Error:**", "info": "**Note:**", "ok": "**Done:**"}[kind]
    return f"{label} {text}"


def lesson_markdown(lesson) -> str:
    """A lesson's heading, text and kind (live, constructed or replay)."""
    kind = {
        "live": "Live on the model: both sides decode now.",
        "constructed": "Constructed: no model; a group of heads built to show the mechanism.",
        "replay": f"Measured earlier by the replay harness, not live here: {lesson.cites}.",
    }[lesson.kind]
    from pagekv.views.lessons import lesson_text

    try:
        text = lesson_text(lesson)
    except (OSError, ValueError) as e:  # the replay's results file missing or incomplete
        text = f"{lesson.text}\n\n(The replay's numbers cannot be read: {e}.)"
    return f"### {lesson.title}\n{text}\n\n*{kind}*"


INTRO = """
# Page-EntroKV: which KV pages should a GQA group keep?
Under grouped-query attention, the *r* query heads of a group share one KV cache.
**Mean pooling** averages their attention and can drown the one head that found the
needle; **Page-EntroKV** weights each head by how *focused* it is (collision entropy,
after removing the attention-sink tokens) and keeps whole pages per (layer, group).
**Start with the lessons**: each sets both sides, runs the real model, and checks its
claim on what the model just did. Free exploration (presets and every control) is in
the left column, below the views on a narrow screen.
"""

#: What the scorer and allocation controls mean (their `info` lines).
SCORER_INFO = (
    "window: the last `window` tokens' attention scores the prompt; reconstruct: the "
    "model's attention while it repeats the prompt, which does not depend on the question "
    "(one extra pass over the prompt, once per prompt)"
)
ALLOCATION_INFO = (
    "uniform: every (layer, group) keeps the budget; global: the same total shared "
    "across (layer, group)s by page score, whole pages; layer: shared within each layer "
    "(pooled policies only)"
)

CAPTIONS = {
    "frame": "Each row is one (layer, group), each column one page of the prompt. "
    "**Look for** the outlined needle page: blue (kept) under one policy, grey (evicted) "
    "under the other.",
    "retention": "The fraction of the needle's answer tokens each (layer, group) kept. "
    "**Look for** layers where one policy holds the needle and the other lost it.",
    "answers": "The model's real greedy answers from the full and the evicted caches. "
    "*stored max*: tokens stored by the (layer, group) that stores the most; *needle kept*: "
    "fraction of the needle's tokens kept, mean over every (layer, group); *needle pages*: "
    "(layer, group)s that keep every needle page; *UOR max*: the union of the heads' picks "
    "over the tokens one head keeps, in the (layer, group) where it is largest. "
    "**Look for** whether the needle survives eviction in the answer, not only in the cache.",
    "weights": "Head weights within each group for the chosen layer, with and without sink "
    "isolation; the dotted line is mean pooling's 1/r. **Look for** sink heads that gain "
    "weight when isolation is off.",
    "overview": "Page-EntroKV's weights for every layer and head (groups separated by white "
    "lines). **Look for** groups dominated by a single head: there pooling matters most.",
    "sink": "Attention mass on the first n_sink tokens per head, and the sink heads' weight "
    "relative to the others. **Look for** the masquerade: a ratio far above 1 without "
    "isolation that drops with it.",
    "uor": "Head-independent selection must store the union of its heads' picks: UOR = union "
    "/ the tokens each head keeps. **Look for** how far above 1 it climbs at small budgets; "
    "pooled policies stay at exactly 1.",
    "replay": "Measured earlier by the replay harness on the bundled model, not live "
    "(docs/results.md, table T4): the share of needle prompts each policy and each kvpress "
    "press answered right, per budget and question position (the number on each bar; "
    "0 % is a bar of no height).",
    "mechanism": "Edit a constructed group of heads. **Look for** the retrieval head's weight "
    "w*: when w* s* beats the distractor page, entropy pooling keeps the needle while mean "
    "pooling (1/r) may not. This is a construction, shown beside the live model's results.",
}
