"""What a newcomer sees in the browser, checked in chromium at 1280 and 800 px: linked sides, the
budget's one rule, figures that fit and name what they measure, presets, the mechanism, verdicts,
prompt ranges, links, the glossary and the presenter view. Needs what tests/test_browser.py needs
(its fixture)."""

from __future__ import annotations

import math
import re

import pytest

import app

from .app_server import launched_app
from .test_browser import (
    FIRST_RESULT_MS,
    UPDATE_MS,
    QueueLog,
    browser_page,  # noqa: F401  (the fixture)
    observation_text,
    pick_lesson,
    status_text,
    table_rows,
    wait_checked,
    wait_drawn,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:.*no_silent_downcasting"),
    pytest.mark.filterwarnings("ignore:The copy keyword is deprecated"),
]

WIDTHS = (1280, 800)
#: A step that must follow at once (a run of a cached prompt, or no run at all).
SOON_MS = 60_000


@pytest.fixture(scope="module")
def served(browser_page):  # noqa: F811
    """`(page, demo, url)`: the app launched, live lessons warmed, the page at 1280 px."""
    with launched_app() as (demo, url):
        assert app.warm_lessons() == sum(x.kind == "live" for x in app.LESSONS)
        browser_page.set_viewport_size({"width": 1280, "height": 1000})
        yield browser_page, demo, url


def open_app(page, url, query: str = "") -> None:
    page.goto(url + "/" + query, wait_until="domcontentloaded")
    wait_checked(page)


def wait_status(page, pattern: str, timeout=UPDATE_MS) -> str:
    """Until the status line matches `pattern` (a regex) and no longer decodes; on a
    timeout, the failure says what the status line said last."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:
        page.wait_for_function(
            "([p]) => { const el = document.querySelector('#run-status');"
            " return el && new RegExp(p, 's').test(el.innerText)"
            " && !el.innerText.includes('Decoding'); }",
            arg=[pattern],
            timeout=timeout,
        )
    except PlaywrightTimeout:
        last = page.locator("#run-status").inner_text(timeout=5_000)
        raise AssertionError(
            f"no status matching {pattern!r} within {timeout / 1000:.0f} s; it says: {last!r}"
        ) from None
    return page.locator("#run-status").inner_text()


def wait_lesson_checked(page, lesson, timeout=FIRST_RESULT_MS) -> None:
    """Until `lesson`'s observation shows, checked on this run."""
    page.wait_for_function(
        "([s]) => { const o = document.querySelector('#lesson-observation');"
        " return o.innerText.includes(s) && o.innerText.includes('checked now on'); }",
        arg=[lesson.observation.statement],
        timeout=timeout,
    )


def number_box(page, label: str):
    return page.locator(f'input[aria-label="number input for {label}"]').first


def type_into(box, text: str, key: str = "Enter") -> None:
    """Click into a number box, replace its text by `text` as typed keys, press `key`."""
    box.click()
    box.press("Control+A")
    box.press("Backspace")
    if text:
        box.press_sequentially(text)
    box.press(key)


def prompt_tokens(page) -> int:
    return int(re.search(r"(\d+) prompt tokens", status_text(page)).group(1))


def open_accordion(page, name: str) -> None:
    button = page.get_by_text(name, exact=True).first
    if button.locator("xpath=..").get_attribute("class") and "open" in (
        button.locator("xpath=..").get_attribute("class") or ""
    ):
        return
    button.click()


#: The custom prompts' haystack sentence.
HAYSTACK = "The river runs north. Birds sing at dawn. The market opens at nine."


def fill_custom_prompt(page, haystack: str, word: str) -> None:
    """Switch the prompt to custom text: `haystack`, the needle "The secret word is
    `word`.", the question what the secret word is, `word` the expected answer."""
    open_accordion(page, "Prompt")
    page.get_by_label("custom", exact=True).check()
    open_accordion(page, "Custom text")
    fields = {
        page.get_by_label("Haystack text"): haystack,
        page.get_by_label("Needle sentence"): f"The secret word is {word}.",
        page.get_by_label("Question", exact=True): "What is the secret word?",
        page.get_by_label("Expected answer"): word,
    }
    for box, text in fields.items():
        box.fill(text)
    # A box that mounts as it is filled may set its own (empty) value: fill it again.
    for box, text in fields.items():
        if box.input_value() != text:
            box.fill(text)
        assert box.input_value() == text


def wait_plot(page, title_start: str = "", kind: str = "") -> dict:
    """Until a visible figure of the open view whose title starts with `title_start`
    (and whose first trace is of type `kind`, if given) is drawn; it."""
    page.wait_for_function(
        """([t, k]) => [...document.querySelectorAll('#lesson-views .js-plotly-plot')].some(
            p => p.offsetParent && p.layout && p.data && p.data.length
              && String(p.layout.title.text).startsWith(t) && (!k || p.data[0].type === k))""",
        arg=[title_start, kind],
        timeout=SOON_MS,
    )
    return next(
        f
        for f in plot_json(page, "#lesson-views")
        if str(f["layout"]["title"]["text"]).startswith(title_start)
        and (not kind or f["data"][0]["type"] == kind)
    )


