"""The app in a real browser (Debian's chromium driven by Playwright).

`test_first_lesson_then_one_request_per_action`: a cold app runs the first lesson on load; a
picked policy and a typed budget are one run each, a changed prompt control says the results are
stale, and at 800 px every tab stays reachable. `test_every_lesson_at_both_widths`: every lesson
through Next at 1280 and 800 px, each screen consistent and unclipped. PAGEKV_UPDATE_SCREENSHOT=1
writes docs/screenshot*.png and docs/lessons/. Needs `playwright` and /usr/bin/chromium (a CI run
that skips them fails, tests/conftest.py)."""

from __future__ import annotations

import math
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

import pytest

import app

from .app_server import ROOT, launched_app

pytestmark = [
    pytest.mark.slow,
    # gradio's own use of pandas (not ours) warns on every Dataframe output.
    pytest.mark.filterwarnings("ignore:.*no_silent_downcasting"),
    pytest.mark.filterwarnings("ignore:The copy keyword is deprecated"),
]

CHROMIUM = "/usr/bin/chromium"
SCREENSHOT = (
    ROOT / "docs" / "screenshot.png"
    if os.environ.get("PAGEKV_UPDATE_SCREENSHOT") == "1"
    else Path(tempfile.gettempdir()) / "pagekv-screenshot.png"
)
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
#: Generous: a cold CI machine loads the model and prefills the first preset.
FIRST_RESULT_MS = 240_000
UPDATE_MS = 180_000


@pytest.fixture(scope="module")
def browser_page():
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="playwright is not installed (requirements-dev.txt)"
    )
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is missing (apt-get install chromium)")
    profile = tempfile.mkdtemp(prefix="pagekv-chromium-")
    try:
        with sync_api.sync_playwright() as pw:
            context = pw.chromium.launch_persistent_context(
                profile,
                executable_path=CHROMIUM,
                headless=True,
                args=CHROMIUM_ARGS,
                viewport={"width": 1440, "height": 1000},
            )
            try:
                yield context.new_page()
            finally:
                context.close()
    finally:
        shutil.rmtree(profile, ignore_errors=True)


def status_text(page) -> str:
    """The status line of the last finished run ("N prompt tokens, budget K tokens ...")."""
    return page.get_by_text(re.compile(r"\d+ prompt tokens")).first.inner_text()


def table_rows(page) -> list[str]:
    """The answers table's body rows as text."""
    return [r.inner_text() for r in page.locator("#answers-table tbody tr").all()]


def observation_text(page) -> str:
    return page.locator("#lesson-observation").inner_text()


def wait_checked(page, timeout=FIRST_RESULT_MS) -> str:
    """Wait until the lesson's observation has been checked on this run; its text."""
    page.wait_for_function(
        "() => { const el = document.querySelector('#lesson-observation');"
        " return el && el.innerText.includes('checked now on'); }",
        timeout=timeout,
    )
    return observation_text(page)


def pick_lesson(page, title: str) -> None:
    page.get_by_label("Lesson", exact=True).click()
    page.get_by_role("option", name=title, exact=True).click()


class QueueLog:
    """The queue requests the page sends (POST .../queue/join), by handler name."""

    def __init__(self, page, demo):
        self.names = {i: getattr(f.fn, "__name__", "?") for i, f in demo.fns.items()}
        self.seen: list[str] = []
        page.on("request", self._on_request)

    def _on_request(self, request):
        if request.method == "POST" and "/queue/join" in request.url:
            body = request.post_data_json or {}
            self.seen.append(self.names.get(body.get("fn_index"), "?"))

    def since(self, mark: int) -> list[str]:
        return self.seen[mark:]


#: Every visible figure drawn at the page's width (plotly done: its layout computed, no
#: transition running, its svg inside the window, which a resize redraws to) and no
#: Gradio progress bar over an output.
DRAWN_JS = """() => {
  const plots = [...document.querySelectorAll('.js-plotly-plot')].filter(p => p.offsetParent);
  const drawn = plots.every(p => {
    const svg = p.querySelector('.main-svg');
    const queue = p._transitionData && p._transitionData._frameQueue;
    return p._fullLayout && svg && !p._transitioning && !(queue && queue.length)
      && svg.getBoundingClientRect().right <= window.innerWidth + 1;
  });
  return drawn && !document.querySelector('.eta-bar, .progress-bar');
}"""


def wait_drawn(page, timeout=UPDATE_MS):
    """Until every visible figure is drawn (`DRAWN_JS`): in place of a fixed sleep."""
    page.wait_for_function(DRAWN_JS, timeout=timeout, polling=100)


