"""`entropy_nosink`: the entropy weights without sink isolation (an ablation).

Sink heads look focused here (their mass sits on a few tokens): the masquerade
that `entropy` removes.
"""

from pagekv.maths.policies.base import Policy

POLICY = Policy(
    name="entropy_nosink",
    order=1,
    summary="entropy weights taken on the raw profiles (sinks included): the ablation",
    weights=lambda x: x.weights_nosink,
    page_scores=lambda x: x.weighted_pages(x.weights_nosink),
)