def plot_json(page, selector: str) -> list[dict]:
    """Every drawn figure under `selector` that is visible: its data and layout."""
    return page.evaluate(
        """(sel) => [...document.querySelectorAll(sel + ' .js-plotly-plot')]
            .filter(p => p.offsetParent)
            .map(p => ({data: p.data, layout: p.layout}))""",
        selector,
    )


#: Every visible figure's title and subtitle lines, and its subplot titles, inside the
#: figure (none cut at its edge) and apart from each other (none over another).
FIT_JS = """() => {
  const out = [];
  const overlap = (a, b) =>
    a.left < b.right && b.left < a.right && a.top < b.bottom && b.top < a.bottom;
  for (const plot of document.querySelectorAll('.js-plotly-plot')) {
    if (!plot.offsetParent) continue;
    const box = plot.querySelector('svg.main-svg').getBoundingClientRect();
    const texts = [...plot.querySelectorAll('.gtitle tspan, .gtitle, .annotation-text')];
    for (const t of texts) {
      const r = t.getBoundingClientRect();
      if (!r.width) continue;
      if (r.right > box.right + 1 || r.left < box.left - 1)
        out.push(['cut', t.textContent, Math.round(r.left), Math.round(r.right),
                  Math.round(box.left), Math.round(box.right)]);
    }
    const notes = [...plot.querySelectorAll('.annotation-text')].map(
      t => [t.textContent, t.getBoundingClientRect()]).filter(([, r]) => r.width);
    for (let i = 0; i < notes.length; i++)
      for (let j = i + 1; j < notes.length; j++)
        if (overlap(notes[i][1], notes[j][1]))
          out.push(['titles collide', notes[i][0], notes[j][0]]);
  }
  return out;
}"""


def test_linked_side_b_shows_a_values_and_cannot_be_edited(served):
    page, _, url = served
    open_app(page, url)
    open_accordion(page, "Side A")
    open_accordion(page, "Side B")
    a_box, b_box = (
        number_box(page, "Budget (% of the prompt kept per layer and group)"),
        (number_box(page, "Budget B (%)")),
    )
    lesson = app.LESSONS[0]
    assert a_box.input_value() == b_box.input_value() == f"{100 * lesson.a.config.budget:g}"
    assert b_box.is_disabled(), "a linked B budget must not take typed values"
    type_into(a_box, "25")
    n = prompt_tokens(page)
    wait_status(page, rf"Done:.*budget {math.floor(0.25 * n + 1e-9)} tokens")
    page.wait_for_function(
        "() => document.querySelector('input[aria-label=\"number input for Budget B (%)\"]')"
        ".value === '25'",
        timeout=SOON_MS,
    )
    assert b_box.is_disabled()
    # Unticked: B's own budget, editable, starting from A's; the status names it.
    page.get_by_label("Same settings as A (policy, scorer and allocation are B's own)").uncheck()
    page.wait_for_function(
        "() => !document.querySelector('input[aria-label=\"number input for Budget B (%)\"]')"
        ".disabled",
        timeout=SOON_MS,
    )
    wait_status(page, r"Done:")
    type_into(b_box, "30")
    status = wait_status(page, r"Side B keeps its own settings.*budget")
    assert f"budget {math.floor(0.30 * n + 1e-9)} tokens" in status, status


def test_a_budget_has_one_rule_and_the_box_shows_what_ran(served):
    page, demo, url = served
    queue = QueueLog(page, demo)
    open_app(page, url)
    open_accordion(page, "Side A")
    box = number_box(page, "Budget (% of the prompt kept per layer and group)")
    ran = box.input_value()
    floor = box.get_attribute("min")  # the slider's minimum: this prompt's floor
    n = prompt_tokens(page)
    for typed, said in (("0", "got 0"), ("-5", "got -5"), ("abc", "got no number")):
        mark = len(queue.seen)
        type_into(box, typed)
        status = wait_status(page, rf"Error:.*Budget A must be.*{said}\.", timeout=SOON_MS)
        assert f"Budget A must be a number from {float(floor):g} to 100" in status, status
        assert said in status and f"{n}-token prompt" in status, status
        assert "got None" not in status and "0.5" not in status, status
        assert f"back at {float(ran):g} %" in status, status
        page.wait_for_function(
            "([v]) => document.querySelector("
            "'input[aria-label=\"number input for Budget (% of the prompt kept per layer and "
            "group)\"]').value === v",
            arg=[ran],
            timeout=SOON_MS,
        )
        runs = [x for x in queue.since(mark) if x != "preview_plans"]  # typing previews
        assert runs == ["run_comparison"], queue.since(mark)
        assert len(table_rows(page)) == 3, "the last results stay on screen"
    # A click into the box runs nothing; Enter commits what was typed.
    type_into(box, "100")
    wait_status(page, rf"Done:.*budget {n} tokens", timeout=SOON_MS)
    mark = len(queue.seen)
    type_into(box, "10")
    status = wait_status(page, rf"Done:.*budget {math.floor(0.1 * n + 1e-9)} tokens", SOON_MS)
    runs = [x for x in queue.since(mark) if x != "preview_plans"]
    assert runs == ["run_comparison"], queue.since(mark)  # none of the 100 the box held
    assert box.input_value() == "10"


