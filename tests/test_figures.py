"""The page frame's needle view: count, strip and colours, on real plans of spiked profiles, checked
against pages written out by hand."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

import pagekv
from pagekv.app.figures import eviction as fp
from pagekv.app.figures import style
from pagekv.maths.config import EvictionConfig

pytest.importorskip("plotly")

#: Sinks and window are one page each at page size 4 (pages 0 and n/4 - 1).
SMALL = dict(n_sink=4, window=4)


def spiked_plan(spikes, n=64, page_size=4, budget=0.1875, policy="entropy"):
    """A plan with one head per group peaking on `spikes[l][g]`; at the default budget each (layer,
    group) keeps its spike's page besides the protected ones."""
    L, G = len(spikes), len(spikes[0])
    prof = torch.full((L, G, n), 1.0)
    for layer in range(L):
        for g in range(G):
            prof[layer, g, spikes[layer][g]] = 100.0
    prof = prof / prof.sum(-1, keepdim=True)
    cfg = EvictionConfig(policy=policy, budget=budget, page_size=page_size, **SMALL)
    return pagekv.plan(prof, G, cfg)


def strips(fig):
    return [t for t in fig.data if t.type == "heatmap" and t.meta["role"] == "needle_strip"]


def overviews(fig):
    return [t for t in fig.data if t.type == "heatmap" and t.meta["role"] == "overview"]


def test_needle_page_counts_exact():
    # Needle token 33 lives in page 8 (page size 4). Rows (0, 0) and (1, 1) spike on
    # it; the others spike on page 3 or page 12.
    p = spiked_plan([[33, 13], [50, 34]])
    assert p.page_keep[0, 0, 8] and p.page_keep[1, 1, 8]  # the construction holds
    assert not p.page_keep[0, 1, 8] and not p.page_keep[1, 0, 8]
    assert fp.needle_page_counts(p, [33]) == (2, 4)
    assert fp.needle_page_counts(p, [13]) == (1, 4)  # page 3: row (0, 1) only
    assert fp.needle_page_counts(p, [1]) == (4, 4)  # the protected sink page
    # The same count as the token-level retention metric.
    ret = p.needle_retention([33, 34])
    assert fp.needle_page_counts(p, [33, 34]) == (int((ret == 1).sum()), 4)


def test_needle_page_counts_needs_every_needle_page():
    # A needle over pages 7 and 8; row (0, 0) keeps both, (0, 1) only page 7,
    # (1, 0) only page 8, (1, 1) neither.
    p = spiked_plan([[30, 30], [30, 30]])
    keep = torch.zeros_like(p.page_keep)
    keep[..., 0] = keep[..., -1] = True
    keep[0, 0, 7] = keep[0, 0, 8] = True
    keep[0, 1, 7] = True
    keep[1, 0, 8] = True
    p = dataclasses.replace(p, page_keep=keep)
    assert fp.needle_page_counts(p, [30, 31, 32]) == (1, 4)
    assert fp.needle_page_counts(p, [30]) == (2, 4)
    assert fp.needle_page_counts(p, [33]) == (2, 4)


@pytest.mark.parametrize("bad", [[], [64], [-1], [3, 70]], ids=str)
def test_needle_page_counts_rejects_bad_positions(bad):
    p = spiked_plan([[33]])
    with pytest.raises(ValueError, match="needle"):
        fp.needle_page_counts(p, bad)


def test_strip_only_with_needle():
    p = spiked_plan([[33, 13], [50, 34]])
    plain = fp.page_frame({"A": p, "B": p})
    assert len(overviews(plain)) == 2 and strips(plain) == []
    assert not any("needle" in a.text for a in plain.layout.annotations)
    assert not any("needle" in (t.name or "") for t in plain.data)
    for empty in ([], {"A": [], "B": None}):
        assert strips(fp.page_frame({"A": p, "B": p}, empty)) == []
    with_needle = fp.page_frame({"A": p, "B": p}, [33])
    assert [t.meta["label"] for t in strips(with_needle)] == ["A", "B"]
    assert len(overviews(with_needle)) == 2
    assert any("needle" in (t.name or "") for t in with_needle.data)  # in the legend


