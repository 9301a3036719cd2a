"""What a budget buys, drawn: prompts a fixed pool holds (live, from the plans) beside
the sequences held and tokens per second the capacity benchmark measured earlier."""

from __future__ import annotations

from pagekv.app.figures.style import BLACK, GREEN, POLICY_COLOURS, _go, layout

#: The benchmark's sides, in the order drawn, with their colours.
MEASURED_SIDES = ("full", "entropy 20%", "entropy 10%", "transformers CB")
_MEASURED_COLOURS = {"full": BLACK, "transformers CB": GREEN}


def capacity_bars(live: dict, measured: dict | None):
    """Three panels: how many prompts like this one the pool holds at each side's
    budget and with the full cache (`live`: `pagekv.app.capacity.pool_rows`); and, from
    the committed benchmark (`measured`: `pagekv.app.capacity.measured`, None where
    missing), the sequences it held at once and the decode's tokens per second."""
    go = _go()
    from plotly.subplots import make_subplots

    mib = live["pool_bytes"] / 2**20
    titles = [f"live: prompts a {mib:.0f} MiB pool holds", "measured earlier: held at once",
              "measured earlier: decode tokens/s"]  # fmt: skip
    fig = make_subplots(rows=1, cols=3, subplot_titles=titles, horizontal_spacing=0.09)
    fig.update_annotations(font_size=12)
    rows = live["rows"]
    fig.add_trace(
        go.Bar(
            x=[r["label"] for r in rows],
            y=[r["held"] for r in rows],
            marker_color=[POLICY_COLOURS.get(r["policy"], BLACK) for r in rows],
            text=[str(r["held"]) for r in rows],
            textposition="outside",
            cliponaxis=False,
            customdata=[r["bytes"] / 2**20 for r in rows],
            hovertemplate="%{x}: %{y} prompts, %{customdata:.1f} MiB each<extra></extra>",
            showlegend=False,
        ),
        row=1,
        col=1,
    )
    if measured is not None:
        sides = [s for s in MEASURED_SIDES if s in measured["sides"]]
        colours = [_MEASURED_COLOURS.get(s, POLICY_COLOURS["entropy"]) for s in sides]
        held = [measured["sides"][s]["held"] for s in sides]
        fig.add_trace(
            go.Bar(x=sides, y=held, marker_color=colours, text=[str(h) for h in held],
                   textposition="outside", cliponaxis=False, showlegend=False,
                   hovertemplate="%{x}: %{y} sequences at once<extra></extra>"),
            row=1, col=2,
        )  # fmt: skip
        ours = [s for s in sides if measured["sides"][s]["decode_tok_s"] is not None]
        tps = [measured["sides"][s]["decode_tok_s"] for s in ours]
        fig.add_trace(
            go.Bar(x=ours, y=tps, marker_color=colours[: len(ours)],
                   text=[f"{t:.1f}" for t in tps], textposition="outside", cliponaxis=False,
                   showlegend=False, hovertemplate="%{x}: %{y:.1f} tokens/s<extra></extra>"),
            row=1, col=3,
        )  # fmt: skip
        note = (
            f"measured earlier, not live: {measured['prompts']} prompts of "
            f"{measured['prompt_tokens'][1]} tokens on {measured['model']}, "
            f"{measured['cpu']} (benchmarks/bench_capacity.py)"
        )
    else:
        note = "the capacity benchmark's results are missing: run benchmarks/bench_capacity.py"
    for col in (1, 2, 3):
        fig.update_xaxes(tickfont_size=10, row=1, col=col)
    top = max((r["held"] for r in rows), default=1)
    fig.update_yaxes(range=[0, 1.2 * max(top, 1)], title_text="prompts", row=1, col=1)
    title = (
        f"What a budget buys: prompts of {live['prompt_tokens']} tokens in one pool"
        f"<br><span style='font-size:12px'>{note}</span>"
    )
    return layout(fig, title, 420, above=24)