def test_lesson_5_figures_fit_and_name_what_they_measure(served):
    page, _, url = served
    lesson = next(x for x in app.LESSONS if x.id == "reconstruct")
    title = app.LESSON_TITLES[app.LESSONS.index(lesson)]
    for width in WIDTHS:
        page.set_viewport_size({"width": width, "height": 1000})
        open_app(page, url)
        pick_lesson(page, title)
        wait_lesson_checked(page, lesson)
        wait_drawn(page)
        assert page.evaluate(FIT_JS) == [], (width, page.evaluate(FIT_JS))
        (frame,) = plot_json(page, "#page-frame")
        subtitle = frame["layout"]["title"]["text"]
        assert subtitle.count("needle page kept in") == 2 and subtitle.count("<br>") >= 2
        observed = observation_text(page)
        assert "Needle kept, the mean over every (layer, group): A" in observed, observed
        assert (
            "needle kept is a mean over every (layer, group)"
            in page.locator("#lesson-text").inner_text()
        )
        page.get_by_role("tab", name="UOR & memory").click()
        wait_plot(page, kind="bar")
        wait_drawn(page)
        assert page.evaluate(FIT_JS) == [], (width, page.evaluate(FIT_JS))
        figs = plot_json(page, "#lesson-views")
        heat = next(f for f in figs if f["data"][0]["type"] == "heatmap")
        top = max(max(max(row) for row in t["z"]) for t in heat["data"])
        assert all(t["zmax"] >= top for t in heat["data"]), (top, heat["data"][0]["zmax"])
        bars = next(f for f in figs if f["data"][0]["type"] == "bar")
        labels = [str(x) for x in bars["data"][0]["x"]]
        assert any("reconstruct, global" in x for x in labels), labels
        assert not any("padded" in x for x in labels), labels  # stored at their own lengths
        assert any(x.startswith("head_independent") and "uniform" in x for x in labels), labels
        assert "side B's settings" in bars["layout"]["title"]["text"]
        page.get_by_role("tab", name="Pages").click()
    page.set_viewport_size({"width": 1280, "height": 1000})


def test_a_preset_opens_its_view_on_its_layer(served):
    page, _, url = served
    open_app(page, url)
    preset = next(p for p in app.PRESETS if p["policy_a"] == "entropy_nosink")
    page.get_by_label("Preset", exact=True).click()
    page.get_by_role("option", name=preset["title"], exact=True).click()
    wait_status(page, r"Done:.*\*?Preset:?", timeout=FIRST_RESULT_MS)
    assert page.get_by_role("tab", selected=True).inner_text() == "Weights"
    assert number_box(page, "Layer").input_value() == str(preset["layer"])
    weights = wait_plot(page, "Head weights")
    assert f"layer {preset['layer']}" in weights["layout"]["title"]["text"]
    assert weights["data"][0]["y"] != weights["data"][1]["y"], "both bars the same"
    for p in app.PRESETS:  # every preset names a view the page has
        assert p["view"] in app.TABS, p["title"]


def test_the_mechanism_says_what_it_did_with_a_value_out_of_range(served):
    page, _, url = served
    for width in WIDTHS:
        page.set_viewport_size({"width": width, "height": 1000})
        open_app(page, url)
        page.get_by_role("tab", name="Mechanism").click()
        for label, typed, said in (
            ("Tokens", "5000", "Tokens: 5000 is above its range (32 to 1024), using 1024."),
            ("Budget %", "1", "Budget %: 1 is below its range (5 to 60), using 5."),
        ):
            type_into(number_box(page, label), typed)
            page.get_by_text(said).first.wait_for(timeout=SOON_MS)
            assert number_box(page, label).input_value() == said.split("using ")[1][:-1]
            badges = page.locator(".error, [data-testid='error']").filter(has_text="Error")
            assert badges.count() == 0 or not badges.first.is_visible()
    page.set_viewport_size({"width": 1280, "height": 1000})


