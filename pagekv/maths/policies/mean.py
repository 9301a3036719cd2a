"""`mean`: average the heads of each group (`w_h = 1/r`), what most libraries do."""

from pagekv.maths.policies.base import Policy

POLICY = Policy(
    name="mean",
    order=2,
    summary="mean pooling: every head of a group weighs 1/r",
    weights=lambda x: x.weights_uniform,
    page_scores=lambda x: x.weighted_pages(x.weights_uniform),
)