@pytest.mark.parametrize(
    "needle, margin, pages, ticks",
    [
        ([33], 3, [5, 6, 7, 8, 9, 10, 11], [(0, "5"), (3, "8"), (6, "11")]),  # page 8
        ([33], 0, [8], [(0, "8")]),
        ([1, 2], 3, [0, 1, 2, 3], [(0, "0"), (3, "3")]),  # page 0: clipped at the start
        ([63], 2, [13, 14, 15], [(0, "13"), (2, "15")]),  # page 15, the last
        ([32, 39], 1, [7, 8, 9, 10], [(0, "7"), (1.5, "8–9"), (3, "10")]),  # one run
        # Two runs far apart; the last end would sit too close to "12" and is left out.
        ([9, 48], 1, [1, 2, 3, 11, 12, 13], [(0, "1"), (1, "2"), (4, "12")]),
    ],
    ids=["mid", "margin0", "start", "end", "two-pages", "two-runs"],
)
def test_strip_covers_needle_pages_and_margin(needle, margin, pages, ticks):
    p = spiked_plan([[33, 13], [50, 34]])
    fig = fp.page_frame({"A": p}, needle, margin=margin)
    (strip,) = strips(fig)
    assert strip.meta["pages"] == pages
    # Labelled: each run of needle pages once, at its middle, and the strip's ends.
    x = fig.layout.xaxis2
    assert list(zip(x.tickvals, x.ticktext, strict=True)) == ticks
    # Its cells are the plan's states on exactly those pages, row by row.
    states = fp.page_states(p).reshape(4, -1)
    assert [list(r) for r in strip.z] == [[int(states[i, j]) for j in pages] for i in range(4)]
    # The needle's pages are outlined in the strip (x in strip positions).
    needle_pages = sorted({t // 4 for t in needle})
    assert strip.meta["needle_pages"] == needle_pages
    boxes = [s for s in fig.layout.shapes if s.xref == "x2"]
    covered = {i for s in boxes for i in range(round(s.x0 + 0.5), round(s.x1 - 0.5) + 1)}
    assert covered == {pages.index(j) for j in needle_pages}


def test_strip_reports_the_count():
    p = spiked_plan([[33, 13], [50, 34]])
    fig = fp.page_frame({"A: mean": p, "B: entropy": p}, [33])
    for strip in strips(fig):
        assert (strip.meta["kept"], strip.meta["total"]) == (2, 4)
    titles = [a.text for a in fig.layout.annotations]
    assert "A: mean" in titles and "B: entropy" in titles  # the app's test reads these
    assert titles.count("needle ±3 pages<br>2/4 keep it") == 2
    lines = fig.layout.title.text.split("<br>")[1:]  # a line per side (one line was cut)
    assert [re.sub("<[^>]+>", "", x) for x in lines] == [
        "A: mean: needle page kept in 2 of 4 (layer, group)s",
        "B: entropy: needle page kept in 2 of 4 (layer, group)s",
    ]


def test_needle_positions_per_side():
    # Side A's needle is token 33 (page 8), side B's token 13 (page 3): two prompts.
    p = spiked_plan([[33, 13], [50, 34]])
    fig = fp.page_frame({"A": p, "B": p}, {"A": [33], "B": [13]}, margin=1)
    a, b = strips(fig)
    assert (a.meta["label"], a.meta["pages"], a.meta["kept"]) == ("A", [7, 8, 9], 2)
    assert (b.meta["label"], b.meta["pages"], b.meta["kept"]) == ("B", [2, 3, 4], 1)
    # A side left out of the dict has no strip; the shared form is the dict with
    # every side given the same needle.
    only_a = fp.page_frame({"full": p, "A": p, "B": p}, {"A": [33]})
    assert [t.meta["label"] for t in strips(only_a)] == ["A"]
    assert len(overviews(only_a)) == 3
    shared = fp.page_frame({"A": p, "B": p}, [33])
    as_dict = fp.page_frame({"A": p, "B": p}, {"A": [33], "B": [33]})
    assert [t.meta for t in strips(shared)] == [t.meta for t in strips(as_dict)]
    with pytest.raises(ValueError, match="C"):
        fp.page_frame({"A": p, "B": p}, {"C": [33]})


@pytest.mark.parametrize(
    "n, page_size, needle, pages, n_pages",
    [
        (50, 16, [49], [0, 1, 2, 3], 4),  # partial last page (2 tokens) holds the needle
        (50, 16, [20, 21], [0, 1, 2, 3], 4),
        (120, 1, [60, 61, 62], [57, 58, 59, 60, 61, 62, 63, 64, 65], 120),  # tokens
    ],
    ids=["P16-partial-last", "P16-mid", "P1"],
)
def test_page_sizes_and_partial_last_page(n, page_size, needle, pages, n_pages):
    torch.manual_seed(0)
    prof = torch.rand(2, 4, n) ** 4
    prof = prof / prof.sum(-1, keepdim=True)
    cfg = EvictionConfig(budget=0.7, page_size=page_size, n_sink=4, window=2)
    p = pagekv.plan(prof, 2, cfg)
    fig = fp.page_frame({"A": p}, needle)
    (over,) = overviews(fig)
    (strip,) = strips(fig)
    assert len(over.z[0]) == n_pages and strip.meta["pages"] == pages
    kept, total = fp.needle_page_counts(p, needle)
    assert total == 4 and (strip.meta["kept"], strip.meta["total"]) == (kept, total)
    assert kept == int((p.needle_retention(needle) == 1).sum())
    unit = "token" if page_size == 1 else "page"
    assert fig.layout.xaxis.title.text == unit and fig.layout.xaxis2.title.text == unit
    last = strip.text[0][-1]  # hover names the tokens of a (partial) page
    assert last.startswith("token 65" if page_size == 1 else "page 3 (tokens 48-49)")


def test_overview_keeps_every_page_state():
    p = spiked_plan([[33, 13], [50, 34]])
    fig = fp.page_frame({"A": p}, [33])
    (over,) = overviews(fig)
    assert [list(r) for r in over.z] == fp.page_states(p).reshape(4, -1).tolist()
    assert list(over.y) == ["L0 g0", "L0 g1", "L1 g0", "L1 g1"]


def _luminance(hex_colour: str) -> float:
    """WCAG relative luminance of `#RRGGBB`."""
    rgb = [int(hex_colour[i : i + 2], 16) / 255 for i in (1, 3, 5)]
    lin = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in rgb]
    return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]


