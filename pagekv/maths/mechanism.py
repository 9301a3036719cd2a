"""The constructed group planned under each pooling policy: the mechanism view's data.

    view = mechanism_view(heads=3, retrieval=0.9, distractors=2)
    view.rows          # [policy, "kept" / "evicted", its weights]
    view.w_star        # the retrieval head's entropy weight

The profiles are `pagekv.maths.constructed.mechanism_profiles`: no model is involved.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pagekv.maths.config import EvictionConfig
from pagekv.maths.constructed import Mechanism, mechanism_profiles
from pagekv.maths.plan import plan
from pagekv.maths.policies import POOLING_POLICIES

#: Policies shown in the mechanism view.
MECHANISM_POLICIES = POOLING_POLICIES  # the pooling rules (entropy, ..., max)


@dataclass
class MechanismView:
    mech: Mechanism
    plans: dict  # policy -> Plan
    rows: list  # [policy, "kept"/"evicted", weights text]
    s_star: float  # the retrieval head's score on the needle
    w_star: float  # its entropy weight
    notes: list = field(default_factory=list)  # settings adjusted to a valid group


def mechanism_view(
    heads: int = 3,
    retrieval: float = 0.9,
    distractors: int = 2,
    distractor_strength: float = 0.48,
    sink_head: bool = False,
    n: int = 64,
    budget: float = 0.19,
    page_size: int = 4,
) -> MechanismView:
    """Plans of the constructed group (pagekv.maths.constructed) under each pooling policy.

    Sinks and window are one page each (`n_sink = window = page_size`). Every
    combination of the app's sliders gives a valid group: distractor heads beyond what
    the group holds (`heads - 1 - sink head`) are dropped, and a budget below what the
    protected pages need (plus one page to choose) is raised; `notes` says so.
    """
    notes = []
    room = heads - 1 - int(bool(sink_head))
    if room < 0:
        raise ValueError(f"a group of {heads} heads cannot hold a retrieval and a sink head")
    if distractors > room:
        notes.append(
            f"{distractors} distractor heads do not fit in {heads} heads beside the retrieval"
            + (" and sink" if sink_head else "")
            + f" head: using {room}."
        )
        distractors = room
    needed = 3 * page_size  # the sink page, the window page and one page to choose
    if math.floor(budget * n + 1e-9) < needed:
        raised = needed / n
        notes.append(
            f"a budget of {100 * budget:g}% of {n} tokens cannot hold the sink and window pages "
            f"and one more page: using {100 * raised:.1f}%."
        )
        budget = raised
    mech = mechanism_profiles(
        n=n,
        heads=heads,
        retrieval_strength=retrieval,
        distractor_heads=distractors,
        distractor_strength=distractor_strength,
        sink_head=sink_head,
    )
    base = EvictionConfig(budget=budget, page_size=page_size, n_sink=page_size, window=page_size)
    plans = {pol: plan(mech.profiles, 1, base.replace(policy=pol)) for pol in MECHANISM_POLICIES}
    needle_page = mech.needle_token // page_size
    rows = []
    for pol, p in plans.items():
        heads = zip(mech.roles, p.head_weights[0].tolist(), strict=True)
        weights = ", ".join(f"{role} {x:.2f}" for role, x in heads)
        kept = "kept" if bool(p.page_keep[0, 0, needle_page]) else "evicted"
        rows.append([pol, kept, "max over heads" if pol == "max" else weights])
    return MechanismView(
        mech=mech,
        plans=plans,
        rows=rows,
        s_star=float(mech.profiles[0, 0, mech.needle_token]),
        w_star=float(plans["entropy"].weights_isolated[0, 0]),
        notes=notes,
    )
