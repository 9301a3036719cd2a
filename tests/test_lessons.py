"""Lessons: data that is well formed, observations that can fail, and every lesson
checked on the bundled model (`python -m pagekv lessons --check`)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pagekv import EvictionConfig, plan
from pagekv.app.lessons import (
    LESSONS,
    VIEWS,
    WORDS,
    WORDS_FILE,
    answers,
    get_lesson,
    layer_for,
    lesson_text,
    load_replay,
    number,
    read_numbers,
    read_words,
    shared_budget_answers,
    sink_layer,
    sink_masquerade,
    tie,
    union_over_budget,
)
from pagekv.cli import main
from pagekv.paths import POOLING_SEARCH_PATH

ROOT = Path(__file__).resolve().parents[1]


def _sentences(text: str) -> int:
    return len([s for s in re.split(r"(?<=[.!?])\s+(?=[A-Z])", text.strip()) if s])


@pytest.mark.parametrize("lesson", LESSONS, ids=[x.id for x in LESSONS])
def test_lesson_is_well_formed(lesson):
    text = lesson_text(lesson)
    assert 3 <= _sentences(text) <= 7, (lesson.id, _sentences(text))
    assert "{" not in text and "}" not in text, text  # every replay number filled in
    assert lesson.views and set(lesson.views) <= set(VIEWS)
    assert lesson.title and lesson.observation.statement
    if lesson.kind == "live":
        assert lesson.a != lesson.b, "the two sides must differ"
    if lesson.kind == "replay":  # the cite names a file of the repository
        cited = re.findall(r"\b(?:docs|assets)/[\w./-]+\.\w+", lesson.cites or "")
        assert cited and all((ROOT / path).is_file() for path in cited), lesson.cites


def test_lesson_ids_unique_and_lookup():
    ids = [x.id for x in LESSONS]
    assert len(set(ids)) == len(ids) == 9
    assert get_lesson("strict-test").b.mode == "after"
    with pytest.raises(ValueError, match="no lesson"):
        get_lesson("nope")


WORDS_MD = """# preamble, any text

## one

### title

First *lesson*

### text

A text over
two lines.

### credit

Its credit.

## two

### title