def wait_idle(page):
    """Until the last run has decoded (its status no longer says "Decoding...")."""
    page.wait_for_function(
        "() => { const el = document.querySelector('#run-status');"
        " return el && el.innerText.includes('Done:') && !el.innerText.includes('Decoding'); }",
        timeout=UPDATE_MS,
    )


def test_first_lesson_then_one_request_per_action(browser_page):
    page = browser_page
    page.set_viewport_size({"width": 1280, "height": 1000})
    t_launch = time.perf_counter()
    with launched_app(cold=True) as (demo, url):
        queue = QueueLog(page, demo)
        t_page = time.perf_counter()
        page.goto(url, wait_until="domcontentloaded")
        # The app runs the first lesson on load and checks its observation.
        observed = wait_checked(page)
        t_first = time.perf_counter()
        assert not page.get_by_text("Error:").count(), page.get_by_text("Error:").first.inner_text()
        print(
            f"\nfirst lesson checked: {t_first - t_launch:.1f}s from the app's cold start "
            f"({t_first - t_page:.1f}s from the page load)"
        )
        assert queue.seen == ["open_page"], queue.seen  # one request for the first lesson
        first = app.LESSONS[0]
        assert first.title in page.locator("#lesson-text").inner_text()
        assert "holds, checked now on this run" in observed, observed

        status = status_text(page)
        n = int(re.search(r"(\d+) prompt tokens", status).group(1))
        assert f"budget {math.floor(first.a.config.budget * n + 1e-9)} tokens" in status, status
        rows = table_rows(page)
        assert len(rows) == 3, rows
        assert rows[0].startswith("full cache") and rows[1].startswith(
            "A: " + first.a.config.policy
        )

        wait_drawn(page)  # plotly done with its transitions
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SCREENSHOT), full_page=True)
        assert SCREENSHOT.stat().st_size > 10_000

        # Free exploration, side A: a policy picked with the mouse is ONE run.
        page.get_by_text("Side A", exact=True).click()
        mark = len(queue.seen)
        page.get_by_label("Policy A", exact=True).click()
        page.get_by_role("option", name="mean", exact=True).click()
        page.get_by_text("A: mean").first.wait_for(timeout=UPDATE_MS)
        wait_idle(page)
        wait_drawn(page)
        assert queue.since(mark) == ["run_comparison"], queue.since(mark)

        # The budget: typing previews the plan views (no decoding), leaving the box is
        # ONE run; the answers follow.
        box = page.locator('input[aria-label^="number input for Budget"]').first
        pct = 25
        mark = len(queue.seen)
        box.fill(str(pct))
        t_change = time.perf_counter()
        box.blur()
        want = f"budget {math.floor(pct / 100 * n + 1e-9)} tokens"
        page.get_by_text(want).first.wait_for(timeout=UPDATE_MS)
        t_plan = time.perf_counter()
        done = re.compile(r"Done:.*" + re.escape(want), re.S)
        page.locator("#run-status", has_text=done).wait_for(timeout=UPDATE_MS)
        t_done = time.perf_counter()
        print(
            f"after a budget change: plan views in {t_plan - t_change:.2f}s, both answers "
            f"in {t_done - t_change:.2f}s"
        )
        wait_idle(page)
        wait_drawn(page)
        sent = queue.since(mark)
        assert sent.count("run_comparison") == 1, sent
        assert set(sent) <= {"run_comparison", "preview_plans"}, sent
        new_rows = table_rows(page)
        assert len(new_rows) == 3
        assert new_rows[0] == rows[0], "the full cache does not depend on the budget"
        # The controls left the lesson's settings: the lesson says so, no stale verdict.
        page.get_by_text("not checked").first.wait_for(timeout=60_000)
        assert "holds, checked" not in observation_text(page)

        # A prompt control changed without a run: the results say they are stale, and
        # no request went to the server for it.
        mark = len(queue.seen)
        page.get_by_text("Prompt", exact=True).click()
        page.get_by_label("Seed", exact=True).fill("5")
        page.get_by_label("Seed", exact=True).press("Tab")
        page.get_by_text("the prompt controls changed").first.wait_for(timeout=30_000)
        assert queue.since(mark) == [], queue.since(mark)
        # A run clears the note (it is one of the run's outputs).
        page.get_by_role("button", name="Run", exact=True).click()
        page.wait_for_function(
            "() => !document.querySelector('#stale-note').innerText.includes('changed')",
            timeout=UPDATE_MS,
        )
        wait_idle(page)

        # At 800 px every view stays reachable: all seven tabs visible, no clipped table.
        page.set_viewport_size({"width": 800, "height": 1000})
        wait_drawn(page)  # redrawn at the new width
        tabs = page.get_by_role("tab")
        assert tabs.count() == len(app.TABS), tabs.count()
        assert all(tabs.nth(i).is_visible() for i in range(tabs.count()))
        narrow = SCREENSHOT.with_name(SCREENSHOT.stem + "-800.png")
        page.screenshot(path=str(narrow), full_page=True)
        assert narrow.stat().st_size > 10_000


