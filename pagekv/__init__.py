"""Page-EntroKV: entropy-weighted, page-level KV-cache eviction under GQA.

The public core::

    from pagekv import EvictionConfig, plan
    cfg = EvictionConfig(policy="entropy", budget=0.2, page_size=16)
    p = plan(profiles, n_groups=G, config=cfg)  # profiles [L, H, n]
    p.keep  # bool [L, G, n]

Real decoding lives in `pagekv.runner` / `pagekv.study` (they import transformers,
so they are not imported here).
"""

from .backend import BACKENDS, BackendError, resolve_backend
from .config import POLICIES, POOLED_POLICIES, EvictionConfig
from .entropy import (
    HeadMasses,
    collision_entropy,
    collision_mass,
    entropy_head_weights,
    isolate_sinks,
    isolated_collision_mass,
    sink_heads,
    sink_mass,
)
from .metrics import GroupOverlap, group_overlap, needle_retention, sink_advantage
from .paged import PagedKV, block_table, to_paged
from .paging import BudgetError, min_feasible_budget, page_sizes, protected_pages
from .plan import Plan, plan
from .policies import Policy, get_policy
from .profiles import attention_profiles, smooth_scores

__all__ = [
    "BACKENDS",
    "BackendError",
    "PagedKV",
    "block_table",
    "resolve_backend",
    "to_paged",
    "POLICIES",
    "POOLED_POLICIES",
    "BudgetError",
    "EvictionConfig",
    "GroupOverlap",
    "HeadMasses",
    "Policy",
    "get_policy",
    "Plan",
    "attention_profiles",
    "collision_entropy",
    "collision_mass",
    "entropy_head_weights",
    "group_overlap",
    "isolate_sinks",
    "isolated_collision_mass",
    "min_feasible_budget",
    "needle_retention",
    "page_sizes",
    "plan",
    "protected_pages",
    "sink_advantage",
    "sink_heads",
    "sink_mass",
    "smooth_scores",
]

__version__ = "0.1.0"