Second
### text
B.
### credit
C.
"""


def test_read_words_takes_each_field_as_one_paragraph():
    assert read_words(WORDS_MD) == {
        "one": {
            "title": "First *lesson*",
            "text": "A text over two lines.",
            "credit": "Its credit.",
        },
        "two": {"title": "Second", "text": "B.", "credit": "C."},
    }


@pytest.mark.parametrize(
    "broken, message",
    [
        (WORDS_MD.replace("### credit\n\nIts credit.\n", ""), "needs"),  # a field missing
        (WORDS_MD.replace("### title\n\nSecond", "### text\n\nSecond"), "unexpected"),  # twice
        (WORDS_MD.replace("### credit\nC.", "### credits\nC."), "unexpected"),  # unknown
        (WORDS_MD.replace("## two", "## one"), "two sections"),
        (WORDS_MD.replace("## two\n", "## two\nstray words\n"), "outside"),
        (WORDS_MD.replace("B.", "  "), "empty text"),
        (
            WORDS_MD.replace("### title\n\nFirst", "### text\n\nFirst").replace(
                "### text\n\nA text", "### title\n\nA text"
            ),
            "in order",
        ),
    ],
)
def test_read_words_refuses_a_malformed_file(broken, message):
    assert broken != WORDS_MD
    with pytest.raises(ValueError, match=message):
        read_words(broken)


def test_every_lesson_shows_its_own_words_from_the_file():
    """The app's words are lessons.md's: one section per lesson, none left over, each
    lesson's title, text and credit the file's."""
    on_file = read_words(WORDS_FILE.read_text(encoding="utf-8"))
    assert on_file == WORDS and list(on_file) == [x.id for x in LESSONS]
    for lesson in LESSONS:
        got = {"title": lesson.title, "text": lesson.text, "credit": lesson.credit}
        assert got == on_file[lesson.id]


def _fake_comparison(correct: dict, answers_text: dict | None = None, plans=None, recs=None):
    """A comparison whose records hold what the checks read of a `RunResult`."""
    unread = {"needle_retention": None, "uor": {"mean": 1.0, "max": 1.0}, "policy": "some"}
    records = {
        k: SimpleNamespace(
            **unread
            | {"correct": v, "answer": (answers_text or {}).get(k, "x")}
            | (recs or {}).get(k, {})
        )
        for k, v in correct.items()
    }
    plans = plans or {}
    return SimpleNamespace(records=records, plan_of=lambda key: plans[key])


def test_answers_observation_holds_and_fails():
    comp = _fake_comparison({"full": True, "A": True, "B": False})
    assert answers(full=True, a=True, b=False).check(comp).holds
    assert not answers(full=True, a=False, b=True).check(comp).holds
    assert not answers(full=False).check(comp).holds
    assert answers(a=True).check(comp).holds  # None: not part of the claim


def test_shared_budget_answers_checks_answers_and_totals():
    recs = {
        "A": {"union_tokens": [[8, 8], [8, 8]], "stored_tokens": [[8, 8], [8, 8]]},
        "B": {
            "union_tokens": [[4, 16], [12, 8]],
            "stored_tokens": [[4, 16], [12, 8]],
            "budget_tokens": 10,
        },
    }
    right = {"full": True, "A": False, "B": True}
    comp = _fake_comparison(right, recs=recs)
    found = shared_budget_answers(a=False, b=True).check(comp)
    assert found.holds, found.measured
    v = found.values
    assert (v["kept_a"], v["kept_b"], v["budget_total"], v["stored_b"]) == (32, 40, 40, 40)
    assert "B's (layer, group)s keep 4 to 16" in found.measured
    # B over the budget's total fails it, and so does a wrong answer.
    over = {k: dict(v) for k, v in recs.items()}
    over["B"]["union_tokens"] = [[4, 16], [12, 9]]
    assert not shared_budget_answers(False, True).check(_fake_comparison(right, recs=over)).holds
    wrong = _fake_comparison(right | {"B": False}, recs=recs)
    assert not shared_budget_answers(False, True).check(wrong).holds
    # A decode cache that pads B's groups of a layer to one length fails it too.
    padded = {k: dict(v) for k, v in recs.items()}
    padded["B"]["stored_tokens"] = [[16, 16], [12, 12]]
    found = shared_budget_answers(False, True).check(_fake_comparison(right, recs=padded))
    assert not found.holds and found.values["stored_b"] == 56


def _profiles(L=2, H=6, n=64, seed=0, sharp=None):
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(L, H, n, generator=gen)
    if sharp is not None:  # head -> (token, weight): a focused head
        for h, (t, w) in sharp.items():
            x[:, h, t] += w
    return x / x.sum(-1, keepdim=True)


def test_union_over_budget_measures_the_union():
    prof = _profiles(sharp={0: (10, 50.0), 1: (30, 50.0), 2: (50, 50.0)})
    p = plan(prof, 2, EvictionConfig(policy="head_independent", budget=0.3, page_size=4, window=4))
    rec = {"union_tokens": p.union_tokens.tolist(), "budget_tokens": p.budget_tokens}
    comp = _fake_comparison({"A": True}, plans={"A": p}, recs={"A": rec})
    ratio = float(p.union_tokens.max()) / p.budget_tokens
    assert union_over_budget("A", ratio - 1e-6).check(comp).holds
    assert not union_over_budget("A", ratio + 1e-3).check(comp).holds
    assert value_of(union_over_budget("A", 1.0), comp, "max_ratio") == pytest.approx(ratio)


def value_of(obs, comp, key):
    return obs.check(comp).values[key]


def test_tie_observation_can_fail():
    # One focused head in each group (heads 0 and 4), so entropy and mean pooling part
    # somewhere: both figures the check compares lie strictly inside their ranges.
    prof = _profiles(sharp={0: (20, 5.0), 4: (40, 3.0)})
    cfg = EvictionConfig(budget=0.4, page_size=4, window=4)
    pa, pb = plan(prof, 2, cfg.replace(policy="mean")), plan(prof, 2, cfg)
    # The two figures, measured here from the kept masks and the head weights.
    L, G, _ = pa.keep.shape
    r = pb.weights_isolated.shape[1] // G
    shared, tops = [], []
    for layer in range(L):
        for g in range(G):
            a = set(pa.keep[layer, g].nonzero().flatten().tolist())
            b = set(pb.keep[layer, g].nonzero().flatten().tolist())
            shared.append(len(a & b) / len(a))
            tops.append(max(pb.weights_isolated[layer, g * r : (g + 1) * r].tolist()))
    overlap, mean_top = sum(shared) / len(shared), sum(tops) / len(tops)
    assert 0.5 < overlap < 1 - 1e-3 and 1 / r + 0.05 < mean_top < 0.99, (overlap, mean_top)
    comp = _fake_comparison({"A": True, "B": True}, plans={"A": pa, "B": pb})
    # The weight bound is a multiple of 1/r (a fixed bound would hold trivially for a
    # large r: 0.5 against 1/7 = 0.14 on qwen-coder-0.5b).
    found = tie(overlap - 1e-6, (mean_top + 1e-6) * r).check(comp)
    assert found.holds, found.measured
    assert found.values["overlap"] == pytest.approx(overlap)
    assert found.values["mean_top_weight"] == pytest.approx(mean_top)
    assert found.values["bound"] == pytest.approx(mean_top + 1e-6)
    assert f"r = {r}" in found.measured
    # Thresholds just past each measured figure, so each part of the check can fail on its own.
    assert not tie(overlap + 1e-6, (mean_top + 1e-6) * r).check(comp).holds
    assert not tie(overlap - 1e-6, (mean_top - 1e-6) * r).check(comp).holds
    differ = _fake_comparison(
        {"A": True, "B": True}, answers_text={"A": "x", "B": "y"}, plans={"A": pa, "B": pb}
    )
    assert not tie(overlap - 1e-6, (mean_top + 1e-6) * r).check(differ).holds


def test_sink_masquerade_reads_the_weights():
    # Layer 0, group 0: head 0 is a sink head (mass on token 0), heads 1-2 spread theirs.
    n = 64
    prof = torch.full((1, 3, n), 1.0)
    prof[0, 0, 0] = 400.0
    prof = prof / prof.sum(-1, keepdim=True)
    p = plan(prof, 1, EvictionConfig(policy="entropy", budget=0.5, page_size=4, window=4))
    comp = _fake_comparison({"B": True}, plans={"B": p})
    found = sink_masquerade(0, 2.0, 1.5).check(comp)
    assert found.holds, found.measured
    assert not sink_masquerade(0, found.values["raw"] + 1, 1.5).check(comp).holds
    assert not sink_masquerade(0, 2.0, found.values["isolated"] - 1e-6).check(comp).holds


def test_replay_numbers_are_the_files():
    """A replay number is read from the committed tables: one row, or a sum over rows."""
    tables = load_replay()["tables"]
    row = next(r for r in tables["T4_recall"] if r["recall"] not in (None, 0.0))
    where = {k: row[k] for k in ("mode", "budget", "policy")}
    assert number("T4_recall", "recall", **where).read(tables) == row["recall"]
    total = sum(r["prompts"] for r in tables["T7_answers"])
    assert number("T7_answers", "prompts", total=True).read(tables) == total
    # No row, or several rows where one is wanted: no number (never a guess).
    assert number("T4_recall", "recall", policy="nope").read(tables) is None
    assert number("T4_recall", "recall", policy=row["policy"]).read(tables) is None
    with pytest.raises(ValueError, match="lack"):
        read_numbers({"x": number("T4_recall", "recall", policy="nope")}, tables)


def test_replay_lesson_text_and_check_follow_the_file():
    """Lesson 8's text prints the file's numbers, and its observation is decided on
    them: a file where the recall does not drop after compression fails it."""
    import copy

    lesson = get_lesson("kvpress-same-memory")
    replay = load_replay()
    v = read_numbers(dict(lesson.numbers), replay["tables"])
    text = lesson_text(lesson, replay["tables"])
    assert f"{v['snap_inside']:.0%}" in text and f"{v['ours_after']:.0%}" in text, text
    found = lesson.observation.check(replay)
    assert found.holds, found.measured
    assert "T4_" not in found.measured and "SnapKV" in found.measured  # words, not keys
    changed = copy.deepcopy(replay)
    for row in changed["tables"]["T4_recall"]:
        if row["policy"] == "entropy" and row["budget"] == 0.2 and row["mode"] == "after":
            row["recall"] = 1.0  # better after than inside: the claim no longer holds
    assert not lesson.observation.check(changed).holds
    assert "100%" in lesson_text(lesson, changed["tables"])


def test_tie_lesson_cites_t7_from_the_file():
    lesson = get_lesson("entropy-vs-mean")
    tables = load_replay()["tables"]
    rows = tables["T7_answers"]
    text = lesson_text(lesson, tables)
    pairs, ties = sum(r["prompts"] for r in rows), sum(r["ties"] for r in rows)
    both = sum(r["ties_both_right"] for r in rows)
    assert f"{ties} of {pairs} prompt-settings" in text and f"both right on {both}" in text


def test_layer_rules_resolve_on_the_model_that_ran():
    prof = _profiles(L=3, sharp={4: (20, 50.0)})  # layer-independent: one focused head
    prof[1, 1, 5] += 500.0  # layer 1, group 0: the most focused head of all
    prof = prof / prof.sum(-1, keepdim=True)
    p = plan(prof, 2, EvictionConfig(policy="entropy", budget=0.4, page_size=4, window=4))
    assert layer_for(get_lesson("sink-masquerade"), p) == sink_layer(p)  # "sink"
    assert layer_for(get_lesson("entropy-vs-mean"), p) == 1  # "strongest"
    assert layer_for(get_lesson("gqa-cost"), p) == 0
    last = dataclasses.replace(get_lesson("gqa-cost"), layer="last")
    assert layer_for(last, p) == 2  # "last" of 3 layers


def test_sink_layer_is_where_sinks_outweigh_the_others_most():
    """Hand-worked: the sink layer is layer 1 (advantage 4 > 1.5); without sink heads, layer 0."""
    w = torch.full((3, 4), 0.5)
    w[1, :2] = torch.tensor([0.8, 0.2])
    w[2, 2:] = torch.tensor([0.6, 0.4])
    sinks = torch.zeros(3, 4, dtype=torch.bool)
    sinks[1, 0] = sinks[2, 2] = True
    p = SimpleNamespace(weights_nosink=w, sink_heads=sinks, n_groups=2)
    assert sink_layer(p) == 1
    w[2, 2:] = torch.tensor([0.9, 0.1])  # now layer 2's group: advantage 9
    assert sink_layer(p) == 2
    assert sink_layer(SimpleNamespace(weights_nosink=w, sink_heads=sinks & False, n_groups=2)) == 0


def test_lessons_list_without_model(capsys):
    assert main(["lessons", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [x["id"] for x in out["lessons"]] == [x.id for x in LESSONS]


@pytest.mark.slow
def test_every_lesson_holds_on_the_bundled_model(capsys):
    """`python -m pagekv lessons --check --json` exits 0: every observation holds live."""
    rc = main(["lessons", "--check", "--json"])
    out = json.loads(capsys.readouterr().out)
    rows = {r["id"]: r for r in out["lessons"]}
    assert set(rows) == {x.id for x in LESSONS}
    for r in rows.values():
        print(f"{r['id']}: {r['measured']}")
    assert out["failed"] == [], {k: rows[k]["measured"] for k in out["failed"]}
    assert rc == 0
    assert rows["gqa-cost"]["values"]["max_ratio"] >= 2.0
    assert rows["sink-masquerade"]["values"]["raw"] >= 2.0
    shared = rows["reconstruct"]["values"]
    assert shared["kept_b"] <= shared["budget_total"]


def test_tie_lesson_cites_the_pooling_search_from_its_file():
    """Lesson 6's counts are `POOLING_SEARCH_PATH`'s totals, never a copy."""
    lesson = get_lesson("entropy-vs-mean")
    total = json.loads(POOLING_SEARCH_PATH.read_text())["total"]
    text = lesson_text(lesson)
    differ = total["only_mean"] + total["only_entropy"]
    assert f"a search of {total['measured']} prompt-settings" in text, text
    assert f"different verdicts on {differ}: mean alone right on {total['only_mean']}" in text
    made_up = dict(total, measured=7, only_mean=1, only_entropy=5)
    text = lesson_text(lesson, search=made_up)
    assert "a search of 7 prompt-settings found different verdicts on 6" in text
    assert "entropy alone right on 5" in text


def test_every_lesson_says_what_it_credits():
    """Each lesson names the part of the method its result belongs to, and the introduction credits
    mean pooling's share fairly."""
    from pagekv.app.page_text import INTRO, lesson_markdown

    for lesson in LESSONS:
        credit = lesson_text(lesson, field="credit")
        assert credit and "{" not in credit, lesson.id
        assert f"**What this credits:** {credit}" in lesson_markdown(lesson), lesson.id
    shared = {"gqa-cost", "pages-vs-tokens", "strict-test", "kvpress-same-memory",
              "what-a-budget-buys"}  # fmt: skip
    for lesson_id in shared:  # results mean pooling shares say so
        credit = get_lesson(lesson_id).credit.lower()
        assert "mean pooling" in credit or "any policy" in credit, lesson_id
    assert "drown" not in INTRO and "not reproduced" in INTRO
    assert "tie" not in get_lesson("entropy-vs-mean").title  # the check says which


