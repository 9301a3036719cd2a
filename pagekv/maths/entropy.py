"""Sink mass, sink-isolated collision entropy and head weights (docs/design.md, "The data path").

All functions take profiles `[L, H, n]` (rows sum to 1) and are batched over
layers and heads; none loops over tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    p = profiles.float()
    n = p.shape[-1]
    if n_sink <= 0 or n <= n_sink:
        return p
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


#: Columns of the per-head sums the scoring kernel returns (`[L, H, 4]`), in order:
#: sink mass, non-sink mass, non-sink squares, all squares.
MASS_SUMS = ("sink", "rest", "sq_rest", "sq_all")


@dataclass(frozen=True)
class HeadMasses:
    """Per-head masses of one set of profiles: what the head weights are made of.

    Shapes `[L, H]`, float32. `n_sink` is the sink count they were taken with.
    Built from profiles (`from_profiles`, the torch path) or from the scoring
    kernel's partial sums (`from_sums`, the Triton path); the conversion to
    isolated collision masses, with its `SINK_EPS` guard, is written once, in
    `isolated_mass_from_sums`.
    """

    sink: torch.Tensor  # m_h = sum_{t < n_sink} a_h(t)
    isolated: torch.Tensor  # sum_t a~_h(t)^2 (sink-isolated collision mass)
    collision: torch.Tensor  # sum_t a_h(t)^2
    n_sink: int

    @classmethod
    def from_sums(cls, sums: torch.Tensor, n: int, n_sink: int) -> HeadMasses:
        """From `[L, H, 4]` sums in the order of `MASS_SUMS` (prompt of `n` tokens)."""
        sink, rest, sq_rest, sq_all = sums.float().unbind(-1)
        return cls(sink, isolated_mass_from_sums(rest, sq_rest, sq_all, n, n_sink), sq_all, n_sink)

    @classmethod
    def from_profiles(cls, profiles: torch.Tensor, n_sink: int) -> HeadMasses:
        """From profiles `[L, H, n]`: the sums of `MASS_SUMS`, then `from_sums`."""
        return cls.from_sums(mass_sums(profiles, n_sink), profiles.shape[-1], n_sink)


def mass_sums(profiles: torch.Tensor, n_sink: int) -> torch.Tensor:
    """`[L, H, n]` -> `[L, H, 4]` float32: the per-head sums of `MASS_SUMS` (the torch
    twin of what the scoring kernel accumulates tile by tile)."""
    p = profiles.float()
    s = min(max(n_sink, 0), p.shape[-1])
    rest = p[..., s:]
    sink = p[..., :s].sum(-1)
    return torch.stack([sink, rest.sum(-1), (rest * rest).sum(-1), (p * p).sum(-1)], dim=-1)


def isolated_mass_from_sums(
    rest: torch.Tensor, sq_rest: torch.Tensor, sq_all: torch.Tensor, n: int, n_sink: int
) -> torch.Tensor:
    """`sum_t a~_h(t)^2` from the non-sink mass and squares: `sq_rest / rest^2`, with
    `isolate_sinks`' measured divisor and guard (a head below `SINK_EPS` gets
    `1 / (n - n_sink)`, the uniform non-sink profile's value); with `n_sink <= 0` or
    `n <= n_sink` there is nothing to isolate and this is the plain collision mass `sq_all`.
    """
    if n_sink <= 0 or n <= n_sink:
        return sq_all.float()
    iso = sq_rest.float() / rest.float().clamp_min(SINK_EPS).square()
    return torch.where(rest < SINK_EPS, torch.full_like(iso, 1.0 / (n - n_sink)), iso)


def isolated_collision_mass(profiles: torch.Tensor, n_sink: int) -> torch.Tensor:
    """`sum_t a~_h(t)^2` without forming `a~`: `[L, H, n]` -> `[L, H]` float32.

    Equals `collision_mass(isolate_sinks(profiles, n_sink))` (tests/test_entropy.py
    checks it against that plain reference).
    """
    return HeadMasses.from_profiles(profiles, n_sink).isolated


def row_focus_sums(
    probs: torch.Tensor, n_ctx: int, max_sink: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """How focused each attention row is on the first `n_ctx` keys, for every sink count.

    `probs` `[..., R, N]` are `R` attention rows (each a softmax over its `N` keys). Row
    `i` restricted to the keys `t < n_ctx` and renormalised there is `b_i`; for a sink
    count `s` its sink-isolated collision mass is `sum_{s <= t < n_ctx} b~_i(t)^2` with
    `b~_i` the row renormalised over `s <= t < n_ctx` (`isolate_sinks` of one row), and
    its sink share is `sum_{t < s} b_i(t)`. Returns both summed over the `R` rows, for
    every `s = 0 .. max_sink`: `(masses [..., max_sink + 1], sinks [..., max_sink + 1])`
    float32. Divide by the row count for the means the reconstruction scorer's head
    weights use (`pagekv.runtime.reconstruct`).

    As `isolated_mass_from_sums`: the non-sink mass is summed directly (never `1 -`
    the sink share, so no cancellation); a row whose non-sink mass is below `SINK_EPS`
    of its context mass gets the uniform value `1 / (n_ctx - s)`; and `s >= n_ctx`
    (nothing left to isolate) gives the plain collision mass, column 0.

    The rows are read, never written: the squares of the long part of each row are
    summed as its squared 2-norm (`vector_norm`), one read and no tensor of their size.
    """
    if isinstance(max_sink, bool) or not isinstance(max_sink, int) or max_sink < 0:
        raise ValueError(f"max_sink must be an integer >= 0; got {max_sink!r}")
    if not 1 <= n_ctx <= probs.shape[-1]:
        raise ValueError(f"n_ctx must be in 1..{probs.shape[-1]} (the keys); got {n_ctx}")
    p = probs[..., :n_ctx].float()
    s = min(max_sink, n_ctx)
    head, tail = p[..., :s], p[..., s:]
    tail_sum = tail.sum(-1, keepdim=True)
    tail_sq = torch.linalg.vector_norm(tail, dim=-1, keepdim=True).square()
    # rest(j) = sum_{j <= t < n_ctx} p(t), j = 0..s, as suffix sums (all additions).
    rest = torch.cat([head.flip(-1).cumsum(-1).flip(-1) + tail_sum, tail_sum], dim=-1)
    sq = torch.cat([(head * head).flip(-1).cumsum(-1).flip(-1) + tail_sq, tail_sq], dim=-1)
    total = rest[..., :1]  # the row's context mass
    left = n_ctx - torch.arange(s + 1, device=p.device)  # tokens after the sinks
    degenerate = rest < SINK_EPS * total
    tiny = torch.finfo(p.dtype).tiny
    mass = torch.where(
        degenerate,
        1.0 / left.clamp_min(1).to(p.dtype),
        sq / rest.clamp_min(tiny).square(),
    )
    mass = torch.where(left == 0, mass[..., :1], mass)  # s >= n_ctx: the plain mass
    sink = torch.cat([torch.zeros_like(total), head.cumsum(-1)], dim=-1) / total.clamp_min(tiny)
    if s < max_sink:  # fewer keys than sink counts: the rest as s >= n_ctx
        pad = max_sink - s
        mass = torch.cat([mass, mass[..., :1].expand(*mass.shape[:-1], pad)], dim=-1)
        sink = torch.cat([sink, sink[..., -1:].expand(*sink.shape[:-1], pad)], dim=-1)
    return mass.sum(-2), sink.sum(-2)


def weights_from_mass(mass: torch.Tensor, n_groups: int, tau: float) -> torch.Tensor:
    """Head weights `[L, H]` from collision masses `[L, H]`: `H2 = -log(mass)`, then
    `head_weights_from_entropy`. The one place masses become weights."""
    return head_weights_from_entropy(-torch.log(mass.float()), n_groups, tau)


def entropy_head_weights(
    profiles: torch.Tensor, n_groups: int, n_sink: int, tau: float = 1.0, isolate: bool = True
) -> torch.Tensor:
    """Page-EntroKV's head weights `[L, H]` (sink-isolated unless `isolate=False`)."""
    mass = isolated_collision_mass(profiles, n_sink) if isolate else collision_mass(profiles)
    return weights_from_mass(mass, n_groups, tau)
