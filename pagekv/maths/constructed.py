"""Constructed attention profiles for one GQA group: the retention bound at work.

Used by the tests and by the app's "mechanism" view. Every head spreads the mass
it does not place deliberately uniformly over the whole prompt, so each profile
is a proper distribution. Roles, in head order:

- head 0, `retrieval`: `retrieval_strength` on the needle token;
- the next `distractor_heads`, `distractor`: `distractor_strength` on each of two
  adjacent tokens of one distractor page (they agree with each other);
- then, if `sink_head`, a `sink` head: `sink_strength` on token 0;
- the rest, `diffuse`: uniform.

These profiles are constructed, not measured: they show the mechanism, never what
a real model does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Mechanism:
    profiles: torch.Tensor  # float32 [1, r, n]
    roles: tuple[str, ...]  # one per head
    needle_token: int
    distractor_tokens: tuple[int, int]


def mechanism_profiles(
    n: int = 64,
    heads: int = 3,
    retrieval_strength: float = 0.9,
    distractor_heads: int = 2,
    distractor_strength: float = 0.48,
    sink_head: bool = False,
    sink_strength: float = 0.95,
    needle_token: int | None = None,
    distractor_token: int | None = None,
) -> Mechanism:
    """One layer, one group of `heads` heads over `n` tokens (see module docstring).

    Defaults place the needle at `n // 2 - 2` and the distractor pair at `5n // 8`.
    """
    if heads < 1 + distractor_heads + int(sink_head):
        raise ValueError(
            f"{heads} heads cannot hold 1 retrieval + {distractor_heads} distractor"
            f"{' + 1 sink' if sink_head else ''} heads"
        )
    if not 0 <= retrieval_strength <= 1 or not 0 <= distractor_strength <= 0.5:
        raise ValueError("retrieval_strength must be in [0, 1], distractor_strength in [0, 0.5]")
    if not 0 <= sink_strength <= 1:
        raise ValueError("sink_strength must be in [0, 1]")
    if n < 8:
        raise ValueError("n must be at least 8")
    needle = n // 2 - 2 if needle_token is None else needle_token
    dist = 5 * n // 8 if distractor_token is None else distractor_token
    if not (0 <= needle < n and 0 <= dist < n - 1):
        raise ValueError("needle and distractor tokens must lie inside the prompt")
    spots = {  # (token, mass) each role places; the rest of a head's mass is uniform
        "retrieval": [(needle, retrieval_strength)],
        "distractor": [(dist, distractor_strength), (dist + 1, distractor_strength)],
        "sink": [(0, sink_strength)],
        "diffuse": [],
    }
    roles = ["retrieval", *["distractor"] * distractor_heads, *["sink"] * int(sink_head)]
    roles += ["diffuse"] * (heads - len(roles))
    prof = torch.zeros(heads, n, dtype=torch.float64)
    for h, role in enumerate(roles):
        prof[h] = (1.0 - sum(m for _, m in spots[role])) / n
        for t, m in spots[role]:
            prof[h, t] += m
    return Mechanism(prof.float()[None], tuple(roles), needle, (dist, dist + 1))