#: Where the lesson screenshots go: docs/lessons/ with PAGEKV_UPDATE_SCREENSHOT=1 (the
#: README links them), else a temporary folder.
LESSON_SHOTS = (
    ROOT / "docs" / "lessons"
    if os.environ.get("PAGEKV_UPDATE_SCREENSHOT") == "1"
    else Path(tempfile.gettempdir()) / "pagekv-lessons"
)
#: The tab titles of the views a lesson opens (app.py).
TAB_TITLES = {
    "frame": "Pages", "retention": "Needle", "weights": "Weights", "sinks": "Sinks",
    "uor": "UOR & memory", "capacity": "Capacity", "mechanism": "Mechanism", "replay": "Replay",
}  # fmt: skip

#: Every answers-table cell whose text is wider than its box (a clipped header), and
#: every figure cell that wraps onto a second line ("1.0/0").
CLIPPED_JS = r"""() => {
  const out = [];
  const table = document.querySelector('#answers-table table');
  if (!table) return out;
  const box = document.querySelector('#answers-table');
  if (table.scrollWidth > box.clientWidth + 1)
    out.push(['table', table.scrollWidth, box.clientWidth]);
  for (const el of table.querySelectorAll('th, td')) {
    if (el.scrollWidth > el.clientWidth + 1)
      out.push([el.innerText, el.scrollWidth, el.clientWidth]);
  }
  for (const el of table.querySelectorAll('td.num')) {
    const range = document.createRange();
    range.selectNodeContents(el);
    const lines = new Set([...range.getClientRects()].map(r => Math.round(r.top)));
    if (lines.size > 1) out.push([el.innerText, 'wraps']);
  }
  return out;
}"""

#: In the open tab, every figure's title is the topmost element where it is drawn (no
#: badge over it), and no legend overlaps an axis title.
COVERED_JS = """() => {
  const out = [];
  const overlap = (a, b) =>
    a.left < b.right && b.left < a.right && a.top < b.bottom && b.top < a.bottom;
  for (const plot of document.querySelectorAll('.js-plotly-plot')) {
    if (!plot.offsetParent) continue;  // a figure in a tab that is not open
    const title = plot.querySelector('.gtitle');
    if (title) {
      // Anything of the plot's block drawn over the title (Gradio's "Plot" badge is
      // such a thing; it ignores the pointer, so its box is what tells).
      title.scrollIntoView({block: 'center'});
      const r = title.getBoundingClientRect();
      const block = plot.closest('.block') || plot.parentElement;
      for (const el of block.querySelectorAll('*')) {
        if (plot.contains(el) || el.contains(plot)) continue;
        if (el.closest('[data-testid="status-tracker"]')) continue;  // the loading veil
        const b = el.getBoundingClientRect();
        const style = getComputedStyle(el);
        if (!b.width || !b.height || style.visibility === 'hidden' || style.display === 'none')
          continue;
        if (overlap(r, b)) out.push(['title covered', title.textContent, el.className]);
      }
    }
    const legend = plot.querySelector('.legend');
    if (legend) {
      const l = legend.getBoundingClientRect();
      for (const t of plot.querySelectorAll('[class*="xtitle"], [class*="ytitle"]')) {
        if (t.textContent && overlap(l, t.getBoundingClientRect()))
          out.push(['legend over axis title', t.textContent]);
      }
    }
  }
  return out;
}"""


def in_viewport(page, locator) -> bool:
    box = locator.bounding_box()
    size = page.viewport_size
    return box is not None and box["y"] >= 0 and box["y"] + box["height"] <= size["height"]


