"""The work list: one `PromptJob` per prompt, with every unit to compute on its prefill."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from experiments.replay.grid import Grid
from pagekv.engine.study import PromptSpec
from pagekv.maths.config import EvictionConfig


@dataclass
class PromptJob:
    """A prompt and what the replay computes on it (the prefill is shared)."""

    spec: PromptSpec
    tables: set[str] = field(default_factory=set)  # T4 / T6 / T7 roles of the prompt
    decodes: list[tuple[str, EvictionConfig, str]] = field(default_factory=list)  # tag,cfg,label
    cardinality: bool = False
    peer_budgets: tuple[float, ...] = ()

    def spec_dict(self) -> dict:
        return {k: v for k, v in asdict(self.spec).items() if v is not None}


def _decodes(tag: str, policies, budgets, scorings=()):
    """Every policy at every budget, each `Scoring` (entropy pooling) at every budget
    (labelled by it), and the full cache once."""
    out = [(tag, EvictionConfig(policy=p, budget=b), "") for b in budgets for p in policies]
    for sc in scorings:
        cfg = EvictionConfig(policy="entropy", **sc.config_fields())
        out += [(tag, cfg.replace(budget=b), sc.label) for b in budgets]
    if budgets:
        out.append((tag, EvictionConfig(policy="full", budget=1.0), "full"))
    return out


def build_jobs(grid: Grid, curated_names: dict[str, list[str]]) -> list[PromptJob]:
    """Every prompt of the grid, in the order they run (cheap prompts first).

    `curated_names` maps "qa" / "code" to the curated task names (T6).
    """
    jobs: dict[PromptSpec, PromptJob] = {}

    def job(spec: PromptSpec) -> PromptJob:
        return jobs.setdefault(spec, PromptJob(spec))

    for ci, ctx in enumerate(grid.t4_contexts):
        for di, depth in enumerate(grid.t4_depths):
            for s in range(grid.t4_seeds_per_cell):
                seed = 100 * ci + 10 * di + s  # a different needle in every cell
                for mode in grid.t4_modes:
                    j = job(PromptSpec(context=ctx, depth=depth, seed=seed, mode=mode))
                    j.tables.add("T4")
                    budgets = grid.t4_budgets if mode == "after" else grid.t4_inside_budgets
                    j.decodes += _decodes("T4", grid.policies, budgets, scorings=grid.scorings)
                    j.peer_budgets = tuple(budgets)
    t4_jobs = [j for j in jobs.values() if "T4" in j.tables]
    for j in t4_jobs[: grid.t5_prompts]:
        j.cardinality = True

    for kind in ("qa", "code"):
        for name in (curated_names or {}).get(kind, []):
            if grid.t6_tasks is not None and name not in grid.t6_tasks:
                continue
            for mode in grid.t6_modes:
                j = job(PromptSpec(task=kind, curated=name, mode=mode))
                j.tables.add("T6")
                j.decodes += _decodes("T6", grid.policies, grid.t6_budgets, scorings=grid.scorings)
                j.peer_budgets = tuple(grid.t6_budgets)

    for ctx, needles, seed, mode in grid.t7_prompts:
        spec = PromptSpec(context=ctx, depth=0.5, seed=seed, needles=needles, mode=mode)
        j = job(spec)
        j.tables.add("T7")
        for st in grid.t7_settings:
            base = EvictionConfig(**st.config_fields())
            j.decodes += [("T7", base.replace(policy=p), st.label) for p in ("entropy", "mean")]
        j.decodes.append(("T7", EvictionConfig(policy="full", budget=1.0), "full"))

    for j in jobs.values():  # drop duplicate (tag, config, label)s, first kept
        j.decodes = list(dict.fromkeys(j.decodes))
    return list(jobs.values())
