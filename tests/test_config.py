"""EvictionConfig validation: every bad value names its field and the allowed range."""

import math

import pytest
import torch

from pagekv import POLICIES, EvictionConfig, plan


def test_defaults_are_the_design_defaults():
    cfg = EvictionConfig()
    assert (cfg.policy, cfg.n_sink, cfg.window, cfg.tau, cfg.smoothing) == (
        "entropy",
        4,
        32,
        1.0,
        1,
    )
    assert cfg.page_reduction == "max" and cfg.sink_threshold == 0.5


@pytest.mark.parametrize(
    "field, value, fragment",
    [
        ("policy", "snapkv", "policy must be one of"),
        ("budget", 0.0, "budget must be in (0, 1]"),
        ("budget", 1.5, "budget must be in (0, 1]"),
        ("budget", math.nan, "budget"),
        ("budget", "0.2", "budget"),
        ("page_size", 0, "page_size must be an integer >= 1"),
        ("page_size", 2.0, "page_size"),
        ("page_size", True, "page_size"),
        ("n_sink", -1, "n_sink must be an integer >= 0"),
        ("window", 0, "window must be an integer >= 1"),
        ("tau", 0.0, "tau must be a finite number > 0"),
        ("tau", math.inf, "tau"),
        ("smoothing", 2, "smoothing must be an odd integer >= 1"),
        ("smoothing_kind", "median", "smoothing_kind must be one of"),
        ("page_reduction", "mean", "page_reduction must be one of"),
        ("sink_threshold", 0.0, "sink_threshold must be in (0, 1]"),
    ],
)
def test_invalid_values_name_the_field(field, value, fragment):
    with pytest.raises(ValueError) as err:
        EvictionConfig(**{field: value})
    assert fragment in str(err.value)
    assert field in str(err.value)


def test_frozen_and_replace_revalidates():
    cfg = EvictionConfig()
    with pytest.raises(AttributeError):
        cfg.budget = 0.5  # type: ignore[misc]
    assert cfg.replace(budget=0.5).budget == 0.5
    with pytest.raises(ValueError, match="budget"):
        cfg.replace(budget=2.0)


#: The policies of docs/design.md, "The data path", written out here rather than read from the code.
DESIGN_POLICIES = {
    "entropy", "entropy_nosink", "mean", "max", "head_independent", "streaming", "full",
}  # fmt: skip


def test_every_design_policy_is_accepted():
    assert DESIGN_POLICIES <= set(POLICIES), DESIGN_POLICIES - set(POLICIES)
    assert len(set(POLICIES)) == len(POLICIES), "a policy listed twice"


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_plans_as_its_config_says(policy):
    """Every accepted name is planned, and `pooled` says truly whether the plan is one
    dense set per (layer, group) within budget (head_independent is the only one not)."""
    cfg = EvictionConfig(policy=policy, budget=0.3, page_size=4, window=8, n_sink=2)
    assert cfg.pooled == (policy != "head_independent")
    g = torch.Generator().manual_seed(0)
    profiles = torch.softmax(torch.randn(2, 6, 61, generator=g) * 3, -1)  # r = 3
    p = plan(profiles, 2, cfg)
    assert p.config.policy == policy
    k = 61 if policy == "full" else 18  # floor(0.3 * 61)
    assert p.budget_tokens == k
    if cfg.pooled:
        # Pooled UOR = 1, measured rather than read from `p.uor` (a constant 1).
        assert p.dense and torch.equal(p.keep.sum(-1), p.union_tokens)
        assert bool((p.union_tokens <= k).all())
    else:  # the union of 3 heads' sets: over budget somewhere for these random heads
        assert bool((p.union_tokens > k).any()) and bool((p.uor > 1).any())


def test_budget_tokens_floor_and_rounding():
    assert EvictionConfig(budget=0.2).budget_tokens(1000) == 200
    assert EvictionConfig(budget=0.2).budget_tokens(1004) == 200  # floor(200.8)
    assert EvictionConfig(budget=0.29).budget_tokens(100) == 29  # not 28 from 28.999...
    assert EvictionConfig(policy="full", budget=0.1).budget_tokens(77) == 77
