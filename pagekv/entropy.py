"""Sink mass, sink-isolated collision entropy and head weights (DESIGN.md section 2).

All functions take profiles `[L, H, n]` (rows sum to 1) and are batched over
layers and heads; none loops over tokens.
"""

from __future__ import annotations

import torch

#: A head whose non-sink mass is below this (relative to its total) has no usable
#: non-sink profile: its attention is all on the sinks. Its sink-isolated profile
#: is then defined as uniform over the non-sink tokens, i.e. the maximum-entropy
#: profile, so the head gets the smallest weight its group can give. Without this
#: guard `a / (1 - m)` divides rounding noise by ~0 and can make a pure sink head
#: look perfectly focused, which is exactly the masquerade isolation removes.
SINK_EPS = 1e-6


def sink_mass(profiles: torch.Tensor, n_sink: int) -> torch.Tensor:
    """`m_h = sum_{t < n_sink} a_h(t)`: `[L, H, n]` -> `[L, H]` (float32)."""
    n_sink = min(n_sink, profiles.shape[-1])
    return profiles[..., :n_sink].float().sum(-1)


def sink_heads(profiles: torch.Tensor, n_sink: int, threshold: float = 0.5) -> torch.Tensor:
    """Bool `[L, H]`: heads with sink mass `>= threshold`."""
    return sink_mass(profiles, n_sink) >= threshold


def isolate_sinks(profiles: torch.Tensor, n_sink: int) -> torch.Tensor:
    """Sink-isolated profile `a~_h(t) = a_h(t) / (1 - m_h)` for `t >= n_sink`, 0 on sinks.

    The divisor is the measured non-sink mass `sum_{t >= n_sink} a_h(t)` (equal to
    `1 - m_h` in exact arithmetic, and free of cancellation when `m_h` is near 1).
    Heads whose non-sink mass is below `SINK_EPS` get the uniform non-sink profile
    (see `SINK_EPS`). With `n <= n_sink` there is nothing to isolate: the profile is
    returned unchanged.

    `[L, H, n]` -> `[L, H, n]` float32; rows sum to 1.
    """
    n = profiles.shape[-1]
    if n_sink <= 0 or n <= n_sink:
        return profiles.float()
    p = profiles.float()
    rest = p[..., n_sink:]  # [L, H, n - n_sink]
    rest_mass = rest.sum(-1, keepdim=True)  # [L, H, 1]
    degenerate = rest_mass < SINK_EPS
    uniform = torch.full_like(rest, 1.0 / (n - n_sink))
    iso_rest = torch.where(degenerate, uniform, rest / rest_mass.clamp_min(SINK_EPS))
    return torch.cat([torch.zeros_like(p[..., :n_sink]), iso_rest], dim=-1)


def collision_mass(profiles: torch.Tensor) -> torch.Tensor:
    """`sum_t a_h(t)^2`, the collision probability: `[L, H, n]` -> `[L, H]` float32."""
    p = profiles.float()
    return (p * p).sum(-1)


def collision_entropy(profiles: torch.Tensor) -> torch.Tensor:
    """Renyi-2 entropy `H2(h) = -log sum_t a_h(t)^2`: `[L, H, n]` -> `[L, H]`.

    In `[0, log n]` for a distribution: 0 for a one-hot head, `log n` for a uniform one.
    The collision mass of a distribution is `>= 1/n > 0`, so the log is finite.
    """
    return -torch.log(collision_mass(profiles))


def head_weights_from_entropy(entropy: torch.Tensor, n_groups: int, tau: float) -> torch.Tensor:
    """`w_h = softmax_{h in g}(-H2(h) / tau)` within each group: `[L, H]` -> `[L, H]`.

    Heads `g*r .. g*r + r - 1` form group `g`. With `tau = 1` the weights are
    proportional to the collision masses `||a_h||^2`. `torch.softmax` subtracts
    the group max first, so sharp temperatures cannot overflow.
    """
    L, H = entropy.shape
    if n_groups <= 0 or H % n_groups != 0:
        raise ValueError(f"H={H} heads cannot be split into n_groups={n_groups} groups")
    r = H // n_groups
    logits = (-entropy.float() / tau).view(L, n_groups, r)
    return torch.softmax(logits, dim=-1).view(L, H)


def isolated_collision_mass(profiles: torch.Tensor, n_sink: int) -> torch.Tensor:
    """`sum_t a~_h(t)^2` without forming `a~`: `[L, H, n]` -> `[L, H]` float32.

    Equals `collision_mass(isolate_sinks(profiles, n_sink))`: the non-sink squares
    divided by the squared non-sink mass, and `1 / (n - n_sink)` (the uniform
    profile's value) for the degenerate heads of `SINK_EPS`.
    """
    n = profiles.shape[-1]
    if n_sink <= 0 or n <= n_sink:
        return collision_mass(profiles)
    rest = profiles[..., n_sink:].float()
    rest_mass = rest.sum(-1)
    sq = (rest * rest).sum(-1)
    iso = sq / rest_mass.clamp_min(SINK_EPS).square()
    return torch.where(rest_mass < SINK_EPS, torch.full_like(iso, 1.0 / (n - n_sink)), iso)


def entropy_head_weights(
    profiles: torch.Tensor, n_groups: int, n_sink: int, tau: float = 1.0, isolate: bool = True
) -> torch.Tensor:
    """Page-EntroKV's head weights `[L, H]` (sink-isolated unless `isolate=False`)."""
    mass = isolated_collision_mass(profiles, n_sink) if isolate else collision_mass(profiles)
    return head_weights_from_entropy(-torch.log(mass), n_groups, tau)