def test_lessons_1_and_3_name_their_figures_and_a_run_is_never_checked_early(served):
    page, _, url = served
    open_app(page, url)
    observed = observation_text(page)
    rows = [r.split("\t") for r in table_rows(page)]
    stored, uor = rows[1][3], rows[1][6]
    assert f"holds {stored} tokens (the table's stored max)" in observed, observed
    assert f"The table's UOR max ({uor}) divides a union by the tokens one head keeps" in observed
    mean = re.search(r"stores (\d+) tokens on average", observed).group(1)
    page.get_by_role("tab", name="UOR & memory").click()
    bars = wait_plot(page, kind="bar")
    on_bar = dict(zip((str(x).split("<br>")[0] for x in bars["data"][0]["x"]),
                      bars["data"][0]["text"], strict=True))  # fmt: skip
    assert on_bar["head_independent"] == f"{mean} tokens", (on_bar, mean)  # the label's unit
    # Lesson 3: the head that gains most with isolation is marked and named.
    page.get_by_role("button", name="Next lesson").click()
    page.get_by_role("button", name="Next lesson").click()
    lesson3 = app.LESSONS[2]
    wait_lesson_checked(page, lesson3)
    head = re.search(r"head (g\d+ h\d+) gains most", observation_text(page)).group(1)
    weights = wait_plot(page, "Head weights")
    marks = [a for a in weights["layout"]["annotations"] if "gains most" in a["text"]]
    assert len(marks) == 1 and marks[0]["x"].startswith(head), (marks, head)
    # A run that changes the lesson's settings: while it runs, no verdict says "checked
    # now"; at its end, "not checked".
    open_accordion(page, "Side A")
    page.get_by_label("Policy A", exact=True).click()
    page.get_by_role("option", name="streaming", exact=True).click()
    # Both read in the one poll that sees 'Decoding': read apart, a loaded machine could
    # finish the run between the two reads.
    during = page.wait_for_function(
        """() => document.querySelector('#run-status').innerText.includes('Decoding')
                 && document.querySelector('#lesson-observation').innerText""",
        timeout=SOON_MS,
        polling=50,
    ).json_value()
    assert "checked now" not in during and "checking on this run" in during, during
    wait_status(page, r"Done:", timeout=SOON_MS)
    page.get_by_text("not checked").first.wait_for(timeout=SOON_MS)


def test_the_prompts_ranges_are_said(served):
    page, demo, url = served
    open_app(page, url)
    open_accordion(page, "Prompt")
    box = number_box(page, "Context length (tokens)")
    for typed, said, holds in (
        ("50", "50 is below its range (300 to 8000)", "300"),
        ("9000", "9000 is above its range (300 to 8000)", "8000"),
    ):
        type_into(box, typed)
        page.locator("#stale-note", has_text=said).wait_for(timeout=SOON_MS)
        assert box.input_value() == holds
    type_into(box, "300")
    page.locator("#stale-note", has_text="the prompt controls changed").wait_for(timeout=SOON_MS)
    # The shortest context runs at the default settings (a budget of 20 %; lesson 1's
    # 10 % is refused there, in the budget's one sentence).
    page.get_by_role("button", name="Run", exact=True).click()
    wait_status(page, r"Error:.*Budget A must be a number from .* got 10\.", SOON_MS)
    open_accordion(page, "Side A")
    type_into(number_box(page, "Budget (% of the prompt kept per layer and group)"), "20")
    wait_status(page, r"Done:", timeout=FIRST_RESULT_MS)
    assert prompt_tokens(page) < 400
    seed = page.get_by_label("Seed", exact=True)
    seed.fill("123456789012345678901")
    seed.press("Tab")
    page.get_by_role("button", name="Run", exact=True).click()
    status = wait_status(page, r"Error:.*seed", timeout=SOON_MS)
    assert "too long to read exactly" in status and "123456789012345680000" not in status


#: The first drawn lesson chart's top is in the upper 60 % of the window.
CHART_PLACED_JS = """() => {
  const charts = [...document.querySelectorAll('#lesson-views .js-plotly-plot')]
    .filter((c) => c.querySelector('svg') && c.offsetParent !== null);
  if (!charts.length) return false;
  const top = charts[0].getBoundingClientRect().top;
  return top >= 0 && top < 0.6 * window.innerHeight;
}"""


#: The lesson text starts below the fixed lesson bar when the page is scrolled to its
#: top: its offset in the document is below the bar's bottom (the bar does not scroll).
LESSON_BELOW_BAR_JS = """() => {
  const bar = document.querySelector('#lesson-picker').getBoundingClientRect();
  const lesson = document.querySelector('#lesson-text').getBoundingClientRect();
  return lesson.top + window.scrollY >= bar.bottom;
}"""


