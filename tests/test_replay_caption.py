"""The replay view's caption counts its "look for" on the file's bars (it must not say
every bar is lower after compression while some are higher)."""

from __future__ import annotations

from pagekv.app.lesson_checks import replay_caption


def _row(policy, budget, mode, recall):
    return {"policy": policy, "budget": budget, "mode": mode, "recall": recall}


def test_counts_lower_same_and_higher_on_hand_worked_tables():
    tables = {
        "T4_recall": [
            _row("a", 0.2, "inside", 0.8), _row("a", 0.2, "after", 0.1),  # lower
            _row("b", 0.2, "inside", 0.1), _row("b", 0.2, "after", 0.3),  # higher
            _row("c", 0.2, "inside", 0.5), _row("c", 0.2, "after", 0.5),  # the same
            _row("c", 0.1, "after", 0.0),  # one mode only: not counted
            _row("full", 1.0, "inside", 1.0), _row("full", 1.0, "after", 0.9),  # aside
            _row("d", 0.2, "inside", None), _row("d", 0.2, "after", 0.0),  # no recall
        ],
        "T4_peer": [
            {"press": "snapkv", "budget": 0.2, "mode": "inside", "recall": 0.6},
            {"press": "snapkv", "budget": 0.2, "mode": "after", "recall": 0.0},  # lower
        ],
    }  # fmt: skip
    text = replay_caption(tables)
    assert "of the 4 policies and presses measured both ways at a budget, 2 score lower " \
        "after, 1 the same and 1 higher" in text, text  # fmt: skip


def test_the_committed_replay_has_bars_higher_after():
    text = replay_caption()
    assert "of the 9 policies and presses" in text and "5 score lower after" in text, text
    assert "2 the same and 2 higher" in text and "every bar" not in text
