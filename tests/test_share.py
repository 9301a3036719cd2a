"""Shareable links read as the page's load reads them (`pagekv.app.share`), and the
quick handlers beside the run: linked side B, the prompt sliders' ranges."""

from __future__ import annotations

from pagekv.app import handlers
from pagekv.app.lesson_checks import LESSON_TITLES
from pagekv.app.page_text import STALE_NOTE
from pagekv.app.run_inputs import RUN_DEFAULTS, RunInputs, parse_run
from pagekv.app.share import lesson_in_query, settings_in_query, share_js, shared_names


def test_a_link_names_a_lesson_by_number_or_id():
    assert lesson_in_query({"lesson": "1"}) == LESSON_TITLES[0]
    assert lesson_in_query({"lesson": "9"}) == LESSON_TITLES[8]
    assert lesson_in_query({"lesson": "sink-masquerade"}) == LESSON_TITLES[2]
    for bad in ("0", "10", "-1", "x", ""):
        assert lesson_in_query({"lesson": bad}) is None, bad
    assert lesson_in_query({}) is None


def test_a_link_to_settings_reads_numbers_flags_and_passes_the_rest_on():
    got = settings_in_query(
        {"budget_pct": "25", "link_b": "false", "policy_a": "mean", "seed": "abc", "x": "1"}
    )
    assert got == {"budget_pct": 25.0, "link_b": False, "policy_a": "mean", "seed": "abc"}
    assert settings_in_query({"curated": ""}) == {"curated": None}
    assert settings_in_query({"lesson": "3"}) is None  # a lesson, not settings
    assert settings_in_query({"settings": "default"}) == {}  # every default
    # What the run makes of a link's values: the same checks as any input.
    run = RunInputs(**settings_in_query({"context": "300", "link_b": "true"}))
    spec, a, b, _ = parse_run(run)
    assert spec.context == 300 and a.config.budget == b.config.budget == 0.2


def test_the_share_button_names_every_run_input_but_the_lesson():
    names = shared_names()
    assert "lesson" not in names and set(names) == set(RUN_DEFAULTS) - {"lesson"}
    js = share_js()
    assert js.startswith("(...values) => pagekvShareLink(") and '"budget_pct"' in js


def test_linked_b_shows_as_values_and_locks_them():
    a = ("after", 25.0, 16, 4, 32, 1.0)
    out = handlers.linked_b(True, *a)
    assert [u["value"] for u in out] == list(a) and all(u["interactive"] is False for u in out)
    out = handlers.linked_b(False, *a)
    assert all(u == {"interactive": True, "__type__": "update"} for u in out)


def test_a_prompt_slider_out_of_range_is_said():
    note = handlers.prompt_range_note("context")
    assert note(2000) == STALE_NOTE
    assert "Context length: 50 is below its range (300 to 8000); the box now holds 300" in note(50)
    assert "9000 is above its range (300 to 8000); the box now holds 8000" in note(9000)
    assert "the box held no number (its range is 300 to 8000); it now holds 300" in note(None)
    assert "a number too long to read exactly is above" in note(1e30)