def wait_placed(page):
    """Until the presenter view has scrolled the chart into place (`pagekvShowChart`,
    assets/app.js, places it again as Gradio's redraw settles)."""
    page.wait_for_function(CHART_PLACED_JS, timeout=SOON_MS, polling=100)


def test_links_the_glossary_and_the_presenter_view(served):
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    page, _, url = served
    for width in WIDTHS:
        page.set_viewport_size({"width": width, "height": 1000})
        open_app(page, url, "?lesson=3")
        text = page.locator("#lesson-text").inner_text()
        assert app.LESSONS[2].title in text and "Lesson 3 of 9" in text, text
        glossary = page.locator("#glossary")
        assert glossary.is_visible()
        page.get_by_text("Glossary", exact=True).first.click()
        # Gradio renders an accordion's content after the click: wait for it.
        terms = ["UOR", "collision entropy", "attention sink", "(layer, group)", "needle"]
        page.wait_for_function(
            "ts => ts.every(t => document.querySelector('#glossary').innerText.includes(t))",
            arg=terms,
            timeout=SOON_MS,
        )
        words = glossary.inner_text()
        for term in terms:
            assert term in words, term
        page.get_by_text("Glossary", exact=True).first.click()
        # The presenter view: after Next, the lesson's chart and Next are in view.
        page.get_by_label("Presenter view").check()
        page.get_by_role("button", name="Next lesson").click()
        lesson4 = app.LESSONS[3]
        wait_lesson_checked(page, lesson4)
        wait_drawn(page)
        wait_placed(page)
        chart = page.locator("#lesson-views .js-plotly-plot").filter(has=page.locator("svg"))
        visible = [chart.nth(i) for i in range(chart.count()) if chart.nth(i).is_visible()]
        top = visible[0].bounding_box()["y"]
        assert 0 <= top < 0.6 * 1000, (width, top)  # the chart in view, its top half at least
        nxt = page.get_by_role("button", name="Next lesson").bounding_box()
        assert nxt and 0 <= nxt["y"] and nxt["y"] + nxt["height"] <= top, (width, nxt, top)
        assert not page.locator("#explore-col").is_visible()
        assert not page.locator("#intro").is_visible()
        # Scrolled to the top, the fixed bar covers no line of the lesson.
        try:
            page.wait_for_function(LESSON_BELOW_BAR_JS, timeout=SOON_MS, polling=100)
        except PlaywrightTimeout:
            bar = page.locator("#lesson-picker").bounding_box()
            lesson = page.locator("#lesson-text").bounding_box()
            said = f"the bar covers the lesson at {width} px: {bar} {lesson}"
            raise AssertionError(said) from None
        page.get_by_label("Presenter view").uncheck()
    page.set_viewport_size({"width": 1280, "height": 1000})
    # A link to settings: written by the page, opened as a new page, run as it says.
    open_app(page, url)
    open_accordion(page, "Side A")
    type_into(number_box(page, "Budget (% of the prompt kept per layer and group)"), "15")
    n = prompt_tokens(page)
    wait_status(page, rf"Done:.*budget {math.floor(0.15 * n + 1e-9)} tokens", SOON_MS)
    page.get_by_role("button", name="Link to these settings").click()
    link = page.locator("#share-link textarea, #share-link input").first
    page.wait_for_function(
        "() => { const el = document.querySelector('#share-link textarea, #share-link input');"
        " return el && el.value.includes('budget_pct='); }",
        timeout=SOON_MS,
    )
    shared = link.input_value()
    assert "budget_pct=15" in shared and "policy_a=head_independent" in shared, shared
    page.goto(shared, wait_until="domcontentloaded")
    wait_status(page, rf"Done:.*budget {math.floor(0.15 * n + 1e-9)} tokens", FIRST_RESULT_MS)
    assert "Shared settings" in page.locator("#lesson-text").inner_text()


#: The lesson picker's room for its text (from the text's start to the arrow) and the
#: width every lesson title takes in the input's own font.
TITLE_ROOM_JS = """(titles) => {
  const input = document.querySelector('#lesson-picker input');
  const arrow = input.closest('.wrap').querySelector('.icon-wrap, svg');
  const cs = getComputedStyle(input);
  const ctx = document.createElement('canvas').getContext('2d');
  ctx.font = cs.font;
  const ib = input.getBoundingClientRect(), ab = arrow.getBoundingClientRect();
  const end = Math.min(ab.left, ib.right - parseFloat(cs.paddingRight));
  return {room: end - (ib.left + parseFloat(cs.paddingLeft)),
          widths: titles.map(t => ctx.measureText(t).width)};
}"""

