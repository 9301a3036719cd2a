"""The app's Mechanism tab is valid for every combination of its sliders."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pagekv.maths.mechanism import mechanism_view


@settings(max_examples=60, deadline=None)
@given(
    heads=st.integers(2, 8),
    distractors=st.integers(0, 6),
    sink_head=st.booleans(),
    n=st.integers(1, 32).map(lambda k: 32 * k),
    budget_pct=st.integers(5, 60),
    retrieval=st.sampled_from([0.0, 0.05, 0.5, 0.9, 1.0]),
    distractor_strength=st.sampled_from([0.0, 0.01, 0.48, 0.5]),
)
def test_every_slider_combination_gives_a_view(
    heads, distractors, sink_head, n, budget_pct, retrieval, distractor_strength
):
    view = mechanism_view(
        heads=heads,
        retrieval=retrieval,
        distractors=distractors,
        distractor_strength=distractor_strength,
        sink_head=sink_head,
        n=n,
        budget=budget_pct / 100,
    )
    assert [row[0] for row in view.rows] == ["entropy", "entropy_nosink", "mean", "max"]
    assert all(row[1] in ("kept", "evicted") for row in view.rows)
    clamped = distractors > heads - 1 - int(sink_head)
    assert any("distractor heads do not fit" in note for note in view.notes) == clamped


def test_the_default_sliders_with_a_sink_head():
    """The default sliders with "Add a sink head" give a view and say what they changed."""
    view = mechanism_view(heads=3, distractors=2, sink_head=True, n=64, budget=0.19)
    assert view.notes and "using 1" in view.notes[0]
    assert view.mech.roles.count("sink") == 1


def test_a_budget_below_the_protected_pages_is_raised():
    view = mechanism_view(n=32, budget=0.05)
    assert any("cannot hold the sink and window pages" in note for note in view.notes)
