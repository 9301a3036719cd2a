"""From finished units to the tables T1-T7, the headline numbers and the presets.

Pure functions of the cached unit records (lists of dicts), so a fully cached re-run
rebuilds every table without the model. Row dicts become CSV rows and markdown tables.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict

from experiments.replay.grid import Grid
from experiments.replay.measure import PHYSICAL_PAGE
from pagekv.engine.study import PromptSpec
from pagekv.maths.config import EvictionConfig
from pagekv.maths.policies import EVICTING_POOLED

EPS = 1e-9
#: The paper's headline numbers (Qwen2.5-1.5B-Instruct, r = 6; arXiv:2610.03135 abstract).
PAPER = {
    "model": "Qwen2.5-1.5B-Instruct (r = 6)",
    "uor_max_at_2pct": 4.75,
    "group_measurements": 2240,
    "pooled_uor": 1.0,
    "sink_masquerade": 13.0,
    "needle_recall_20pct": {"entropy": 1.0, "mean": 0.0},
    "cardinality": "exact for every page size",
    "qa_code_20pct": "still solvable",
}


# --------------------------------------------------------------------------- helpers


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def quantile(xs, q):
    """The `q`-quantile of `xs`, Nones left out (None if nothing is left)."""
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    i = (len(xs) - 1) * q  # linear interpolation, as numpy's default
    lo, hi = math.floor(i), math.ceil(i)
    return xs[lo] + (xs[hi] - xs[lo]) * (i - lo)


def _corr(xs, ys):
    n = len(xs)
    if n < 2:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else None


def _spec_id(s: dict) -> str:
    if s.get("task") in ("qa", "code"):
        return f"{s['curated']}|{s.get('mode', 'inside')}"
    return (
        f"needle ctx={s.get('context')} d={s.get('depth')} seed={s.get('seed')} "
        f"k={s.get('needles', 1)}|{s.get('mode', 'inside')}"
    )


# --------------------------------------------------------------------------- T1 / T2


def t1_t2(grid: Grid, units: list[dict]):
    t1, t2, scatter = [], [], {}
    for (label, P, w), b in itertools.product(grid.geometries, grid.t1_budgets):
        ms = [m for m in (u["t1"].get(f"{label}|{b}") for u in units) if m is not None]
        feas = [m for m in ms if m["feasible"]]
        infeas = [m for m in ms if not m["feasible"]]
        uors = [x for m in feas for x in m["uor"]]
        dms = [x for m in feas for x in m["dmean"]]
        pooled = [pm for m in feas for pm in m["pooled"].values()]
        t1.append(
            {
                "geometry": label,
                "page_size": P,
                "window": w,
                "budget": b,
                "prompts": len(ms),
                "feasible_prompts": len(feas),
                "infeasible_prompts": len(infeas),
                "smallest_feasible_budget_max": max(
                    (m["min_budget"] for m in infeas), default=None
                ),
                "measurements": len(uors),
                "uor_max": max(uors, default=None),
                "uor_p95": quantile(uors, 0.95),
                "uor_mean": _mean(uors),
                "pooled_uor_min": min((p["uor_min"] for p in pooled), default=None),
                "pooled_uor_max": max((p["uor_max"] for p in pooled), default=None),
                "pooled_dense_and_within_budget": all(
                    p["dense"] and p["within_budget"] and p["stored_eq_plan"] for p in pooled
                ),
            }
        )
        t2.append(
            {
                "geometry": label,
                "budget": b,
                "measurements": len(uors),
                "pair_identity_max_abs_err": max(
                    (m["pair_identity_max_err"] for m in feas), default=None
                ),
                "pairs_checked": 3 * len(uors),
                "lower_bound_violations": sum(m["lower_violations"] for m in feas),
                "upper_bound_violations": sum(m["upper_violations"] for m in feas),
                "lower_slack_min": min((m["lower_slack_min"] for m in feas), default=None),
                "upper_slack_min": min((m["upper_slack_min"] for m in feas), default=None),
                "disagreement_mean": _mean(dms),
                "corr_disagreement_uor": _corr(dms, uors),
            }
        )
        scatter[(label, b)] = (dms, uors)
    return t1, t2, scatter


# --------------------------------------------------------------------------- T3


def t3(units: list[dict]):
    if not units:
        return [], {}, None
    ts = [u["t3"] for u in units]
    per_layer, fig_iso, fig_raw, all_iso, all_raw = [], [], [], [], []
    for layer in range(units[0]["n_layers"]):
        heads = [t["sink_heads_per_layer"][layer] for t in ts]
        iso = [v for t in ts for v in t["adv_isolated"][layer] if v is not None]
        raw = [v for t in ts for v in t["adv_raw"][layer] if v is not None]
        cells = [[] for _ in range(units[0]["n_groups"])]  # (isolated, raw) per group
        for t in ts:
            pairs = zip(t["adv_isolated"][layer], t["adv_raw"][layer], strict=True)
            for g, (vi, vr) in enumerate(pairs):
                if vi is not None:
                    cells[g].append((vi, vr))
        fig_iso.append([_mean([vi for vi, _ in c]) for c in cells])
        fig_raw.append([_mean([vr for _, vr in c]) for c in cells])
        all_iso += iso
        all_raw += raw
        per_layer.append(
            {
                "layer": layer,
                "sink_heads_mean": _mean(heads),
                "sink_heads_min": min(heads),
                "sink_heads_max": max(heads),
                "n_heads": ts[0]["n_heads"],
                "sink_mass_mean": _mean([t["sink_mass_mean_per_layer"][layer] for t in ts]),
                "mixed_groups": len(iso),
                "adv_raw_mean": _mean(raw),
                "adv_raw_max": max(raw, default=None),
                "adv_isolated_mean": _mean(iso),
                "adv_isolated_max": max(iso, default=None),
            }
        )
    summary = {
        "prompts": len(units),
        "mixed_group_measurements": len(all_iso),
        "adv_raw_mean": _mean(all_raw),
        "adv_raw_median": quantile(all_raw, 0.5),
        "adv_raw_max": max(all_raw, default=None),
        "adv_isolated_mean": _mean(all_iso),
        "adv_isolated_median": quantile(all_iso, 0.5),
        "adv_isolated_max": max(all_iso, default=None),
        "sink_heads_total_mean": _mean([sum(t["sink_heads_per_layer"]) for t in ts]),
    }
    return per_layer, summary, (fig_iso, fig_raw)


# --------------------------------------------------------------------------- decode groups


def _group(rows, keys):
    out = defaultdict(list)
    for r in rows:
        out[tuple(r[k] for k in keys)].append(r)
    return out


def _per_group(rows, keys, summarise) -> list[dict]:
    """One row per value of `keys` (sorted): the keys, then `summarise(rows of the group)`."""
    return [
        dict(zip(keys, key, strict=True)) | summarise(recs)
        for key, recs in sorted(_group(rows, keys).items())
    ]


def _recall_row(recs):
    feas = [r for r in recs if r.get("feasible")]
    return {
        "prompts": len(recs),
        "feasible": len(feas),
        "recall": _mean([1.0 if r["correct"] else 0.0 for r in feas]),
        "right": sum(1 for r in feas if r["correct"]),
        # per prompt, over every (layer, group): the compacted caches and the kept pages
        "stored_tokens": _mean([r.get("stored_tokens") for r in feas]),
        "page_tokens": _mean([r.get("page_tokens") for r in feas]),
        "physical_tokens": _mean([r.get("physical_tokens") for r in feas]),
        "needle_retention": _mean([r.get("needle_retention") for r in feas]),
        "needle_kept_all": _mean(
            [1.0 if r.get("needle_kept_all") else 0.0 for r in feas if "needle_kept_all" in r]
        ),
    }


def _flat_decodes(decode_units, table):
    rows = []
    for u in decode_units:
        if u["table"] != table:
            continue
        s, c = u["spec"], u["config"]
        rows.append(
            u
            | {
                "mode": s.get("mode", "inside"),
                "context": s.get("context"),
                "depth": s.get("depth"),
                "policy": c["policy"],
                "budget": c["budget"] if c["policy"] != "full" else 1.0,
                "page_size": c["page_size"],
                "scoring": scoring(c),
                "spec_id": _spec_id(s),
            }
        )
    return rows


#: The `scoring` of a decode made with the defaults (the last window's queries score the
#: prompt, a budget per (layer, group)): every row of the tables before issue 19.
WINDOW_SCORING = "window/uniform"


def scoring(config: dict) -> str:
    """How a decode's prompt was scored and its budget allocated, `scorer/allocation`
    (`WINDOW_SCORING` by default), with the window when a non-default scorer or
    allocation ran at another than 32 (the replay's question-agnostic settings)."""
    label = f"{config.get('scorer', 'window')}/{config.get('allocation', 'uniform')}"
    if label != WINDOW_SCORING and config.get("window", 32) != 32:
        label += f", w{config['window']}"
    return label


def t4(decode_units, profile_units, peer_units):
    rows = _flat_decodes(decode_units, "T4")
    summary = _per_group(rows, ("mode", "budget", "policy", "scoring"), _recall_row)
    detail = _per_group(
        rows, ("mode", "context", "depth", "budget", "policy", "scoring"), _recall_row
    )
    # Cache-level retention: the plan sweep at the default geometry (page 16, window 32).
    crow = [
        r | {"mode": u["spec"].get("mode"), "depth": u["spec"].get("depth")}
        for u in profile_units
        if "T4" in u["tables"] and "sweep" in u
        for r in u["sweep"]
        if r["page_size"] == 16 and r["window"] == 32 and r["tau"] == 1.0
    ]

    def retention(recs):
        feas = [r for r in recs if r["feasible"]]
        return {
            "prompts": len(recs),
            "feasible": len(feas),
            "retention_mean": _mean([r["retention_mean"] for r in feas]),
            "kept_all": _mean([1.0 if r["kept_all"] else 0.0 for r in feas]),
        }

    cache = _per_group(crow, ("mode", "budget", "depth", "policy"), retention)
    return summary, detail, cache, _peer_rows(peer_units, "T4", rows)


#: pagekv's presses run inside kvpress, and the runner policy each one reproduces.
PAGEKV_PRESS_POLICY = {"pagekv_entropy": "entropy", "pagekv_mean": "mean"}


def _peer_rows(peer_units, table, decode_rows=()):
    """One row per (mode, budget, press) of the kvpress peer, every press run in kvpress's
    pipeline on the same token ids. For pagekv's presses (`pagekv_entropy`, `pagekv_mean`)
    `same_answer_as_runner` is the fraction of the prompts whose answer equals the
    runner's own decode of that policy at the same budget and default geometry (page 16,
    window 32, tau 1), out of `runner_matched` prompts that have one."""
    runner = {}
    for r in decode_rows:
        c = r["config"]
        if r["scoring"] != WINDOW_SCORING:
            continue
        if r.get("feasible") and (c["page_size"], c["window"], c["tau"]) == (16, 32, 1.0):
            runner[(r["spec_id"], r["mode"], r["budget"], r["policy"])] = r.get("answer")
    rows = []
    recs = [
        p | {"mode": p["spec"].get("mode", "inside")} for p in peer_units if p["table"] == table
    ]
    for (mode, b, press), rs in sorted(_group(recs, ("mode", "budget", "press")).items()):
        ok = [r for r in rs if not r.get("error")]
        policy = PAGEKV_PRESS_POLICY.get(press)
        same = []
        if policy is not None:
            for r in ok:
                key = (_spec_id(r["spec"]), mode, b, policy)
                if key in runner:
                    same.append(1.0 if r.get("answer") == runner[key] else 0.0)
        rows.append(
            {
                "mode": mode,
                "budget": b,
                "press": press,
                "method": f"pagekv {policy} (kvpress press)" if policy else "kvpress",
                "compression_ratio": round(1 - b, 6),
                "prompts": len(rs),
                "answered": len(ok),
                "recall": _mean([1.0 if r.get("correct") else 0.0 for r in ok]),
                # what the decode attends to where the peer reports it (KVzip masks evicted
                # keys, its cache keeps the whole context), else the cache length per layer
                "kept_tokens": _mean(
                    [_kept(r.get("attended_tokens") or r.get("kept_tokens")) for r in ok]
                ),
                "stored_tokens": _mean([_total(r.get("attended_tokens")) for r in ok]),
                "physical_tokens": _mean([_physical(r) for r in ok]),
                "same_answer_as_runner": _mean(same) if same else None,
                "runner_matched": len(same) if policy else None,
                "errors": sorted({r["error"] for r in rs if r.get("error")})[:3],
            }
        )
    return rows


def _physical(r: dict):
    """The tokens a paged cache of `PHYSICAL_PAGE`-token pages holds for what a press
    kept: its pages touched per layer and KV head (the peer's ``touched_pages``), times
    the page; None where the peer did not report them."""
    touched = (r.get("touched_pages") or {}).get(str(PHYSICAL_PAGE))
    return None if touched is None else float(PHYSICAL_PAGE * sum(map(sum, touched)))


def _total(v):
    """Tokens summed over layers and KV heads (a peer's `attended_tokens`), else None."""
    if isinstance(v, list) and v and all(isinstance(x, list) for x in v):
        return float(sum(map(sum, v)))
    return None


def _kept(v):
    """kvpress reports the cache length after compression (a number or one per layer)."""
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, list) and v:
        return _mean([_kept(x) for x in v])
    return None