def test_state_and_needle_colours_are_distinct_palette_colours():
    palette = {
        style.BLUE,
        style.ORANGE,
        style.GREEN,
        style.VERMILLION,
        style.SKY,
        style.PURPLE,
        style.YELLOW,
        style.BLACK,
        style.EVICTED,
    }
    used = [*style.STATE_COLOURS, style.NEEDLE]
    assert set(used) <= palette
    assert len(set(used)) == len(used)
    # Told apart by lightness alone (any colour vision, greyscale print): every pair's
    # WCAG contrast ratio is at least 1.8. Vermillion for the needle would fail
    # against orange (1.7).
    lum = {c: _luminance(c) for c in used}
    for i, a in enumerate(used):
        for b in used[i + 1 :]:
            hi, lo = max(lum[a], lum[b]), min(lum[a], lum[b])
            assert (hi + 0.05) / (lo + 0.05) >= 1.8, (a, b)


def test_figure_uses_the_state_and_needle_colours():
    p = spiked_plan([[33, 13], [50, 34]])
    fig = fp.page_frame({"A": p, "B": p}, [33])
    for t in overviews(fig) + strips(fig):
        scale = [c for _, c in t.colorscale]
        assert scale == [c for c in style.STATE_COLOURS for _ in range(2)]
        assert (t.zmin, t.zmax) == (0, 3)
    assert fig.layout.shapes and {s.line.color for s in fig.layout.shapes} == {style.NEEDLE}
    assert all(s.fillcolor in (None, "rgba(0,0,0,0)") for s in fig.layout.shapes)  # no fill
    legend = {t.name: t.marker for t in fig.data if t.type == "scatter"}
    assert [legend[name].color for name in style.STATE_NAMES] == style.STATE_COLOURS
    (needle_name,) = [k for k in legend if "needle" in k]
    assert legend[needle_name].line.color == style.NEEDLE
    assert legend[needle_name].color not in style.STATE_COLOURS


def test_strip_pages_clips_and_merges():
    assert fp.strip_pages(10, [0, 5], 2) == [0, 1, 2, 3, 4, 5, 6, 7]
    assert fp.strip_pages(10, [9], 3) == [6, 7, 8, 9]
    assert fp.strip_pages(1, [0], 3) == [0]  # a one-page prompt
    with pytest.raises(ValueError, match="margin"):
        fp.strip_pages(10, [5], -1)


def test_long_side_titles_wrap_onto_two_lines():
    """A side label that names several differing settings wraps (at 800 px it ran into
    the next column's title); a short one is left as it is."""
    p = spiked_plan([[33, 13], [50, 34]])
    long_a = "A: entropy, window scorer, uniform budget"
    fig = fp.page_frame({long_a: p, "B: entropy": p}, [33])
    titles = [a.text for a in fig.layout.annotations]
    assert "A: entropy, window<br>scorer, uniform budget" in titles
    assert "B: entropy" in titles
    for t in titles:
        lines = t.split("<br>")
        assert len(lines) <= 2
        if not t.startswith("needle"):
            assert all(len(line) <= fp.SIDE_TITLE_CHARS for line in lines)


