"""`full`: no eviction, the reference every other policy is compared with.

Its budget is the whole prompt, so selection keeps every page; the page scores
are mean pooling's, for display only.
"""

from pagekv.maths.policies.base import Policy

POLICY = Policy(
    name="full",
    order=6,
    summary="no eviction: the full cache",
    page_scores=lambda x: x.weighted_pages(x.weights_uniform),
    keeps_all=True,
)