def t5(card_units):
    rows = [r | {"prompt": _spec_id(u["spec"])} for u in card_units for r in u["rows"]]

    def cardinality(recs):
        feas = [r for r in recs if r["feasible"]]
        return {
            "prompts": len(recs),
            "feasible": len(feas),
            "n": _mean([r["n"] for r in recs]),
            "k": _mean([r["k"] for r in feas]),
            "kept": _mean([r["kept"] for r in feas]),
            "last_page_partial": any(r["last_page_partial"] for r in feas),
            "stored_eq_plan": all(r["stored_eq_plan"] for r in feas),
            "plan_eq_page_sum": all(r["plan_eq_page_sum"] for r in feas),
            "within_budget": all(r["within_budget"] for r in feas),
            "exact": all(r["exact"] for r in feas) if feas else None,
            "smallest_feasible_budget": max(
                (r["min_budget"] for r in recs if not r["feasible"]), default=None
            ),
        }

    return _per_group(rows, ("page_size", "budget", "policy"), cardinality)


def t6(decode_units, peer_units):
    rows = _flat_decodes(decode_units, "T6")
    for r in rows:
        r["kind"] = r["spec"]["task"]
        r["task"] = r["spec"]["curated"]

    def solved(recs):
        feas = [r for r in recs if r.get("feasible")]
        return {
            "tasks": len(recs),
            "feasible": len(feas),
            "solved": sum(1 for r in feas if r["correct"]),
            "solved_fraction": _mean([1.0 if r["correct"] else 0.0 for r in feas]),
            "stored_tokens": _mean([r.get("stored_tokens") for r in feas]),
            "page_tokens": _mean([r.get("page_tokens") for r in feas]),
        }

    summary = _per_group(rows, ("mode", "kind", "budget", "policy", "scoring"), solved)
    detail = [
        {k: r[k] for k in ("mode", "task", "policy", "scoring", "budget")}
        | {
            "correct": r.get("correct"),
            "answer": (r.get("answer") or r.get("error") or "")[:80],
            "expected": r.get("expected"),
        }
        for r in sorted(
            rows, key=lambda r: (r["mode"], r["task"], r["budget"], r["policy"], r["scoring"])
        )
    ]
    return summary, detail, _peer_rows(peer_units, "T6", rows)


