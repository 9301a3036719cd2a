"""`streaming` (StreamingLLM): the sinks plus the most recent pages that fit.

Recency is the score: page `j` scores `j`, so later pages rank higher and the
protected sink pages come first anyway. The attention profiles are not read.
"""

import torch

from pagekv.maths.policies.base import Policy, ScoreInputs


def _recency(x: ScoreInputs) -> torch.Tensor:
    L, _, n = x.shape
    n_pages = -(-n // x.config.page_size)
    rank = torch.arange(n_pages, device=x.scores.device, dtype=torch.float32)
    return rank.expand(L, x.n_groups, n_pages).clone()  # [L, G, n_pages]


POLICY = Policy(
    name="streaming",
    order=5,
    summary="StreamingLLM: sinks plus the most recent pages",
    page_scores=_recency,
    uses_attention=False,
)
