"""The replication harness: the paper's claims measured on a real model (tables T1-T7).

    from experiments.replay import run_replay
    run_replay(model="bundled", out="runs/replay", quick=True)

See `harness` (orchestration, resumable units), `grid` (what is measured), `measure`
(per-prompt measurements), `tables` (aggregation), `report` (files) and `peer` (kvpress).
"""

from experiments.replay.grid import FULL, GRIDS, QUICK, Grid
from experiments.replay.harness import run_replay

__all__ = ["FULL", "GRIDS", "QUICK", "Grid", "run_replay"]
