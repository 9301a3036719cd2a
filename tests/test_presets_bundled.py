"""Every preset shows the difference its title names, on the bundled model, run as the app's picker
runs it (`compare_preset`) and checked by `check_preset`; a failing preset changes, never the
check. One prefill serves the curated presets."""

from __future__ import annotations

import pytest

from pagekv.app.presets import (
    check_preset,
    compare_preset,
    load_presets,
    preset_matches,
    run_presets,
)

pytestmark = pytest.mark.slow

PRESETS = [p for p in load_presets() if p["model"] is None]  # the others: their own model


@pytest.fixture(scope="module")
def study(bundled_study):
    return bundled_study


@pytest.mark.parametrize("preset", PRESETS, ids=[p["title"][:60] for p in PRESETS])
def test_preset_shows_its_difference(study, preset):
    comp = compare_preset(study, preset)
    assert preset_matches(preset, comp)
    finding = check_preset(preset, comp)
    answers = {k: comp.records[k].answer for k in ("full", "A", "B")}
    print(f"{preset['title']}\n  {finding.measured}\n  answers: {answers}")
    assert finding.holds, f"{preset['title']!r}: {finding.measured}"


def test_run_presets_checks_every_preset(study):
    """`run_presets` runs and checks every preset (the runs above are memoised)."""
    rows = run_presets(study)
    assert [p["title"] for p, _ in rows] == [p["title"] for p in PRESETS]
    assert all(f.holds for _, f in rows), {p["title"]: f.measured for p, f in rows}