# --------------------------------------------------------------------------- T7


def _outcome(e: bool, m: bool) -> str:
    return "beats" if e and not m else "loses" if m and not e else "tie"


def t7(decode_units, profile_units, grid: Grid):
    rows = _flat_decodes(decode_units, "T7") + _flat_decodes(decode_units, "T4")
    rows = [r for r in rows if r["scoring"] == WINDOW_SCORING]  # entropy against mean
    # Answer level: pairs (entropy, mean) on the same prompt and setting.
    by = {}
    for r in rows:
        label = r["label"] or f"b{r['budget']} P{r['page_size']} w{r['config']['window']}"
        if r["table"] == "T4":
            label = f"T4 {label}"
        r["setting"] = label
        by[(r["spec_id"], label, r["policy"])] = r
    answer_rows, pairs = [], []
    for label, mode in sorted({(k[1], k[0].split("|")[1]) for k in by}):
        cnt = defaultdict(int)
        n = 0
        for (sid, lab, pol), e in by.items():
            if lab != label or pol != "entropy" or not sid.endswith("|" + mode):
                continue
            m = by.get((sid, lab, "mean"))
            if m is None or not e.get("feasible") or not m.get("feasible"):
                cnt["infeasible"] += 1
                continue
            n += 1
            o = _outcome(e["correct"], m["correct"])
            cnt[o] += 1
            cnt["both_right"] += int(e["correct"] and m["correct"])
            rd = (e.get("needle_retention") or 0) - (m.get("needle_retention") or 0)
            cnt["ret_beats"] += int(rd > EPS)
            cnt["ret_loses"] += int(rd < -EPS)
            pairs.append((o, abs(rd), rd, sid, lab, e, m))
        if n or cnt["infeasible"]:
            answer_rows.append(
                {
                    "setting": label,
                    "mode": mode,
                    "prompts": n,
                    "entropy_beats": cnt["beats"],
                    "ties": cnt["tie"],
                    "entropy_loses": cnt["loses"],
                    "ties_both_right": cnt["both_right"],
                    "retention_beats": cnt["ret_beats"],
                    "retention_loses": cnt["ret_loses"],
                    "infeasible": cnt["infeasible"],
                }
            )
    # Page size alone: recall of one policy across the T7 page-size settings.
    page_rows = []
    t7rows = [r for r in rows if r["table"] == "T7" and r.get("feasible")]
    for (setting, pol, mode), recs in sorted(_group(t7rows, ("setting", "policy", "mode")).items()):
        if pol == "full":
            continue
        page_rows.append(
            {
                "setting": setting,
                "mode": mode,
                "policy": pol,
                "page_size": recs[0]["page_size"],
                "budget": recs[0]["budget"],
                "prompts": len(recs),
                "recall": _mean([1.0 if r["correct"] else 0.0 for r in recs]),
                "needle_retention": _mean([r.get("needle_retention") for r in recs]),
            }
        )
    # Cache level: every needle prompt, the whole plan sweep.
    sweep = [
        r | {"mode": u["spec"].get("mode"), "sid": _spec_id(u["spec"])}
        for u in profile_units
        for r in u.get("sweep", [])
    ]

    def entropy_vs_mean(recs):
        d = {(r["sid"], r["policy"]): r for r in recs}
        cnt = defaultdict(int)
        diffs = []
        for (sid, pol), e in d.items():
            if pol != "entropy":
                continue
            m = d.get((sid, "mean"))
            if not e["feasible"] or m is None or not m["feasible"]:
                cnt["infeasible"] += 1
                continue
            rd = e["retention_mean"] - m["retention_mean"]
            diffs.append(rd)
            cnt["beats" if rd > EPS else "loses" if rd < -EPS else "tie"] += 1
            cnt["all_beats"] += int(e["kept_all"] and not m["kept_all"])
            cnt["all_loses"] += int(m["kept_all"] and not e["kept_all"])
        return {
            "prompts": len(diffs),
            "entropy_beats": cnt["beats"],
            "ties": cnt["tie"],
            "entropy_loses": cnt["loses"],
            "kept_all_beats": cnt["all_beats"],
            "kept_all_loses": cnt["all_loses"],
            "infeasible": cnt["infeasible"],
            "mean_diff": _mean(diffs),
        } | {
            f"ret_{p}": _mean(
                [r["retention_mean"] for r in recs if r["policy"] == p and r["feasible"]]
            )
            for p in EVICTING_POOLED
        }

    cache_rows = _per_group(
        sweep, ("mode", "budget", "page_size", "window", "tau"), entropy_vs_mean
    )
    return answer_rows, page_rows, cache_rows, pairs, by