#: Every pair of x tick labels of one figure that overlap on screen or touch (less than
#: 2 px apart: "60" and "61" side by side read as "6061").
TICKS_OVERLAP_JS = """(sel) => {
  const out = [];
  for (const plot of document.querySelectorAll(sel + ' .js-plotly-plot')) {
    if (!plot.offsetParent) continue;
    const ticks = [...plot.querySelectorAll('g[class^="x"][class$="tick"] > text')]
      .map(t => [t.textContent, t.getBoundingClientRect()]).filter(([, r]) => r.width);
    for (let i = 0; i < ticks.length; i++)
      for (let j = i + 1; j < ticks.length; j++) {
        const a = ticks[i][1], b = ticks[j][1];
        if (a.left < b.right + 2 && b.left < a.right + 2 && a.top < b.bottom && b.top < a.bottom)
          out.push([ticks[i][0], ticks[j][0]]);
      }
  }
  return out;
}"""


def no_error_badges(page) -> bool:
    badges = page.locator(".error, [data-testid='error']").filter(has_text="Error")
    return badges.count() == 0 or not any(badges.nth(i).is_visible() for i in range(badges.count()))


def test_the_page_says_which_part_of_the_method_a_lesson_credits_and_titles_fit(served):
    """The introduction and each lesson say what they credit, lesson 6's title claims no tie, and
    every title fits beside the picker's arrow."""
    page, _, url = served
    for width in WIDTHS:
        page.set_viewport_size({"width": width, "height": 1000})
        open_app(page, url, "?lesson=2")
        intro = page.locator("#intro").inner_text()
        assert "not reproduced" in intro and "drown" not in intro, intro
        text = page.locator("#lesson-text")
        assert "What this credits: Whole pages, not the entropy weighting" in text.inner_text()
        credit = page.get_by_text("What this credits:").first.bounding_box()
        assert credit and credit["x"] + credit["width"] <= width, (width, credit)
        room = page.evaluate(TITLE_ROOM_JS, list(app.LESSON_TITLES))
        for title, w in zip(app.LESSON_TITLES, room["widths"], strict=True):
            assert w <= room["room"], (width, title, w, room["room"])
        assert "tie" not in app.LESSON_TITLES[5]
        wait_drawn(page)
        assert page.evaluate(TICKS_OVERLAP_JS, "#page-frame") == [], (
            width,
            page.evaluate(TICKS_OVERLAP_JS, "#page-frame"),
        )
    page.set_viewport_size({"width": 1280, "height": 1000})


def test_a_short_prompt_with_pages_of_64_never_locks_the_page(served):
    """50 tokens at pages of 64: 20 % refused, 100 % runs and says it is the only fit, the box still
    takes a value; no refusal points at gone results."""
    page, _, url = served
    open_app(page, url)
    fill_custom_prompt(page, HAYSTACK, "LANTERN")
    open_accordion(page, "Side A")
    box = number_box(page, "Budget (% of the prompt kept per layer and group)")
    type_into(box, "20")
    wait_status(page, r"Done:|Error:", timeout=SOON_MS)
    page.get_by_label("Page size", exact=True).click()
    page.get_by_role("option", name="64", exact=True).click()
    wait_status(page, r"Error:.*must be a number from 100 to 100", timeout=SOON_MS)
    type_into(box, "100")
    status = wait_status(page, r"Done:.*only 100 % fits this", timeout=SOON_MS)
    assert "page size 64" in status, status
    assert no_error_badges(page), "an output shows an error badge"
    assert box.is_editable() and float(box.get_attribute("min")) < 100
    type_into(box, "20")  # the box still answers: the run is refused in words
    wait_status(page, r"Error:.*must be a number from 100 to 100.*got 20", timeout=SOON_MS)
    assert no_error_badges(page)
    # A failed run (no question), then a refusal: no results to go back to.
    page.get_by_label("Question", exact=True).fill("")
    page.get_by_role("button", name="Run", exact=True).click()
    wait_status(page, r"Error:.*custom prompt needs question", timeout=SOON_MS)
    assert "No result" in page.locator("#answers-table").inner_text()
    page.get_by_label("Question", exact=True).fill("What is the secret word?")
    type_into(box, "20")
    status = wait_status(page, r"Error:.*must be a number from 100 to 100", timeout=SOON_MS)
    assert "results below" not in status and "back at" not in status, status


def test_lesson_7_verdict_follows_the_mechanism_tab(served):
    """With 4 heads and 128 tokens, the verdict speaks of the table beside it."""
    page, _, url = served
    for width in WIDTHS:
        page.set_viewport_size({"width": width, "height": 1000})
        open_app(page, url, "?lesson=7")
        type_into(number_box(page, "Heads per group"), "4")
        type_into(number_box(page, "Tokens"), "128")
        page.wait_for_function(
            "() => document.querySelector('#lesson-observation').innerText"
            ".includes('as the controls set it now (heads 4, tokens 128,')",
            timeout=SOON_MS,
        )
        # The verdict and the table are two outputs: the table may still be pending.
        page.wait_for_function(
            "() => !document.querySelector('#m-table').innerText.includes('processing')",
            timeout=SOON_MS,
        )
        table = page.locator("#m-table").inner_text()
        verdict = observation_text(page)
        mean_kept = re.search(r"\nmean\s+(kept|evicted)\s", table).group(1)
        assert f"mean: {mean_kept}" in verdict, (table, verdict)
        assert ("**holds**" in verdict or "holds," in verdict) == (mean_kept == "evicted")
    page.set_viewport_size({"width": 1280, "height": 1000})


