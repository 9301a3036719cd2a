"""The policy registry: one small file per policy, found here by name.

Every module of this package except `base` defines `POLICY` (a `base.Policy`); the
registry imports them all, so adding a policy means adding one file (and its test).
This module is the one place the list of policies is defined; the configuration,
the CLI, the app, the figures and the replay read `POLICIES` and the derived tuples.

    >>> POLICIES[:3]
    ('entropy', 'entropy_nosink', 'mean')
    >>> get_policy("head_independent").per_head
    True
"""

from __future__ import annotations

import importlib
import pkgutil

from pagekv.maths.policies.base import Policy, ScoreInputs


def _discover() -> dict[str, Policy]:
    found: dict[str, Policy] = {}
    for info in pkgutil.iter_modules(__path__):
        if info.name == "base" or info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        policy = getattr(module, "POLICY", None)
        if not isinstance(policy, Policy):
            raise TypeError(f"{module.__name__} must define POLICY, a pagekv.maths.policies.Policy")
        if policy.name in found:
            raise ValueError(f"two policy files define the policy {policy.name!r}")
        found[policy.name] = policy
    return dict(sorted(found.items(), key=lambda kv: (kv[1].order, kv[0])))


REGISTRY: dict[str, Policy] = _discover()

#: Every policy, in display order.
POLICIES: tuple[str, ...] = tuple(REGISTRY)
#: Policies whose kept set is the same dense size in every (layer, group).
POOLED_POLICIES: tuple[str, ...] = tuple(n for n, p in REGISTRY.items() if p.pooled)
#: Pooled policies that evict (every pooled one but `full`).
EVICTING_POOLED: tuple[str, ...] = tuple(
    n for n, p in REGISTRY.items() if p.pooled and not p.keeps_all
)
#: Pooled policies that score pages from the attention profiles (the pooling rules).
POOLING_POLICIES: tuple[str, ...] = tuple(n for n in EVICTING_POOLED if REGISTRY[n].uses_attention)


def get_policy(name: str) -> Policy:
    """The policy called `name`; ValueError listing the choices otherwise."""
    try:
        return REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}; got {name!r}") from None


__all__ = [
    "EVICTING_POOLED",
    "POLICIES",
    "POOLED_POLICIES",
    "POOLING_POLICIES",
    "REGISTRY",
    "Policy",
    "ScoreInputs",
    "get_policy",
]