def test_lesson_8_names_the_pooled_policies_the_replay_cannot_tell_apart():
    """Lesson 8 credits the pooled policies alike where the replay's T4 recalled the same; a file
    where mean recalled less changes the text."""
    from pagekv.app.lessons import T4_POOLED

    tables = load_replay()["tables"]
    for mode in ("inside", "after"):
        recalls = {
            r["policy"]: r["recall"]
            for r in tables["T4_recall"]
            if r["budget"] == 0.2 and r["mode"] == mode and r["policy"] in T4_POOLED
        }
        assert set(recalls) == set(T4_POOLED) and len(set(recalls.values())) == 1, recalls
    lesson = get_lesson("kvpress-same-memory")
    v = read_numbers(dict(lesson.numbers), tables)
    credit = lesson_text(lesson, tables, field="credit")
    assert f"mean pooling recalled {v['mean_inside']:.0%} and {v['mean_after']:.0%}" in credit
    assert v["mean_inside"] == v["ours_inside"] and v["mean_after"] == v["ours_after"]


def test_the_readme_counts_the_live_lessons_the_console_warms():
    """The app's guide (docs/app.md) counts the live lessons the console warms."""

    from pagekv.app.lessons import LESSONS

    words = {5: "five", 6: "six", 7: "seven", 8: "eight"}
    live = sum(x.kind == "live" for x in LESSONS)
    readme = (ROOT / "docs" / "app.md").read_text()
    assert f"the app computes its {words[live]} live lessons" in readme


def test_lesson_8_says_what_it_compares_at():
    """Lesson 8 says what each comparison holds equal (T4's token budget, RULER's equal memory per
    layout) and leads only past 0."""
    from pagekv.app.lessons import LAYOUT_NAMES, get_lesson, lesson_text

    lesson = get_lesson("kvpress-same-memory")
    assert "equal memory" in lesson.title and "cache by cache" in lesson.title
    text = " ".join(lesson_text(lesson).split())
    assert "at 20 % of a needle prompt" in text and "at equal memory in three cache" in text
    assert all(name in text for name in LAYOUT_NAMES.values())
    assert "A lead needs its 95 % interval clear of 0" in text
    assert "{" not in text  # every number filled in from the results
