"""EvictionConfig validation: every bad value names its field and the allowed range."""

import math

import pytest

from pagekv import POLICIES, EvictionConfig


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


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_constructs(policy):
    assert EvictionConfig(policy=policy).policy == policy


def test_budget_tokens_floor_and_rounding():
    assert EvictionConfig(budget=0.2).budget_tokens(1000) == 200
    assert EvictionConfig(budget=0.2).budget_tokens(1004) == 200  # floor(200.8)
    assert EvictionConfig(budget=0.29).budget_tokens(100) == 29  # not 28 from 28.999...
    assert EvictionConfig(policy="full", budget=0.1).budget_tokens(77) == 77