def presets(pairs, by, limit: int = 8) -> list[dict]:
    """The settings where entropy and mean pooling differ most, ready for the app.

    Each preset is flat: the PromptSpec fields, the EvictionConfig fields (policy
    "entropy"), `compare_policy` ("mean"), `observed` answers per policy, `winner`.
    Ranked by a different outcome first, then the retention difference; one preset
    per prompt, preferring question-after mode (the honest test of eviction).
    """
    ranked = sorted(
        pairs,
        key=lambda p: (p[0] == "tie", p[3].endswith("|inside"), -p[1], p[3], p[4]),
    )
    out, seen = [], set()
    for outcome, _, rd, sid, label, e, m in ranked:
        if sid in seen:
            continue
        seen.add(sid)
        spec = {f: e["spec"].get(f) for f in PromptSpec.__dataclass_fields__} | {"haystack": None}
        cfg = EvictionConfig(**{**e["config"], "policy": "entropy"}).to_dict()
        full = by.get((sid, "full" if not label.startswith("T4") else "T4 full", "full"))
        observed = {}
        for name, rec in (("entropy", e), ("mean", m), ("full", full)):
            if rec and rec.get("feasible"):
                observed[name] = {
                    "answer": rec["answer"],
                    "correct": rec["correct"],
                    "needle_retention": rec.get("needle_retention"),
                    "kept_tokens": rec.get("kept"),
                }
        winner = {"beats": "entropy", "loses": "mean", "tie": "tie"}[outcome]
        out.append(
            spec
            | cfg
            | {
                "title": f"{sid.split('|')[0]} ({spec['mode']}), {label}: {winner}",
                "compare_policy": "mean",
                "setting": label,
                "expected": e.get("expected"),
                "winner": winner,
                "retention_diff": round(rd, 6),
                "observed": observed,
            }
        )
        if len(out) >= limit:
            break
    return out


