"""Every figure of the project, in one package: the app's views and the replay's.

Pure functions from plans and numbers to `plotly.graph_objects.Figure`s; plotly is
imported lazily (inside each function), so importing this package needs only torch.

- `style`: the palette (Okabe-Ito, colour-blind safe), page states, `layout` (this
  package re-exports only the figures: import these from `style`).
- `eviction`: the app's views of one prompt's plans (what a fixed pool holds of it
  included) and of the constructed mechanism.
- `replay`: the replay harness's table figures (T2 scatter, T4 recall, T7 answers)
  and RULER's score against physical memory.
"""

from pagekv.app.figures.eviction import (
    capacity_bars,
    head_weights_bars,
    layer_head_heatmap,
    mechanism_figure,
    memory_bars,
    needle_page_counts,
    needle_pages,
    needle_retention_heatmap,
    page_frame,
    page_states,
    sink_advantage_lines,
    stored_glance,
    strip_pages,
    union_over_budget_heatmap,
    uor_curve,
)
from pagekv.app.figures.replay import (
    answer_bars,
    disagreement_scatter,
    memory_curves,
    recall_bars,
)

__all__ = [
    "answer_bars",
    "capacity_bars",
    "disagreement_scatter",
    "head_weights_bars",
    "layer_head_heatmap",
    "mechanism_figure",
    "memory_bars",
    "memory_curves",
    "needle_page_counts",
    "needle_pages",
    "needle_retention_heatmap",
    "page_frame",
    "page_states",
    "recall_bars",
    "sink_advantage_lines",
    "stored_glance",
    "strip_pages",
    "union_over_budget_heatmap",
    "uor_curve",
]
