"""`entropy` (Page-EntroKV): pool each group by sink-isolated collision entropy.

`s_g(t) = sum_{h in g} w_h s_h(t)` with `w_h = softmax_{h in g}(-H2(a~_h) / tau)`,
`a~_h` the profile with the sinks removed and renormalised (docs/design.md, "The data path").
"""

from pagekv.maths.policies.base import Policy

POLICY = Policy(
    name="entropy",
    order=0,
    summary="Page-EntroKV: heads weighted by sink-isolated collision entropy",
    weights=lambda x: x.weights_isolated,
    page_scores=lambda x: x.weighted_pages(x.weights_isolated),
)
