"""One side of a comparison: what it keeps (an `EvictionConfig`) and where its question
sits ("inside" the prompt, or asked "after" compression).

The app, the lessons, the presets, share links and the API all describe a side with
this one type. The page's controls are its values at the page's edge
(`pagekv.app.run_inputs.RunInputs`: a budget in % there, a fraction here).

    >>> a = Side.of("entropy", budget=0.1, mode="after")
    >>> a.config.budget, a.mode
    (0.1, 'after')
    >>> a.replace(policy="mean").config.policy, a.replace(mode="inside").mode
    ('mean', 'inside')
"""

from __future__ import annotations

import dataclasses

from pagekv.maths.config import EvictionConfig

__all__ = ["MODES", "Side"]

#: Where a side's question is: in the prompt, or asked after compression.
MODES = ("inside", "after")


@dataclasses.dataclass(frozen=True)
class Side:
    config: EvictionConfig = EvictionConfig()
    mode: str = "inside"

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be 'inside' or 'after'; got {self.mode!r}")

    @classmethod
    def of(cls, policy: str, mode: str = "inside", **settings) -> Side:
        """The side of policy `policy` with the `EvictionConfig` fields `settings`."""
        return cls(EvictionConfig(policy=policy, **settings), mode)

    def replace(self, mode: str | None = None, **settings) -> Side:
        """A copy with its question position and any `EvictionConfig` fields changed."""
        config = self.config.replace(**settings) if settings else self.config
        return Side(config, self.mode if mode is None else mode)