# --------------------------------------------------------------------------- all


def build(grid, profile_units, decode_units, card_units, peer_units, peer_status) -> dict:
    t1_rows, t2_rows, scatter = t1_t2(grid, profile_units)
    t3_rows, t3_summary, t3_fig = t3(profile_units)
    t4_sum, t4_detail, t4_cache, t4_peer = t4(decode_units, profile_units, peer_units)
    t5_rows = t5(card_units)
    t6_sum, t6_detail, t6_peer = t6(decode_units, peer_units)
    t7_ans, t7_pages, t7_cache, pairs, by = t7(decode_units, profile_units, grid)
    headline = _headline(t1_rows, t2_rows, t3_summary, t4_sum, t5_rows, t6_sum, t7_ans, t7_cache)
    u0 = profile_units[0] if profile_units else {}
    shape = {k: u0.get(k) for k in ("n_layers", "n_heads", "n_groups")}
    shape["r"] = u0["n_heads"] // u0["n_groups"] if u0 else None
    return {
        "paper": PAPER,
        "shape": shape,
        "headline": headline,
        "peer": peer_status,
        "tables": {
            "T1_uor": t1_rows,
            "T2_bounds": t2_rows,
            "T3_sinks_per_layer": t3_rows,
            "T3_summary": [t3_summary] if t3_summary else [],
            "T4_recall": t4_sum,
            "T4_detail": t4_detail,
            "T4_cache": t4_cache,
            "T4_peer": t4_peer,
            "T5_cardinality": t5_rows,
            "T6_tasks": t6_sum,
            "T6_detail": t6_detail,
            "T6_peer": t6_peer,
            "T7_answers": t7_ans,
            "T7_page_size": t7_pages,
            "T7_cache": t7_cache,
        },
        "presets": presets(pairs, by),
        "_figures": {"scatter": scatter, "t3": t3_fig},
    }