def check_screen(page, lesson) -> None:
    """Verdict, table and status agree, and nothing of another lesson stays."""
    observed = observation_text(page)
    status = page.locator("#run-status").inner_text()
    rows = table_rows(page)
    tab = page.get_by_role("tab", selected=True).inner_text()
    assert tab == TAB_TITLES[lesson.views[0]], (lesson.id, tab)
    if lesson.kind != "live":  # no live run: no row, no status of an earlier run
        assert rows == [], (lesson.id, rows)
        assert "runs no model" in status and "prompt tokens" not in status, status
        if lesson.kind == "replay":  # the caption's "look for" is counted on the bars
            from pagekv.app.lesson_checks import replay_caption

            counted = replay_caption().split("**Look for** ")[1].split(":")[1].strip()
            page_text = page.locator("body").inner_text()
            assert counted in page_text and "every bar" not in page_text, counted
        return
    assert len(rows) == 3, rows
    assert rows[1].startswith(f"A: {lesson.a.config.policy}") and rows[2].startswith(
        f"B: {lesson.b.config.policy}"
    ), rows
    n = int(re.search(r"(\d+) prompt tokens", status).group(1))
    k = math.floor(lesson.a.config.budget * n + 1e-9)
    assert f"budget {k} tokens" in status, status
    cells = [
        c.inner_text() for c in page.locator("#answers-table tbody tr").nth(1).locator("td").all()
    ]
    if lesson.id == "gqa-cost":  # the verdict's figures are the table's and the status's
        most = re.search(r"holds (\d+) tokens", observed).group(1)
        assert cells[3] == most, (cells, observed)
        assert f"the budget of {k} tokens" in observed, observed
    if lesson.layer in ("last", "strongest", "sink"):  # the verdict names the layer the view shows
        shown = page.locator('input[aria-label="number input for Layer"]').input_value()
        said = re.search(r"layer (\d+)", observed).group(1)
        assert shown == said, (shown, observed)


def test_every_lesson_at_both_widths(browser_page):
    """Every lesson through Next at 1280 and 800 px: text and verdict checked on this run, Next in
    view, screen self-consistent, nothing clipped or covered."""
    page = browser_page
    LESSON_SHOTS.mkdir(parents=True, exist_ok=True)
    with launched_app() as (demo, url):
        # As `python app.py` does once it serves: every live lesson computed once, so
        # the picks below are served from memory (and must still hold).
        assert app.warm_lessons() == sum(x.kind == "live" for x in app.LESSONS)
        queue = QueueLog(page, demo)
        for width in (1280, 800):
            page.set_viewport_size({"width": width, "height": 1000})
            page.goto(url, wait_until="domcontentloaded")
            wait_checked(page)
            for i, lesson in enumerate(app.LESSONS):
                t0 = time.perf_counter()
                mark = len(queue.seen)
                if i:
                    page.get_by_role("button", name="Next lesson").click()
                # Consecutive lessons state different observations: wait for this one's.
                page.wait_for_function(
                    "([title, statement]) => {"
                    " const text = document.querySelector('#lesson-text');"
                    " const obs = document.querySelector('#lesson-observation');"
                    " const status = document.querySelector('#run-status');"
                    " return text && obs && text.innerText.includes(title)"
                    " && obs.innerText.includes(statement)"
                    " && obs.innerText.includes('checked now on')"
                    " && !status.innerText.includes('Decoding'); }",
                    arg=[lesson.title, lesson.observation.statement],
                    timeout=FIRST_RESULT_MS,
                )
                wait_drawn(page)  # the last figures drawn
                observed = observation_text(page)
                if i:  # Next is ONE request (set, run, check)
                    assert queue.since(mark) == ["next_lesson"], queue.since(mark)
                assert "holds, checked now on" in observed and "does not hold" not in observed, (
                    lesson.id, observed,
                )  # fmt: skip
                if lesson.kind == "live":  # computed by warm_lessons: from memory
                    whole = page.locator("#run-status").inner_text()
                    assert "served from memory" in whole, whole
                page.evaluate("window.scrollTo(0, 0)")
                nxt = page.get_by_role("button", name="Next lesson")
                assert in_viewport(page, nxt), f"{lesson.id} at {width}: Next is out of view"
                assert in_viewport(page, page.locator("#lesson-text h3")), lesson.id
                check_screen(page, lesson)
                clipped = page.evaluate(CLIPPED_JS)
                assert clipped == [], (lesson.id, width, clipped)
                covered = page.evaluate(COVERED_JS)
                assert covered == [], (lesson.id, width, covered)
                print(f"\n{lesson.id} at {width} px: checked in {time.perf_counter() - t0:.1f}s")
                page.evaluate("window.scrollTo(0, 0)")
                page.screenshot(
                    path=str(LESSON_SHOTS / f"{i + 1}-{lesson.id}-{width}.jpg"),
                    full_page=True,
                    type="jpeg",
                    quality=60,
                )
