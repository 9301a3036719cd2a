"""Per-prompt measurements: functions from a prefilled prompt to JSON-ready dicts.

`profile_unit` (T1, T2, T3 and the cache-level sweeps of T4 / T7) needs the attention
profiles and plans, and the runner's compacted caches for the pooled policies' UOR (no
decode). `cardinality_unit` (T5) compacts real caches with the runner. `decode_unit`
(T4, T6, T7) evicts and decodes one configuration.
"""

from __future__ import annotations

import itertools

import torch

from experiments.replay.grid import (
    T7_CACHE_BUDGETS,
    T7_CACHE_PAGES,
    T7_CACHE_TAUS,
    T7_CACHE_WINDOWS,
    Grid,
)
from pagekv.maths.config import EvictionConfig
from pagekv.maths.metrics import sink_advantage
from pagekv.maths.paging import BudgetError, physical_tokens
from pagekv.maths.plan import plan
from pagekv.maths.policies import EVICTING_POOLED

#: What T1 checks beside head-independent selection, the cache-level needle sweep runs
#: and T5 counts: every pooled policy that evicts.
POOLED_CHECKED = CACHE_POLICIES = CARDINALITY_POLICIES = EVICTING_POOLED
ROUND = 6
#: The page of the paged cache whose memory `physical_tokens` counts (ours and the peer's).
PHYSICAL_PAGE = 16


def _r(x: torch.Tensor) -> list:
    return [round(float(v), ROUND) for v in x.flatten().tolist()]


def stored_pooled_uor(runner, pre, ev) -> dict:
    """The UOR of a pooled policy, measured on the decode cache the runner builds.

    Every head of group g reads the same stored keys, so the union of what the group's
    heads keep is what the cache stores for (layer, group): its length in the paged
    pool (`Runner.decode_cache`). Per (layer, group), `UOR = stored / k'`, with `k'` the
    tokens the plan keeps for that group; an eviction that stored more (padding, a
    duplicate) or fewer tokens than planned moves it off 1. `stored_eq_plan` also checks
    that the stored rows are the plan's tokens: the stored indices are the plan's kept
    set, in order, and the keys and values equal the prefill's at those tokens.

    Args:
        runner: the `Runner` that evicted.
        pre: the `Prefill` the cache was gathered from.
        ev: `Runner.evict(pre, cfg)` for a pooled, budgeted policy.
    """
    p = ev.plan
    want = p.kept_indices()  # [L, G, k'] the plan's kept tokens
    L, G = p.union_tokens.shape
    cache = runner.decode_cache([ev], pre, 0)
    stored = torch.tensor([row[0] for row in (cache.host_lengths(i) for i in range(L))])
    same = True
    for i, full in enumerate(pre.cache.layers):
        idx = ev.kept_indices[i]  # [G, s']
        if not torch.equal(idx.cpu(), want[i].cpu()):
            same = False
            continue
        for g in range(G):
            keys, values = cache.read(i, 0, g)  # [s, d]
            rows = idx[g].to(keys.device)
            same &= keys.shape[0] == rows.shape[0] and torch.equal(keys, full.keys[0, g, rows])
            same &= keys.shape[0] == rows.shape[0] and torch.equal(values, full.values[0, g, rows])
    uor = stored.to(torch.float64) / p.union_tokens.cpu().to(torch.float64)
    return {"uor": uor, "stored": stored, "stored_eq_plan": bool(same)}


