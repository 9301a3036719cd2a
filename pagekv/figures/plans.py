"""The app's views of plans: page frame, head weights, sinks, retention, UOR, memory,
and the constructed mechanism. Pure functions from `Plan` objects and numbers to
plotly figures (see `pagekv.figures`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .style import (
    BLACK,
    BLUE,
    GREEN,
    ORANGE,
    POLICY_COLOURS,
    PURPLE,
    SKY,
    STATE_COLOURS,
    STATE_NAMES,
    VERMILLION,
    YELLOW,
    _go,
    layout,
)


def page_states(p) -> torch.Tensor:
    """int `[L, G, n_pages]`: 0 evicted, 1 kept, 2 protected."""
    states = p.page_keep.to(torch.int64)
    return torch.where(p.protected.expand_as(states), torch.full_like(states, 2), states)


def page_frame(plans: dict, needle_positions: Sequence[int] | None = None, title=None):
    """Pages x (layer, group) for one or more plans side by side.

    Each cell is one (layer, group, page): kept, evicted or protected; the needle's
    pages are outlined. `plans` maps a label (policy name) to a `Plan`.
    """
    go = _go()
    from plotly.subplots import make_subplots

    labels = list(plans)
    fig = make_subplots(rows=1, cols=len(labels), subplot_titles=labels, shared_yaxes=True)
    colorscale = []
    for i, c in enumerate(STATE_COLOURS):
        colorscale += [[i / 3, c], [(i + 1) / 3, c]]
    for col, label in enumerate(labels, start=1):
        p = plans[label]
        st = page_states(p)  # [L, G, n_pages]
        L, G, n_pages = st.shape
        z = st.reshape(L * G, n_pages).tolist()
        rows = [f"L{layer} g{g}" for layer in range(L) for g in range(G)]
        text = [[STATE_NAMES[v] for v in row] for row in z]
        fig.add_trace(
            go.Heatmap(
                z=z,
                x=list(range(n_pages)),
                y=rows,
                zmin=0,
                zmax=3,
                colorscale=colorscale,
                showscale=False,
                text=text,
                hovertemplate="%{y} page %{x}: %{text}<extra>" + label + "</extra>",
                xgap=0.5,
                ygap=0.5,
            ),
            row=1,
            col=col,
        )
        if needle_positions:
            P = p.config.page_size
            for j in sorted({int(t) // P for t in needle_positions}):
                fig.add_shape(
                    type="rect",
                    x0=j - 0.5,
                    x1=j + 0.5,
                    y0=-0.5,
                    y1=L * G - 0.5,
                    line=dict(color=VERMILLION, width=2),
                    row=1,
                    col=col,
                )
        fig.update_xaxes(title_text="page", row=1, col=col)
    fig.update_yaxes(autorange="reversed")
    # A legend of the three states (dummy scatter markers).
    for name, colour in zip(STATE_NAMES, STATE_COLOURS, strict=True):
        fig.add_trace(
            go.Scatter(
                x=[None],
                y=[None],
                mode="markers",
                marker=dict(size=11, color=colour, symbol="square", line=dict(width=1)),
                name=name,
            )
        )
    if needle_positions:
        fig.add_trace(
            go.Scatter(
                x=[None],
                y=[None],
                mode="markers",
                marker=dict(
                    size=11, color="white", symbol="square", line=dict(color=VERMILLION, width=2)
                ),
                name="needle page",
            )
        )
    L, G = plans[labels[0]].keep.shape[:2]
    return layout(fig, title or "Page frame: what each (layer, group) keeps", 200 + 9 * L * G, True)


def head_weights_bars(p, layer: int, title=None):
    """Weights of the heads of each group at one layer, with and without isolation."""
    go = _go()
    L, H = p.weights_isolated.shape
    G = p.n_groups
    r = H // G
    heads = [
        f"g{h // r} h{h}" + (" (sink)" if bool(p.sink_heads[layer, h]) else "") for h in range(H)
    ]
    fig = go.Figure()
    fig.add_trace(
        go.Bar(
            x=heads,
            y=p.weights_isolated[layer].tolist(),
            name="sink-isolated (Page-EntroKV)",
            marker_color=BLUE,
        )
    )
    fig.add_trace(
        go.Bar(
            x=heads, y=p.weights_nosink[layer].tolist(), name="without isolation", marker_color=SKY
        )
    )
    fig.add_hline(y=1 / r, line_dash="dot", line_color=ORANGE, annotation_text="mean pooling 1/r")
    fig.update_layout(barmode="group", yaxis_title="weight within group", yaxis_range=[0, 1])
    return layout(fig, title or f"Head weights at layer {layer}", 360)


def layer_head_heatmap(
    values: torch.Tensor, n_groups: int, title: str, zmax=None, colorscale="Cividis"
):
    """A layer x head overview (e.g. weights or sink mass), groups separated by gaps."""
    go = _go()
    L, H = values.shape
    r = H // n_groups
    x = [f"g{h // r} h{h}" for h in range(H)]
    fig = go.Figure(
        go.Heatmap(
            z=values.tolist(),
            x=x,
            y=[f"L{layer}" for layer in range(L)],
            colorscale=colorscale,
            zmin=0,
            zmax=zmax,
            hovertemplate="%{y} %{x}: %{z:.3f}<extra></extra>",
        )
    )
    for g in range(1, n_groups):
        fig.add_vline(x=g * r - 0.5, line_color="white", line_width=3)
    fig.update_yaxes(autorange="reversed")
    return layout(fig, title, 120 + 14 * L)


def sink_advantage_lines(adv_iso: torch.Tensor, adv_raw: torch.Tensor, title=None):
    """Per layer: the mean over groups (where defined) of the sink advantage."""
    go = _go()

    def per_layer(adv):
        out = []
        for row in adv:
            ok = row[~torch.isnan(row)]
            out.append(float(ok.mean()) if ok.numel() else None)
        return out

    L = adv_iso.shape[0]
    fig = go.Figure()
    fig.add_trace(
        go.Scatter(
            x=list(range(L)),
            y=per_layer(adv_raw),
            name="without isolation",
            mode="lines+markers",
            line_color=SKY,
        )
    )
    fig.add_trace(
        go.Scatter(
            x=list(range(L)),
            y=per_layer(adv_iso),
            name="sink-isolated",
            mode="lines+markers",
            line_color=BLUE,
        )
    )
    fig.add_hline(y=1.0, line_dash="dot", line_color="grey")
    fig.update_layout(
        xaxis_title="layer",
        yaxis_title="sink / non-sink mean weight",
        yaxis_type="log",
        yaxis_dtick=1,  # one label per decade
    )
    if any(v is None for v in per_layer(adv_raw)):
        fig.add_annotation(
            text="gaps: no group of that layer mixes sink and non-sink heads",
            xref="paper",
            yref="paper",
            x=0,
            y=1.0,
            showarrow=False,
            xanchor="left",
            yanchor="bottom",
            font=dict(size=11, color="grey"),
        )
    return layout(fig, title or "Sink advantage (the masquerade)", 340)


def needle_retention_heatmap(retentions: dict, n_groups: int, title=None):
    """Fraction of the needle kept per (layer, group) for each policy, side by side."""
    go = _go()
    from plotly.subplots import make_subplots

    labels = list(retentions)
    fig = make_subplots(rows=1, cols=len(labels), subplot_titles=labels, shared_yaxes=True)
    for col, label in enumerate(labels, start=1):
        ret = torch.as_tensor(retentions[label], dtype=torch.float64)
        L, G = ret.shape
        fig.add_trace(
            go.Heatmap(
                z=ret.tolist(),
                x=[f"g{g}" for g in range(G)],
                y=[f"L{layer}" for layer in range(L)],
                zmin=0,
                zmax=1,
                colorscale=[[0, VERMILLION], [0.5, YELLOW], [1, BLUE]],
                showscale=col == len(labels),
                hovertemplate="%{y} %{x}: %{z:.2f}<extra>" + label + "</extra>",
                xgap=1,
                ygap=1,
            ),
            row=1,
            col=col,
        )
    fig.update_yaxes(autorange="reversed")
    L = torch.as_tensor(retentions[labels[0]]).shape[0]
    return layout(fig, title or "Needle retention per (layer, group)", 140 + 12 * L)


def uor_curve(
    budgets: Sequence[float],
    uor_mean: Sequence[float],
    uor_max: Sequence[float],
    r: int,
    title=None,
):
    """UOR of head-independent selection across budgets, against the pooled 1.0."""
    go = _go()
    x = [100 * b for b in budgets]
    fig = go.Figure()
    fig.add_trace(
        go.Scatter(
            x=x,
            y=list(uor_max),
            name="head-independent, max",
            mode="lines+markers",
            line_color=VERMILLION,
        )
    )
    fig.add_trace(
        go.Scatter(
            x=x,
            y=list(uor_mean),
            name="head-independent, mean",
            mode="lines+markers",
            line=dict(color=VERMILLION, dash="dash"),
        )
    )
    fig.add_trace(
        go.Scatter(
            x=x, y=[1.0] * len(x), name="pooled policies (exactly 1)", mode="lines", line_color=BLUE
        )
    )
    fig.add_hline(y=r, line_dash="dot", line_color="grey", annotation_text=f"r = {r} (worst case)")
    fig.update_layout(
        xaxis_title="budget (% of prompt)",
        yaxis_title="union overhead ratio",
        yaxis_range=[0.9, r + 0.2],
    )
    return layout(fig, title or "Union overhead of head-independent selection", 340)


def memory_bars(rows: Sequence[dict], title=None):
    """Cache kept per policy: rows of {policy, tokens, bytes}."""
    go = _go()
    fig = go.Figure(
        go.Bar(
            x=[r["policy"] for r in rows],
            y=[r["bytes"] / 2**20 for r in rows],
            marker_color=[POLICY_COLOURS.get(r["policy"], BLACK) for r in rows],
            text=[f"{r['tokens']} tok" for r in rows],
            textposition="outside",
            cliponaxis=False,
            hovertemplate="%{x}: %{y:.2f} MiB<extra></extra>",
        )
    )
    top = max((r["bytes"] for r in rows), default=1) / 2**20
    fig.update_layout(yaxis_title="KV cache kept (MiB)", yaxis_range=[0, 1.15 * top])
    return layout(fig, title or "Cache memory kept", 320)


def mechanism_figure(mech, plans: dict, title=None):
    """Constructed profiles: each head's profile, and which tokens each policy keeps."""
    go = _go()
    from plotly.subplots import make_subplots

    prof = mech.profiles[0]  # [r, n]
    r, n = prof.shape
    labels = list(plans)
    fig = make_subplots(
        rows=2,
        cols=1,
        shared_xaxes=True,
        row_heights=[0.65, 0.35],
        vertical_spacing=0.08,
        subplot_titles=["constructed head profiles a_h(t)", "tokens kept"],
    )
    palette = [VERMILLION, ORANGE, PURPLE, GREEN, SKY, YELLOW, BLACK, BLUE]
    for h in range(r):
        fig.add_trace(
            go.Scatter(
                x=list(range(n)),
                y=prof[h].tolist(),
                mode="lines",
                name=f"h{h} {mech.roles[h]}",
                line=dict(color=palette[h % len(palette)], width=1.5),
            ),
            row=1,
            col=1,
        )
    for label in labels:
        keep = plans[label].keep[0, 0]
        xs = torch.nonzero(keep).flatten().tolist()
        fig.add_trace(
            go.Scatter(
                x=xs,
                y=[label] * len(xs),
                mode="markers",
                marker=dict(symbol="square", size=6, color=POLICY_COLOURS.get(label, BLACK)),
                name=f"kept by {label}",
                showlegend=False,
            ),
            row=2,
            col=1,
        )
    for t, colour, name in [(mech.needle_token, VERMILLION, "needle")] + [
        (mech.distractor_tokens[0], ORANGE, "distractor")
    ]:
        fig.add_vline(
            x=t,
            line_dash="dot",
            line_color=colour,
            annotation_text=name,
            annotation_position="top right",
            row=1,
            col=1,
        )
    fig.update_xaxes(title_text="token", row=2, col=1)
    fig.update_yaxes(title_text="attention", row=1, col=1)
    return layout(fig, title or "Mechanism (constructed profiles, not a model)", 500, True)
