"""`max`: a token's group score is its best head's score, `max_{h in g} s_h(t)`."""

from pagekv.maths.policies.base import Policy

POLICY = Policy(
    name="max",
    order=3,
    summary="max pooling: a token scores what its most interested head gives it",
    page_scores=lambda x: x.max_pages(),
)
