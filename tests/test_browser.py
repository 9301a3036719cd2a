"""The app in a real browser: Debian's chromium driven by Playwright.

Loads the page of a freshly launched app (no model in memory), waits for the first
preset's results (the app runs it on page load), checks the page-frame heatmap and the
answers table, moves the budget, checks the answers follow, and saves a full-page
screenshot. With PAGEKV_UPDATE_SCREENSHOT=1 it writes docs/screenshot.png (the README
shows it); otherwise a temporary file, so a test run leaves the tree clean.

It prints the time to the first result from a cold start and after a budget change (the
figures the issue asks for: under 20 s and under 5 s); timings are not asserted, since
CI machines vary.

Needs `playwright` (the Python package only: no `playwright install`) and
/usr/bin/chromium (`apt-get install chromium`); skipped without them.
"""

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
    """The answers table's rows as text (the one table that names 'full cache')."""
    table = page.locator(".virtual-table-viewport", has_text="full cache").first
    rows = table.locator("[role=row]").all()
    return [r.inner_text() for r in rows if not r.locator("[role=columnheader]").count()]


def test_first_preset_then_budget_change(browser_page):
    page = browser_page
    t_launch = time.perf_counter()
    with launched_app(cold=True) as (_, url):
        t_page = time.perf_counter()
        page.goto(url, wait_until="domcontentloaded")
        # The app runs the first preset on load: wait for its answers.
        done = page.get_by_text("full cache: full").or_(page.get_by_text("Error:"))
        done.first.wait_for(timeout=FIRST_RESULT_MS)
        t_first = time.perf_counter()
        assert not page.get_by_text("Error:").count(), page.get_by_text("Error:").first.inner_text()
        print(
            f"\nfirst result: {t_first - t_launch:.1f}s from the app's cold start "
            f"({t_first - t_page:.1f}s from the page load)"
        )

        status = status_text(page)
        n = int(re.search(r"(\d+) prompt tokens", status).group(1))
        first = app.PRESETS[0]  # what the page loads with
        assert f"budget {math.floor(first['budget'] * n + 1e-9)} tokens" in status, status
        rows = table_rows(page)
        assert len(rows) == 3, rows
        assert rows[0].startswith("full cache") and "policy A" in rows[1], rows

        frame = page.locator("#page-frame")
        frame.locator(".main-svg").first.wait_for(timeout=30_000)
        assert frame.locator(".heatmaplayer .hm").count() >= 2  # policy A and policy B
        assert frame.get_by_text("A: mean").count() and frame.get_by_text("B: entropy").count()

        # Move the budget: the number box next to the slider releases on blur.
        box = page.locator('input[aria-label^="number input for Budget"]')
        pct = 25 if round(100 * first["budget"]) != 25 else 30  # a different budget
        box.fill(str(pct))
        t_change = time.perf_counter()
        box.blur()
        want = f"budget {math.floor(pct / 100 * n + 1e-9)} tokens"
        page.get_by_text(want).first.wait_for(timeout=UPDATE_MS)
        page.wait_for_function(
            "() => !document.querySelector('.progress-text, .eta-bar')", timeout=UPDATE_MS
        )
        print(f"after a budget change: {time.perf_counter() - t_change:.1f}s")
        new_rows = table_rows(page)
        assert len(new_rows) == 3
        assert new_rows[0] == rows[0], "the full cache does not depend on the budget"
        assert new_rows[1] != rows[1] and new_rows[2] != rows[2], (rows, new_rows)

        page.wait_for_timeout(500)  # let plotly finish its transitions
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SCREENSHOT), full_page=True)
    assert SCREENSHOT.stat().st_size > 10_000