def _headline(t1, t2, t3s, t4s, t5, t6s, t7a, t7c) -> dict:
    low = [r for r in t1 if r["budget"] == min(x["budget"] for x in t1)] if t1 else []

    def tag(r, *keys):  # window-scored rows keep the keys they had before issue 19
        extra = () if r["scoring"] == WINDOW_SCORING else (r["scoring"],)
        return "|".join([*(str(r[k]) for k in keys), *extra])

    def totals(rows):
        return {k: sum(r[k] for r in rows) for k in ("entropy_beats", "ties", "entropy_loses")}

    recall20 = {tag(r, "mode", "policy"): r["recall"] for r in t4s if r["budget"] in (0.2, 1.0)}
    return {
        "uor_max_lowest_budget": {r["geometry"]: r["uor_max"] for r in low},
        "uor_max_overall": max((r["uor_max"] or 0 for r in t1), default=None),
        "measurements_per_cell_max": max((r["measurements"] for r in t1), default=0),
        "pooled_uor_exactly_1": all(
            r["pooled_uor_min"] in (None, 1.0) and r["pooled_uor_max"] in (None, 1.0) for r in t1
        ),
        "bounds_violations": sum(
            r["lower_bound_violations"] + r["upper_bound_violations"] for r in t2
        ),
        "pair_identity_max_abs_err": max(
            (r["pair_identity_max_abs_err"] or 0 for r in t2), default=None
        ),
        "sink_advantage_raw_max": t3s.get("adv_raw_max") if t3s else None,
        "sink_advantage_raw_mean": t3s.get("adv_raw_mean") if t3s else None,
        "sink_advantage_isolated_max": t3s.get("adv_isolated_max") if t3s else None,
        "sink_advantage_isolated_mean": t3s.get("adv_isolated_mean") if t3s else None,
        "needle_recall_20pct": recall20,
        "cardinality_exact": all(r["exact"] in (True, None) for r in t5) if t5 else None,
        "qa_code_20pct": {
            tag(r, "mode", "kind", "policy"): r["solved_fraction"]
            for r in t6s
            if r["budget"] in (0.2, 1.0)
        },
        "t7_answer_totals": totals(t7a),
        "t7_cache_totals": totals(t7c),
    }
