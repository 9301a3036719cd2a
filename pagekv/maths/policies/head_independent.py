"""`head_independent`: every query head selects its own pages within the budget; the
group must store the union of its heads' picks (up to `r` times the budget). The
baseline whose overspend the union overhead ratio (UOR) measures.
"""

from pagekv.maths.policies.base import Policy

POLICY = Policy(
    name="head_independent",
    order=4,
    summary="every head picks its own pages; the group stores the union",
    page_scores=lambda x: x.head_pages(),
    per_head=True,
)