def overlap_measurements(runner, pre, cfg: EvictionConfig) -> dict:
    """T1 / T2 for one prompt (`pre`, a `Prefill`), one geometry and one budget.

    Head-independent selection: every (layer, group) is one measurement of UOR, the
    mean disagreement `D_g` and the two bounds. The r = 2 identity is checked on every
    pair of heads of a group: `|S_a | S_b| / k' == 1 + D_ab`.

    Pooled policies: `runner` compacts a real cache for each, and their UOR is measured
    on it (`stored_pooled_uor`): tokens stored per (layer, group) over the tokens the
    plan keeps. (The plan alone would give 1 by construction: a pooled group keeps one
    set, shared by its heads.)
    """
    profiles, n_groups = pre.profiles(cfg.window), pre.n_groups
    try:
        p = plan(profiles, n_groups, cfg.replace(policy="head_independent"))
    except BudgetError as e:
        return {"feasible": False, "min_budget": e.min_budget}
    ov = p.overlap
    L, H, n = p.head_keep.shape
    r = H // n_groups
    k = ov.per_head_tokens
    hk = p.head_keep.view(L, n_groups, r, n)
    pair_err = 0.0
    for a, b in itertools.combinations(range(r), 2):
        pair_union = (hk[:, :, a] | hk[:, :, b]).sum(-1).to(torch.float64) / k
        err = (pair_union - (1.0 + ov.disagreement[:, :, a, b])).abs().max()
        pair_err = max(pair_err, float(err))
    eps = 1e-12
    pooled = {}
    for pol in POOLED_CHECKED:
        ev = runner.evict(pre, cfg.replace(policy=pol))
        m = stored_pooled_uor(runner, pre, ev)
        stored = m["stored"]  # [L, G] tokens the decode cache holds
        pooled[pol] = {
            "uor_max": float(m["uor"].max()),
            "uor_min": float(m["uor"].min()),
            "stored_eq_plan": m["stored_eq_plan"],
            "dense": bool((stored == stored.flatten()[0]).all()),
            "kept": int(stored.max()),
            "within_budget": bool((stored <= ev.plan.budget_tokens).all()),
        }
        del ev
    return {
        "feasible": True,
        "n": n,
        "k": p.budget_tokens,
        "per_head_tokens": k,
        "uor": _r(ov.uor),
        "dmean": _r(ov.mean_disagreement),
        "lower": _r(ov.lower),
        "upper": _r(ov.upper),
        "pair_identity_max_err": pair_err,
        "lower_violations": int((ov.uor < ov.lower - eps).sum()),
        "upper_violations": int((ov.uor > ov.upper + eps).sum()),
        "lower_slack_min": float((ov.uor - ov.lower).min()),
        "upper_slack_min": float((ov.upper - ov.uor).min()),
        "pooled": pooled,
    }


def sink_measurements(profiles: torch.Tensor, n_groups: int, cfg: EvictionConfig) -> dict:
    """T3: sink heads per layer and the sink advantage with and without isolation."""
    p = plan(profiles, n_groups, cfg.replace(policy="mean", budget=1.0))
    adv_iso = sink_advantage(p.weights_isolated, p.sink_heads, n_groups)  # [L, G]
    adv_raw = sink_advantage(p.weights_nosink, p.sink_heads, n_groups)
    return {
        "sink_heads_per_layer": p.sink_heads.sum(-1).tolist(),
        "n_heads": int(p.sink_heads.shape[1]),
        "sink_mass_mean_per_layer": _r(p.sink_mass.mean(-1)),
        "adv_isolated": [[_nan(v) for v in row] for row in adv_iso.tolist()],
        "adv_raw": [[_nan(v) for v in row] for row in adv_raw.tolist()],
    }


def _nan(v: float):
    return None if v != v else round(v, ROUND)


def cache_sweep(prefill, needle_positions, base: EvictionConfig) -> list[dict]:
    """Needle retention of every policy over the T7 cache-level grid (plans only)."""
    rows = []
    settings = [
        (b, P, w, 1.0)
        for b, P, w in itertools.product(T7_CACHE_BUDGETS, T7_CACHE_PAGES, T7_CACHE_WINDOWS)
    ]
    settings += [(b, 16, 32, t) for b in T7_CACHE_BUDGETS for t in T7_CACHE_TAUS if t != 1.0]
    for b, P, w, tau in settings:
        profiles = prefill.profiles(w)
        for pol in CACHE_POLICIES:
            if pol == "streaming" and tau != 1.0:
                continue  # recency does not depend on tau
            cfg = base.replace(policy=pol, budget=b, page_size=P, window=w, tau=tau)
            row = {"budget": b, "page_size": P, "window": w, "tau": tau, "policy": pol}
            try:
                p = plan(profiles, prefill.n_groups, cfg)
            except BudgetError as e:
                rows.append(row | {"feasible": False, "min_budget": e.min_budget})
                continue
            ret = p.needle_retention(needle_positions)  # [L, G]
            rows.append(
                row
                | {
                    "feasible": True,
                    "retention_mean": round(float(ret.mean()), ROUND),
                    "kept_all": bool((ret == 1).all()),
                    "groups_kept_all": round(float((ret == 1).to(torch.float64).mean()), ROUND),
                }
            )
    return rows