def test_a_model_not_installed_is_said_at_once_and_the_box_shows_what_ran(served, monkeypatch):
    """qwen-coder-0.5b without its install: no 'Loading the model' line, no hub
    attempt, the run on the bundled model says why, and the Model box shows bundled."""
    import dataclasses

    from pagekv.runtime import models

    spec = models.BUNDLED_MODELS["qwen-coder-0.5b"]
    parts = dataclasses.replace(spec.parts, packages=("pagekv_no_such_part_1",))
    absent = dataclasses.replace(spec, parts=parts, cache_name="pagekv-test-not-converted")
    monkeypatch.setitem(models.BUNDLED_MODELS, "qwen-coder-0.5b", absent)
    asked = []
    monkeypatch.setattr(models, "_load_hub", lambda name, *a, **k: asked.append(name))
    page, _, url = served
    open_app(page, url)
    page.evaluate(
        """() => { window.pagekvSaid = [];
        new MutationObserver(() => window.pagekvSaid.push(
            document.querySelector('#run-status').innerText))
          .observe(document.querySelector('#run-status'),
                   {childList: true, subtree: true, characterData: true}); }"""
    )
    open_accordion(page, "Prompt")
    model = page.get_by_label("Model", exact=True)
    model.click()
    page.get_by_role("option", name="qwen-coder-0.5b", exact=True).click()
    page.get_by_role("button", name="Run", exact=True).click()
    status = wait_status(page, r"Done:.*fell back", timeout=SOON_MS)
    assert "setup.sh --models" in status, status
    said = page.evaluate("() => window.pagekvSaid")
    assert not any("Loading the model" in s for s in said), said
    page.wait_for_function(
        "() => document.querySelector('input[aria-label=\"Model\"]').value === 'bundled'",
        timeout=SOON_MS,
    )
    assert asked == []


def test_the_needle_strip_s_tick_labels_keep_apart(served):
    """A token strip's labels never overlap or touch; a two-token answer reads "60–61"."""
    page, _, url = served
    open_app(page, url)
    fill_custom_prompt(page, (HAYSTACK + " ") * 4, "BLUE")
    open_accordion(page, "Side A")
    page.get_by_label("Page size", exact=True).click()
    page.get_by_role("option", name="1", exact=True).click()
    # Each edit above queued a run; the last (page size 1, 10 %) is refused and resets the
    # budget box to 10 %: the budget is typed once that has landed.
    wait_status(page, r"Error:.*Budget A must be a number from 29\.5 to 100")
    type_into(number_box(page, "Budget (% of the prompt kept per layer and group)"), "50")
    wait_status(page, r"Done:.*page size 1\b")
    page.get_by_role("tab", name="Pages").click()
    for width in WIDTHS:
        page.set_viewport_size({"width": width, "height": 1000})
        wait_drawn(page)
        frame = wait_plot(page, "Page frame")
        strips = [
            k for k, v in frame["layout"].items() if k.startswith("xaxis") and "ticktext" in v
        ]
        labels = [t for k in strips for t in frame["layout"][k]["ticktext"]]
        assert any("–" in t for t in labels), labels  # the two answer tokens, once
        clash = page.evaluate(TICKS_OVERLAP_JS, "#page-frame")
        assert clash == [], (width, clash)
    page.set_viewport_size({"width": 1280, "height": 1000})


def test_quick_next_presses_go_as_many_lessons_on(served):
    """Three presses of Next right after the page opens land on lesson 4: each press
    steps on from the lesson the press before asked for, not from the one on screen."""
    page, _, url = served
    page.set_viewport_size({"width": 1280, "height": 1000})
    open_app(page, url)
    # Three presses before the first is answered (in one go: a press each 100 ms is
    # answered in between, the lessons being in memory).
    page.evaluate(
        "() => { const next = [...document.querySelectorAll('button')]"
        ".find((b) => b.innerText.trim() === 'Next lesson');"
        " next.click(); next.click(); next.click(); }"
    )
    nxt = page.get_by_role("button", name="Next lesson")
    lesson4 = app.LESSONS[3]
    wait_lesson_checked(page, lesson4)
    # Every press served (no lesson still asked for) and nothing loading.
    page.wait_for_function("() => !window.pagekvTarget", timeout=SOON_MS)
    wait_drawn(page)
    text = page.locator("#lesson-text").inner_text()
    assert lesson4.title in text and "Lesson 4 of 9" in text, text
    # A press after them steps from lesson 4.
    nxt.click()
    wait_lesson_checked(page, app.LESSONS[4])
    assert "Lesson 5 of 9" in page.locator("#lesson-text").inner_text()