def test_strip_ticks_keep_clear_of_each_other():
    """A four-token needle is labelled once; the strip's ends only where they keep clear."""
    from pagekv.app.figures.eviction import (
        STRIP_SIDE_PX,
        TICK_CHAR_PX,
        TICK_GAP_PX,
        strip_fraction,
        strip_ticks,
    )

    pages = list(range(1025, 1035))
    vals, text = strip_ticks(pages, [1028, 1029, 1030, 1031])
    assert "1028–1031" in text and "1029" not in text and "1030" not in text
    assert vals == sorted(vals)
    narrow = strip_fraction(len(pages)) * STRIP_SIDE_PX / len(pages)
    placed = list(zip(vals, text, strict=True))
    for (p1, t1), (p2, t2) in zip(placed, placed[1:], strict=False):
        assert (p2 - p1) * narrow >= (len(t1) + len(t2)) * TICK_CHAR_PX / 2 + TICK_GAP_PX
    # Two needle tokens side by side: one label, never "107" and "108" apart.
    vals, text = strip_ticks(list(range(104, 112)), [107, 108])
    assert "107–108" in text and "107" not in text and "108" not in text


def test_the_memory_chart_labels_say_their_unit():
    """The memory chart's bar labels (tokens) and axis (MiB) each say their unit."""
    from pagekv.app.figures.eviction import memory_bars

    fig = memory_bars([{"policy": "entropy", "tokens": 300, "bytes": 3 * 2**20}])
    assert fig.layout.yaxis.title.text == "KV cache kept (MiB)"
    assert list(fig.data[0].text) == ["300 tokens"]
    assert "MiB" in fig.data[0].hovertemplate and "per (layer, group)" in fig.data[0].hovertemplate


def test_the_head_that_gains_most_with_isolation_is_never_a_sink_head():
    """The "gains most with isolation" arrow and lesson 3 pick among non-sink heads."""
    from types import SimpleNamespace

    import torch

    from pagekv.app.figures.eviction import head_weights_bars
    from pagekv.maths.metrics import isolation_gain

    iso = torch.tensor([[0.50, 0.30, 0.20, 0.40, 0.35, 0.25]])
    raw = torch.tensor([[0.20, 0.40, 0.40, 0.30, 0.30, 0.40]])  # head 0 gains 0.30, most
    sinks = torch.tensor([[True, False, False, False, True, False]])
    assert isolation_gain(iso[0], raw[0]) == (0, pytest.approx(0.3))  # unmasked: a sink
    assert isolation_gain(iso[0], raw[0], sinks[0]) == (3, pytest.approx(0.1))
    assert isolation_gain(iso[0], raw[0], torch.ones(6, dtype=torch.bool)) == (-1, 0.0)
    mass = torch.tensor([[0.9, 0.2, 0.7, 0.1, 0.8, 0.3]])
    p = SimpleNamespace(weights_isolated=iso, weights_nosink=raw, sink_heads=sinks, n_groups=2,
                        sink_mass=mass)  # fmt: skip
    fig = head_weights_bars(p, 0)
    marks = [a for a in fig.layout.annotations if "gains most" in a.text]
    assert [m.x for m in marks] == ["g1 h3"]
    # Head 2 loses most (0.20), with a sink mass of 0.70 though not labelled a sink.
    lost = [a for a in fig.layout.annotations if "loses most" in a.text]
    assert [(m.x, "(sink mass 0.70)" in m.text) for m in lost] == [("g0 h2", True)]


def test_the_head_losing_most_with_isolation_is_marked_with_its_sink_mass(bundled_study):
    """The head losing most under isolation is marked with its sink mass."""
    from pagekv.app.figures import head_weights_bars
    from pagekv.app.page_text import CAPTIONS

    runner = bundled_study.runner
    ids = bundled_study.tokenizer.encode("Sinks and heads: a page of plain words. " * 40)[:320]
    pre = runner.prefill(ids, window_max=32)
    plan = runner.plan(pre, EvictionConfig(policy="entropy", budget=0.3))
    loss = plan.weights_nosink - plan.weights_isolated  # [L, H]
    layer = int(loss.max(-1).values.argmax())
    head = int(loss[layer].argmax())
    fig = head_weights_bars(plan, layer)
    marks = [a for a in fig.layout.annotations if "loses most" in (a.text or "")]
    assert len(marks) == 1
    assert marks[0].x.startswith(f"g{head // 3} h{head}")
    assert f"(sink mass {float(plan.sink_mass[layer, head]):.2f})" in marks[0].text
    caption = CAPTIONS["weights"]
    assert "1/r" in caption and "losing most" in caption and "sink heads that gain" not in caption