def profile_unit(runner, prep, grid: Grid) -> dict:
    """Everything a prompt gives without decoding (T1, T2, T3, cache-level T4 / T7)."""
    pre = prep.prefill
    G = pre.n_groups
    base = EvictionConfig()
    t1 = {}
    for (label, P, w), b in itertools.product(grid.geometries, grid.t1_budgets):
        cfg = base.replace(budget=b, page_size=P, window=w)
        t1[f"{label}|{b}"] = overlap_measurements(runner, pre, cfg)
    out = {
        "n": pre.n,
        "n_layers": pre.n_layers,
        "n_heads": pre.n_heads,
        "n_groups": G,
        "prefill_s": float(pre.timings.get("prefill_s", 0.0)),
        "t1": t1,
        "t3": sink_measurements(pre.profiles(base.window), G, base),
    }
    if prep.needle_positions:
        out["sweep"] = cache_sweep(pre, prep.needle_positions, base)
    return out


def cardinality_unit(runner, prep, grid: Grid):
    """T5: stored tokens of the compacted caches against the plan, for every page size.

    Three counts must agree per (layer, group): the tokens the compacted cache stores
    (the tensors' length), the plan's `union_tokens`, and the sum of the kept pages'
    sizes computed here from the page indices alone (`min((j+1)P, n) - jP`).
    """
    pre = prep.prefill
    n = pre.n
    rows = []
    for P, b, pol in itertools.product(grid.t5_page_sizes, grid.t5_budgets, CARDINALITY_POLICIES):
        cfg = EvictionConfig(policy=pol, budget=b, page_size=P)
        row = {"page_size": P, "budget": b, "policy": pol, "n": n}
        try:
            ev = runner.evict(pre, cfg)
        except BudgetError as e:
            rows.append(row | {"feasible": False, "min_budget": e.min_budget})
            continue
        p = ev.plan
        stored = torch.tensor(ev.stored_tokens)  # [L, G]
        j = torch.arange(p.n_pages)
        sizes = torch.clamp((j + 1) * P, max=n) - j * P  # [n_pages]
        page_sum = (p.page_keep.to(torch.int64) * sizes).sum(-1)  # [L, G]
        stored_eq = bool((stored == p.union_tokens).all())
        pages_eq = bool((p.union_tokens == page_sum).all())
        mask_eq = bool((p.keep.sum(-1) == p.union_tokens).all())
        rows.append(
            row
            | {
                "feasible": True,
                "k": p.budget_tokens,
                "kept": int(p.union_tokens.max()),
                "stored_eq_plan": stored_eq,
                "plan_eq_page_sum": pages_eq,
                "mask_eq_plan": mask_eq,
                "within_budget": bool((p.union_tokens <= p.budget_tokens).all()),
                "dense": p.dense,
                "n_pages": p.n_pages,
                "last_page_partial": int(sizes[-1]) != P,
                "exact": stored_eq and pages_eq and mask_eq,
            }
        )
        del ev
    return {"rows": rows}


def decode_unit(study, prep, cfg: EvictionConfig, max_new_tokens: int) -> dict:
    """Evict under `cfg`, decode greedily and score; BudgetError -> an infeasible record."""
    try:
        rec = study.run(prep, cfg, max_new_tokens=max_new_tokens)
    except BudgetError as e:
        return {"feasible": False, "min_budget": e.min_budget}
    ret = rec.needle_retention
    vals = [v for row in ret for v in row] if ret else []
    return {
        "feasible": True,
        "answer": rec.answer,
        "correct": rec.correct,
        "hedged": rec.score["hedged"],
        "expected": rec.expected,
        "n": rec.context_tokens,
        "prompt_tokens": rec.prompt_tokens,
        "k": rec.budget_tokens,
        "kept": rec.kept_tokens[0],
        # Over every (layer, group): what the compacted caches store (a global plan's
        # layers padded to their longest group) and the tokens of the kept pages.
        "stored_tokens": sum(map(sum, rec.stored_tokens)),
        "page_tokens": sum(map(sum, rec.union_tokens)),
        # What a paged cache of PHYSICAL_PAGE-token pages holds for the kept tokens.
        "physical_tokens": physical_tokens(rec.plan.keep, PHYSICAL_PAGE),
        "needle_retention": round(sum(vals) / len(vals), ROUND) if vals else None,
        "needle_kept_all": rec.needle_kept_all,
        "first_token_from_full_prefill": rec.first_token_from_full_prefill,
        "decode_s": rec.timings["decode_s"],
        "n_tokens": len(rec.tokens),
    }
