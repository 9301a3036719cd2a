"""What the page says: the introduction, the views' captions, message labels and a
lesson's heading. Plain strings (Markdown), no model and no Gradio."""

from __future__ import annotations


def message(kind: str, text: str) -> str:
    """A status line: "**Error:**", "**Note:**" or "**Done:**" and the text."""
    # Words, not emoji: emoji depend on the viewer's fonts.
    label = {"error": "**Error:**", "info": "**Note:**", "ok": "**Done:**"}[kind]
    return f"{label} {text}"


def lesson_markdown(lesson) -> str:
    """A lesson's place ("Lesson 3 of 8", with a link that opens it: `?lesson=3`), its
    heading, text and kind (live, constructed or replay)."""
    kind = {
        "live": "Live on the model: both sides decode now.",
        "constructed": "Constructed: no model; a group of heads built to show the mechanism.",
        "replay": f"Measured earlier by the replay harness, not live here: {lesson.cites}.",
    }[lesson.kind]
    from pagekv.app.lessons import LESSONS, lesson_text

    try:
        text = lesson_text(lesson)
    except (OSError, ValueError) as e:  # the replay's results file missing or incomplete
        text = f"{lesson.text}\n\n(The replay's numbers cannot be read: {e}.)"
    try:
        credit = lesson_text(lesson, field="credit")
    except (OSError, ValueError):
        credit = lesson.credit
    i = next(j for j, x in enumerate(LESSONS) if x.id == lesson.id) + 1
    place = (
        f"<small>Lesson {i} of {len(LESSONS)} · link to this lesson: "
        f"[?lesson={i}](?lesson={i}) · terms: Glossary, below</small>"
    )
    return f"{place}\n\n### {lesson.title}\n{text}\n\n**What this credits:** {credit}\n\n*{kind}*"


INTRO = """
# Page-EntroKV: which KV pages should a GQA group keep?
Under grouped-query attention the *r* query heads of a group share one KV cache (1).
If each head keeps its own picks, the group stores their union, up to *r* times the budget
(2). **Pooling** the heads first keeps the budget (3): **mean pooling** weights each head
1/*r*, **Page-EntroKV** by how *focused* it is (collision entropy without the
attention-sink tokens), and both keep whole pages per (layer, group). **The live lessons
back** pooling's budget (lesson 1, mean pooling as well) and sink isolation (3); whether
pages beat tokens depends on the cache (2); the paper's claim that entropy weighting keeps
needles better than mean pooling is **not reproduced** (lesson 6). Start with the lessons;
free exploration is in the left column (below the views on a narrow screen).
"""

#: The chart beside the drawing: what it shows (under it, `app.py`).
GLANCE_CAPTION = (
    "**Look for** per-head picks (head_independent) above the budget (1x), pooled sides at "
    "or under it."
)

#: Under each side's question position: the one rule both follow.
MODE_INFO = (
    "after = asked after compression (the strict test). A change runs at once; a position "
    "not run before prefills the prompt for it first (seconds)"
)

#: The note over the results when a prompt control changed without a run.
STALE_NOTE = (
    "**Note:** the prompt controls changed; the results below are for the previous prompt "
    "until you press Run."
)

#: The words the lessons use, for the Glossary under every lesson (`app.py`).
GLOSSARY = """
- **GQA, r**: grouped-query attention. The query heads of a layer come in groups; the
  *r* heads of a group (3 on SmolLM2, 7 on qwen-coder-0.5b) read one shared KV cache.
- **(layer, group)**: one group of one layer, the unit that keeps its own cache. Every
  figure row, table count ("27 of 90") and budget here is per (layer, group).
- **page**: a run of consecutive prompt tokens (16 by default) that a paged cache
  allocates and frees together; eviction keeps or drops whole pages. Page size 1 is
  token-level eviction.
- **budget**: the share of the prompt each (layer, group) keeps, `floor(budget x n)`
  tokens of an *n*-token prompt (a global allocation shares the same total across them).
- **protected pages**: the pages of the first *n_sink* tokens and of the last *window*
  tokens, always kept; the smallest budget is the one that holds them.
- **needle**: a sentence with the answer, hidden in a long text (the haystack); the
  question asks for it. *Needle kept* is the share of its answer tokens a cache kept.
- **attention sink**: the first few tokens, where many heads park attention they do not
  need. A **sink head** puts at least half of its attention there.
- **sink isolation**: the sink tokens left out of a head's attention row before its
  entropy is taken, so that a sink head does not look focused.
- **collision entropy**: of an attention row *a*, `-log sum_t a_t^2`: low when the row is
  focused on a few tokens, high when it is spread. Page-EntroKV weights the heads of a
  group by `softmax(-entropy / tau)`.
- **mean pooling**: every head of a group weighted 1/r.
- **head_independent**: every head picks its own pages, and the group stores the union.
- **UOR (union overhead ratio)**: the tokens that union holds over the tokens one head
  keeps; 1 for pooled policies, at most r.
- **question position**: *inside* the prompt (the observation window sees it) or *after*
  compression (the strict test: the cache is chosen without the question).
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
    "isolation; the dotted line is mean pooling's 1/r. **Look for** how far a group's "
    "weights stray from 1/r (there pooling by entropy and by mean part), and the heads "
    "isolation moves weight between: the one losing most is marked with its sink mass, the "
    "one gaining most (never a sink head) too.",
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
    "ruler_memory": "Measured earlier on RULER by `experiments/ruler.py`, not live "
    "(docs/ruler.md): each method's score against the memory its kept tokens hold, as a "
    "share of the full cache, one point per budget, in three cache layouts. Gathered: each "
    "(layer, KV head)'s kept tokens rounded up to 16-token pages (a cache that compacts, "
    "as this app's decode pool and KVzip's cache do). In place: the 16-token pages the "
    "kept tokens touch (a paged cache that never moves a token). Uniform: the fullest "
    "(layer, KV head)'s pages in every one. **Look for** the line highest at a given "
    "memory, and how the lines trade places from one layout to the next.",
    "ruler_pages": "Measured earlier on RULER by `experiments/ruler.py`, not live "
    "(docs/ruler.md): our entropy rows scored by the reconstruction pass in pages of 16, 4 "
    "and 1, score against memory in the gathered layout (what this app's decode pool "
    "holds) and in place (a paged cache that never moves a token). **Look for** which "
    "page size is highest at the same memory in each panel: one prompt above, many here.",
    "capacity": "What a budget buys. The first panel is live: how many prompts like this one "
    "a pool holds, the bytes of two full caches of it, with the full cache and at each "
    "side's budget (each prompt reserves its kept pages plus its question "
    "and 24 answer tokens, in its pages). The other two were measured earlier by "
    "`benchmarks/bench_capacity.py`, not live (docs/performance.md): the sequences such a "
    "pool held at once while decoding, and the batched decode's tokens per second, beside "
    "transformers' own continuous batching in the same bytes. **Look for** how many more "
    "rows a budget fits, and how much of that the measured tokens per second keep.",
    "mechanism": "Edit a constructed group of heads. **Look for** the retrieval head's weight "
    "w*: when w* s* beats the distractor page, entropy pooling keeps the needle while mean "
    "pooling (1/r) may not. This is a construction, shown beside the live model's results.",
}