def test_the_first_screen_draws_the_idea_and_a_live_chart_of_the_run(served):
    """The first screen holds the GQA drawing and the run's live stored-over-budget chart (matching
    the table's "stored max"), redrawn for another lesson."""
    page, _, url = served
    lesson1, lesson2 = app.LESSONS[0], app.LESSONS[1]
    for width, height in ((1280, 800), (800, 1000)):
        page.set_viewport_size({"width": width, "height": height})
        open_app(page, url, "?lesson=1")
        wait_lesson_checked(page, lesson1)
        wait_drawn(page)
        page.evaluate("window.scrollTo(0, 0)")
        for sel in ("#gqa-drawing svg", "#glance .js-plotly-plot"):
            box = page.locator(sel).bounding_box()
            assert box and box["y"] >= 0 and box["y"] + box["height"] <= height, (width, sel, box)
        drawing = page.locator("#gqa-drawing").inner_text()
        for words in ("One GQA group", "union", "Pool the heads"):
            assert words in drawing, (width, words)
        (fig,) = plot_json(page, "#glance")
        a, b = fig["data"]
        assert a["name"].startswith("A: head_independent") and b["name"].startswith("B: entropy")
        budget = int(re.search(r"budget (\d+) tokens per", status_text(page)).group(1))
        rows = page.locator("#answers-table tbody tr")
        for i, trace in ((1, a), (2, b)):
            stored_max = int(rows.nth(i).locator("td").nth(3).inner_text())
            assert round(trace["y"][0] * budget) == stored_max, (width, trace["name"])
            assert trace["y"] == sorted(trace["y"], reverse=True)
        assert len(a["y"]) == len(b["y"]) == 30 * 3  # SmolLM2: 30 layers, 3 groups
        assert max(a["y"]) > 1.5 and max(b["y"]) <= 1.0, (max(a["y"]), max(b["y"]))
    pick_lesson(page, app.LESSON_TITLES[1])
    wait_lesson_checked(page, lesson2)
    page.wait_for_function(
        "() => { const p = document.querySelector('#glance .js-plotly-plot');"
        " return p && p.data && !p.data[0].name.startsWith('A: head_independent'); }",
        timeout=SOON_MS,
    )
    page.set_viewport_size({"width": 1280, "height": 1000})


#: Bar labels (plotly's `text.bartext`) of the figure under a selector that stand less
#: than 2 px apart side by side: `[gap, left label, right label]`. None drawn: `null`.
LABELS_CROWDED_JS = """(sel) => {
  const b = [...document.querySelectorAll(sel + ' text.bartext')]
    .map(t => [t.textContent, t.getBoundingClientRect()]).filter(([, r]) => r.width)
    .sort((x, y) => x[1].left - y[1].left);
  if (!b.length) return null;
  const out = [];
  for (let i = 1; i < b.length; i++) {
    const [a, c] = [b[i - 1][1], b[i][1]];
    if (a.top < c.bottom && c.top < a.bottom && c.left - a.right < 2)
      out.push([Math.round(c.left - a.right), b[i - 1][0], b[i][0]]);
  }
  return out;
}"""


def test_lesson_8_figures_fit_and_keep_their_labels_apart(served):
    """Lesson 8's figures keep titles and bar labels inside and apart, lines visible."""
    page, _, url = served
    lesson = next(x for x in app.LESSONS if x.id == "kvpress-same-memory")
    for width in WIDTHS:
        page.set_viewport_size({"width": width, "height": 1000})
        open_app(page, url, f"?lesson={app.LESSONS.index(lesson) + 1}")
        wait_lesson_checked(page, lesson)
        page.wait_for_function(
            "() => ['#ruler-memory', '#replay-recall'].every(s => {"
            " const p = document.querySelector(s + ' .js-plotly-plot');"
            " return p && p.offsetParent && p.data && p.data.length; })",
            timeout=SOON_MS,
        )
        wait_drawn(page)
        assert page.evaluate(FIT_JS) == [], (width, page.evaluate(FIT_JS))
        crowded = page.evaluate(LABELS_CROWDED_JS, "#replay-recall")
        assert crowded == [], (width, crowded)
        (ruler,) = plot_json(page, "#ruler-memory")
        for trace in ruler["data"]:
            colour = trace["line"]["color"].lstrip("#")
            lightness = sum(int(colour[i : i + 2], 16) for i in (0, 2, 4)) / 3
            assert lightness < 200, (trace["name"], trace["line"]["color"])
    page.set_viewport_size({"width": 1280, "height": 1000})
