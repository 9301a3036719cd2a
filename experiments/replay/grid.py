"""What the replay measures: the prompts, budgets and configurations of each table.

Two grids: `QUICK` (a smoke run of a few minutes, used by the test) and `FULL`
(the replication on the bundled model). Everything is deterministic: prompts are
fixed by their seeds and decoding is greedy.

Geometry. The protected pages (sinks + observation window) count inside the budget,
so a 2 % budget on a short prompt is infeasible with the default geometry (page 16,
window 32). T1 therefore measures three geometries side by side and reports the
cells where a prompt is infeasible instead of silently dropping it:
`P16-w32` (the default), `P4-w8` and `P1-w8` (token-level).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from pagekv.maths.policies import EVICTING_POOLED, POOLING_POLICIES

#: (label, page_size, window) for the profile-only tables T1 / T2.
GEOMETRIES = (("P16-w32", 16, 32), ("P4-w8", 4, 8), ("P1-w8", 1, 8))
T1_BUDGETS = (0.02, 0.05, 0.10, 0.20, 0.50)
#: The decoded policies of T4 / T6 (plus `full`, which has no budget).
POLICIES = EVICTING_POOLED  # every pooled policy that evicts (pagekv.maths.policies)
PAGE_SIZES_T5 = (1, 2, 4, 8, 16, 32, 64)


class _Labelled:
    def config_fields(self) -> dict:
        """The `EvictionConfig` fields: every field but the label."""
        return {k: v for k, v in asdict(self).items() if k != "label"}


@dataclass(frozen=True)
class Setting(_Labelled):
    """One T7 eviction setting (entropy and mean are decoded under it)."""

    label: str
    budget: float
    page_size: int = 16
    window: int = 32
    tau: float = 1.0


#: T7, one factor at a time around the base (10 %, page 16, window 32, tau 1).
T7_SETTINGS = (
    Setting("base b10 P16 w32", 0.10),
    Setting("budget 2% (P4 w8)", 0.02, page_size=4, window=8),
    Setting("budget 5% (P8 w16)", 0.05, page_size=8, window=16),
    Setting("budget 20%", 0.20),
    Setting("page 1 (b10)", 0.10, page_size=1),
    Setting("page 4 (b10)", 0.10, page_size=4),
    Setting("page 64 (b20)", 0.20, page_size=64),
    Setting("tau 0.25", 0.10, tau=0.25),
    Setting("tau 4", 0.10, tau=4.0),
)


@dataclass(frozen=True)
class Scoring(_Labelled):
    """A question-agnostic setting (issue 19) decoded in T4 and T6 beside the window
    scorer, with entropy pooling at every budget of the table and both question modes:
    the reconstruction scorer, its allocation of the budget and its observation window
    (`EvictionConfig.scorer`, `allocation`, `window`; pages of 16, n_sink 4, tau 1)."""

    label: str
    scorer: str = "reconstruct"
    allocation: str = "global"
    window: int = 8


#: The settings `experiments/reconstruct_ab.py` chose (docs/research.md): the
#: reconstruction's max over queries, the budget shared by pooled page scores, window 8.
AGNOSTIC = (Scoring("reconstruct, global, w8"),)


#: T7 cache-level sweep (plans only, no decode): every combination below.
T7_CACHE_BUDGETS = (0.02, 0.05, 0.10, 0.20, 0.50)
T7_CACHE_PAGES = (1, 4, 16, 64)
T7_CACHE_WINDOWS = (8, 32)
T7_CACHE_TAUS = (0.25, 1.0, 4.0)


@dataclass(frozen=True)
class Grid:
    """The sizes of one replay run (see `QUICK` and `FULL`)."""

    name: str
    # T4: single needles, context x depth; the seed varies per cell (several needles).
    t4_contexts: tuple[int, ...]
    t4_depths: tuple[float, ...]
    t4_seeds_per_cell: int
    t4_budgets: tuple[float, ...]
    t4_modes: tuple[str, ...]
    t4_inside_budgets: tuple[float, ...]  # decoded budgets in "inside" mode
    # T6: curated tasks (None = all of them).
    t6_tasks: tuple[str, ...] | None
    t6_modes: tuple[str, ...]
    t6_budgets: tuple[float, ...] = (0.2,)
    # T7: (context, needles, seed, mode) prompts and the decoded settings.
    t7_prompts: tuple[tuple[int, int, int, str], ...] = ()
    t7_settings: tuple[Setting, ...] = T7_SETTINGS
    # T5: page sizes and budgets, on the first prompts of T4.
    t5_prompts: int = 2
    t5_budgets: tuple[float, ...] = (0.2, 0.5)
    t5_page_sizes: tuple[int, ...] = PAGE_SIZES_T5
    t1_budgets: tuple[float, ...] = T1_BUDGETS
    geometries: tuple[tuple[str, int, int], ...] = GEOMETRIES
    policies: tuple[str, ...] = POLICIES
    max_new_tokens: int = 24
    peer_tables: tuple[str, ...] = ("T4", "T6")  # which tables' prompts kvpress also runs
    peer_presses: tuple[str, ...] | None = None  # which presses (None: every one it has)
    scorings: tuple[Scoring, ...] = ()  # question-agnostic settings decoded in T4 / T6
    tables: tuple[str, ...] = field(default=("T1", "T2", "T3", "T4", "T5", "T6", "T7"))


QUICK = Grid(
    name="quick",
    t4_contexts=(500,),
    t4_depths=(0.25, 0.75),
    t4_seeds_per_cell=1,
    t4_budgets=(0.2, 0.5),
    t4_modes=("after",),
    t4_inside_budgets=(),
    t6_tasks=(),
    t6_modes=(),
    t7_prompts=((500, 2, 0, "after"),),
    t7_settings=(T7_SETTINGS[3],),
    scorings=AGNOSTIC,
    t5_prompts=1,
    t5_budgets=(0.5,),
    t1_budgets=(0.05, 0.2, 0.5),
    policies=("entropy", "mean"),
    max_new_tokens=20,
    tables=("T1", "T2", "T3", "T4", "T5", "T7"),
)

FULL = Grid(
    name="full",
    t4_contexts=(500, 1000, 2000),
    t4_depths=(0.1, 0.5, 0.9, 0.3, 0.7),  # this order keeps the seeds of SHARED_CPU
    t4_seeds_per_cell=1,
    t4_budgets=(0.1, 0.2),
    t4_modes=("after", "inside"),
    t4_inside_budgets=(0.2,),
    t6_tasks=None,
    t6_modes=("after", "inside"),
    t7_prompts=(
        (2000, 2, 11, "after"),
        (2000, 3, 12, "after"),
        (2000, 4, 13, "after"),
        (4000, 2, 14, "after"),
        (4000, 4, 15, "after"),
        (7800, 3, 16, "after"),
        (2000, 3, 12, "inside"),
        (4000, 4, 15, "inside"),
    ),
)

#: What fits in about 30 minutes on 2 CPU cores shared with other jobs (decoding runs
#: at ~0.5 s per token there, 5x slower than idle): the grid the committed results used.
#: Its units are a subset of FULL's (same keys), so a later FULL run reuses them.
SHARED_CPU = Grid(
    name="shared-cpu",
    t4_contexts=(500, 1000),
    t4_depths=(0.1, 0.5, 0.9),
    t4_seeds_per_cell=1,
    t4_budgets=(0.2,),
    t4_modes=("after", "inside"),
    t4_inside_budgets=(0.2,),
    t6_tasks=(
        "qa_brennholt_founding",
        "qa_larkspur_wifi",
        "code_server_port",
        "code_sample_interval",
    ),
    t6_modes=("after", "inside"),
    t7_prompts=(
        (2000, 2, 11, "after"),
        (2000, 4, 13, "inside"),
        (4000, 3, 14, "after"),
        (7800, 3, 16, "after"),
    ),
    t7_settings=tuple(T7_SETTINGS[i] for i in (0, 1, 4, 6, 7)),
    t5_prompts=2,
    t5_budgets=(0.2, 0.5),
    policies=POOLING_POLICIES,
    peer_tables=("T4",),
)

#: SHARED_CPU plus the rest of T6 (all 14 curated tasks) and T4 at five depths and a
#: 2000-token context: the grid of the committed results (run on top of SHARED_CPU).
EXTENDED = replace(
    SHARED_CPU,
    name="extended",
    t4_contexts=(500, 1000, 2000),
    t4_depths=(0.1, 0.5, 0.9, 0.3, 0.7),  # this order keeps the seeds of SHARED_CPU
    t6_tasks=None,
)

#: Issue 19's comparison: the question asked after (and inside) the prompt, T4's needles
#: at 500, 1000 and 2000 tokens x 5 depths and every curated task (T6), at 10, 20 and
#: 50 %: entropy pooling with the window scorer and with `AGNOSTIC`, against kvpress's
#: KVzip (its default: one budget shared by every layer and head) and KeyDiff, at the
#: same budgets. Its T4 / T6 prompts are FULL's (same keys).
AGNOSTIC_GRID = Grid(
    name="agnostic",
    t4_contexts=(500, 1000, 2000),
    t4_depths=(0.1, 0.5, 0.9, 0.3, 0.7),
    t4_seeds_per_cell=1,
    t4_budgets=(0.1, 0.2, 0.5),
    t4_modes=("after", "inside"),
    t4_inside_budgets=(0.1, 0.2, 0.5),
    t6_tasks=None,
    t6_modes=("after", "inside"),
    t6_budgets=(0.1, 0.2, 0.5),
    t5_prompts=0,
    policies=("entropy",),
    scorings=AGNOSTIC,
    peer_presses=("kvzip", "keydiff"),
    tables=("T4", "T6"),
)

GRIDS = {
    "quick": QUICK,
    "shared-cpu": SHARED_CPU,
    "extended": EXTENDED,
    "full": FULL,
    "agnostic": AGNOSTIC_GRID,
}
