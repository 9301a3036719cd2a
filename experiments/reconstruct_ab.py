"""A/B of the reconstruction scorer on the replay's T4 needle prompts (or, with
`--curated`, its T6 curated tasks), question asked AFTER compression (the strict
test): recall of the window scorer against the reconstruction scorer's aggregations
(max, mean over the reconstruction queries), with the uniform and the global
allocation, at the budgets given. Entropy pooling, pages of 16, n_sink 4, window 32
(the replay's T4 settings; `--page-size`, `--n-sink` and `--window` change them).
`--mode inside` asks the question inside the prompt instead (the issue's
question-inside check; the peer presses are for after mode). `--dtype` is the runner's
decode (`auto`: float16 linear weights on the CPU; the first measurements, before it
existed, decoded in float32).

    python experiments/reconstruct_ab.py [--contexts 500 1000 2000 | --curated qa|code|all]
        [--budgets 0.2 0.5] [--page-size 16] [--window 32] [--n-sink 4] [--dtype auto]
        [--page-reduction max|sum] [--mode after|inside] [--json out.json]
        [--settings "reconstruct/max, global" ...] [--variant "LABEL: field=value ..." ...]
        [--adaptive 0.9 ...] [--adaptive-pages 16 8 4]
        [--peer kvzip kvzip_layerwise keydiff] [--physical-page 16] [--peer-sweep 0.3 0.5 0.7]
        [--seed-offset 5000] [--peer-json earlier.json]

Each prompt is prefilled once and reconstructed once (both aggregations come from the
same pass); every setting then plans and decodes on that prefill. Prints one row per
setting: prompts right; stored tokens (mean per prompt, from the compacted dense caches,
whose groups of a layer are padded to one length under the global allocation); the
tokens of the kept pages (what a paged cache stores: no padding); and the mean seconds
of the prefill and of the reconstruction pass. The JSON's rows also name the prompts
each setting answered wrong (`wrong`: a curated task's name, or a needle prompt's
length and depth) and, per prompt, the fraction of its answer tokens stored, the mean
over (layer, group) (`retention`: the needle's code, a curated task's answer within its
evidence line).

``--peer`` also runs kvpress's presses on the same token ids, question after the
compressed context as in kvpress's pipeline (`experiments.peer.kvpress_peer`, its
own environment): ``kvzip`` (KVzipPress as it comes: one budget shared by every layer
and head), ``kvzip_layerwise`` (``layerwise=True``: the same budget in every layer) and
``keydiff`` (KeyDiffPress), each at the same budgets (kvpress keeps ``floor(budget * n)``
tokens per KV head, pagekv's `ratio_for_budget`). Their stored tokens are what a decoding
step attends to (KVzip masks evicted keys in a full cache; the peer's
``attended_tokens``), summed over layers and KV heads like ours.

Physical memory: every row also gives `physical`, the tokens a paged cache of pages of
``--physical-page`` tokens (16) holds for what was kept: the pages touched per (layer,
KV head), times the page (`pagekv.maths.paging.physical_tokens`; a peer's
``touched_pages``). Scattered tokens touch many pages. ``--peer-sweep`` also runs each
peer at those fractions of each budget and adds rows at equal physical memory: per
prompt, the peer's run with the most physical memory that is at most that of the first
``--settings`` entry on that prompt. ``--seed-offset 5000`` gives the held-out needle
prompts (new seeds, never used to choose settings). ``--peer-json`` takes the peer rows
of an earlier run's JSON on the same prompts (its prompts, mode, seeds and physical page
must be these), and ``--peer`` then runs only the batches it lacks; the equal-memory rows
are matched anew against this run's first setting.

``--variant "sum, window 1: page_reduction=sum window=1"`` adds the setting
"reconstruct/max, global, sum, window 1": "reconstruct/max, global" with those
`EvictionConfig` fields changed (after the flags), run on the same prefill.

``--adaptive 0.9`` adds "reconstruct/max, global, adaptive page 0.9": per prompt, the
largest of ``--adaptive-pages`` whose kept pages capture at least 0.9 of the score that
token-level eviction keeps (`pagekv.maths.adaptive.choose_page_size`). Its row names
the page size chosen per prompt (`page_sizes`) and the share each size tried captured
(`shares`); `physical` still counts pages of ``--physical-page``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.physical_rows import add_result, equal_physical_rows, new_row, peer_runs  # noqa: E402
from experiments.replay.grid import FULL  # noqa: E402
from pagekv import EvictionConfig, plan  # noqa: E402
from pagekv.engine.study import PromptSpec, Study  # noqa: E402
from pagekv.maths.adaptive import choose_page_size  # noqa: E402
from pagekv.maths.paging import physical_tokens  # noqa: E402
from pagekv.runtime.backend import pooler  # noqa: E402
from pagekv.runtime.decode import DECODE_DTYPES  # noqa: E402
from pagekv.runtime.reconstruct import as_profiles  # noqa: E402
from pagekv.runtime.runner import scored  # noqa: E402
from pagekv.tasks import default_max_new_tokens, score  # noqa: E402
from pagekv.tasks.curated import load_tasks  # noqa: E402


def t4_specs(contexts, mode: str = "after", seed_offset: int = 0) -> list[PromptSpec]:
    """The replay's T4 prompts (its seeds, plus `seed_offset`: 5000 gives the held-out
    set, prompts never used to choose settings) for the given context lengths, the
    question asked `mode` ("after" compression: the strict test; "inside" the prompt)."""
    return [
        PromptSpec(context=ctx, depth=d, seed=100 * ci + 10 * di + seed_offset, mode=mode)
        for ci, ctx in enumerate(FULL.t4_contexts)
        if ctx in contexts
        for di, d in enumerate(FULL.t4_depths)
    ]


#: pagekv's settings: name -> (scorer, aggregation, allocation, policy, page reduction:
#: None for `--page-reduction`'s).
SETTINGS = {
    "window, uniform": ("window", None, "uniform", "entropy", None),
    "window, global": ("window", None, "global", "entropy", None),
    "reconstruct/max, uniform": ("reconstruct", "max", "uniform", "entropy", None),
    "reconstruct/max, layer": ("reconstruct", "max", "layer", "entropy", None),
    "reconstruct/max, global": ("reconstruct", "max", "global", "entropy", None),
    "reconstruct/mean, uniform": ("reconstruct", "mean", "uniform", "entropy", None),
    "reconstruct/mean, global": ("reconstruct", "mean", "global", "entropy", None),
    "reconstruct/max, global, mean pooling": ("reconstruct", "max", "global", "mean", None),
    "reconstruct/max, global, max pooling": ("reconstruct", "max", "global", "max", None),
    # A page scored by the sum of its tokens' scores (the attention it holds), not their max.
    "reconstruct/max, global, sum in a page": ("reconstruct", "max", "global", "entropy", "sum"),
    # Entropy weights of the aggregated profile (before `reconstruction_masses`).
    "reconstruct/max, global, profile entropy": ("reconstruct", "max", "global", "profile", None),
}
#: Not run by default: the settings added after the first measurements.
LATER = ("window, global", "reconstruct/max, layer", "reconstruct/max, global, sum in a page")
DEFAULT_SETTINGS = tuple(k for k in SETTINGS if "pooling" not in k and k not in LATER)

#: kvpress presses for ``--peer``: (the peer's press name, its constructor arguments).
PEER_PRESSES = {
    "kvzip": ("kvzip", None),
    "kvzip_layerwise": ("kvzip", {"layerwise": True}),
    "keydiff": ("keydiff", None),
}


def run_peer(names, prompts, budgets, rows: dict, save=None, labels=None, physical_page=16,
             fractions=(), skip=()) -> None:  # fmt: skip
    """Run kvpress's presses `names` on `prompts` [(ids, question ids, task)] at `budgets`,
    one peer batch per (press, budget) in that order, adding one row per batch to `rows`
    (and calling `save()` after each, so a long run keeps what it finished). `labels`
    names the prompts in a row's `wrong` list (their indices when None); a row's
    `physical` counts pages of `physical_page` (the module's docstring). With `fractions`,
    each press also runs at every `budget * f` (the sweep `equal_physical_rows` matches
    from); batches whose row is in `skip` (an earlier run's, `--peer-json`) are not run again."""
    labels = labels or [str(i) for i in range(len(prompts))]
    from experiments.peer import kvpress_peer as kp

    for name in names:
        press, kwargs = PEER_PRESSES[name]
        swept = sorted({round(b * f, 4) for b in budgets for f in fractions} - set(budgets))
        for budget in [*budgets, *swept]:
            key = f"kvpress {name}, {100 * budget:g}%"
            if key in skip:
                continue
            reqs = [
                kp.make_request(
                    f"{name}|{budget}|{i}",
                    press,
                    context_ids=ids,
                    question_ids=q_ids,
                    budget=budget,
                    max_new_tokens=default_max_new_tokens(task),
                    press_kwargs=kwargs,
                    page_sizes=(physical_page,),
                )
                for i, (ids, q_ids, task) in enumerate(prompts)
            ]
            out = kp.run_kvpress(kp.bundled_model_dir(), reqs, timeout=4 * 3600, progress=None)
            row = rows.setdefault(key, new_row())
            for (_, _, task), res, label in zip(prompts, out, labels, strict=True):
                if res.get("error"):
                    print(f"{key}: {res['error']}", file=sys.stderr)
                    continue
                touched = (res.get("touched_pages") or {}).get(str(physical_page))
                physical = None if touched is None else physical_page * sum(map(sum, touched))
                right = bool(score(res["answer"], task)["correct"])
                add_result(row, label, right, sum(map(sum, res["attended_tokens"])), physical)
            print(f"{key}: {row['right']}/{row['prompts']}", file=sys.stderr)
            if save is not None:
                save()


#: The setting a `--variant` changes.
VARIANT_BASE = "reconstruct/max, global"


def variant(text: str) -> tuple[str, dict]:
    """`"LABEL: field=value ..."` -> (the setting's name, the `EvictionConfig` fields it
    changes); values are read as int, then float, else kept as text. Refuses an unknown
    field or value (argparse shows the message)."""
    label, sep, fields = text.partition(":")
    changes = {}
    for item in fields.split():
        key, eq, raw = item.partition("=")
        if not eq or key not in EvictionConfig.__dataclass_fields__:
            raise argparse.ArgumentTypeError(f"{item!r} is not an EvictionConfig field=value")
        for kind in (int, float, str):
            with contextlib.suppress(ValueError):
                changes[key] = kind(raw)
                break
    if not sep or not label.strip() or not changes:
        raise argparse.ArgumentTypeError(f"expected 'LABEL: field=value ...'; got {text!r}")
    try:
        EvictionConfig(scorer="reconstruct", allocation="global").replace(**changes)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return f"{VARIANT_BASE}, {label.strip()}", changes


#: What an earlier run's settings must share with this one for its peer rows to be reused.
SAME_PROMPTS = ("contexts", "curated", "mode", "seed_offset", "physical_page")


def earlier_peer_rows(path: str, args) -> tuple[dict, list[str]]:
    """The peer rows (``"kvpress NAME, B%"``) of the run saved at `path` and its peer
    names, for reuse on the same prompts; ValueError naming the first setting that
    differs from `args` (another prompt set's rows would be matched to ours)."""
    saved = json.loads(Path(path).read_text())
    was = saved["settings"]
    for key in SAME_PROMPTS:
        mine = getattr(args, key)
        theirs = was.get(key, 0 if key == "seed_offset" else None)
        if key == "contexts":
            mine, theirs = sorted(mine), sorted(theirs or [])
        if mine != theirs:
            raise ValueError(f"{path} was run with {key}={theirs!r}; this run has {mine!r}")
    runs = peer_runs(saved["rows"])
    return {k: r for per_press in runs.values() for k, r in per_press.items()}, list(runs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[500, 1000, 2000])
    ap.add_argument(
        "--curated",
        choices=("qa", "code", "all"),
        help="the curated tasks of this kind (the replay's T6) instead of T4's needles",
    )
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.2, 0.5])
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--window", type=int, default=32, help="protected window (tokens)")
    ap.add_argument("--n-sink", type=int, default=4, help="protected sink tokens")
    ap.add_argument(
        "--page-reduction",
        default="max",
        choices=("max", "sum"),
        help="a page's score from its tokens' (EvictionConfig.page_reduction)",
    )
    ap.add_argument("--dtype", default="auto", choices=DECODE_DTYPES, help="the decode")
    ap.add_argument(
        "--mode",
        default="after",
        choices=("after", "inside"),
        help="the question asked after compression (default) or inside the prompt",
    )
    ap.add_argument("--json", default=None, help="also write the rows here")
    ap.add_argument("--peer", nargs="*", default=[], choices=sorted(PEER_PRESSES))
    ap.add_argument(
        "--peer-sweep",
        type=float,
        nargs="*",
        default=[],
        help="also run each peer at these fractions of each budget, and match its physical "
        "memory to the first setting's per prompt (rows '... at ...'s physical memory')",
    )
    ap.add_argument(
        "--physical-page",
        type=int,
        default=16,
        help="the page of the paged cache whose memory `physical` counts (pages touched per "
        "layer and KV head, times this)",
    )
    ap.add_argument(
        "--seed-offset",
        type=int,
        default=0,
        help="added to the T4 prompts' seeds: 5000 is the held-out set (not used to tune)",
    )
    ap.add_argument(
        "--variant",
        type=variant,
        action="append",
        default=[],
        help=f"'LABEL: field=value ...': {VARIANT_BASE!r} with those EvictionConfig fields changed",
    )
    ap.add_argument(
        "--adaptive",
        type=float,
        nargs="*",
        default=[],
        help=f"{VARIANT_BASE!r} at the largest of --adaptive-pages capturing at least this "
        "share of token-level eviction's kept score, per prompt (one setting each)",
    )
    ap.add_argument(
        "--adaptive-pages",
        type=int,
        nargs="+",
        default=[16, 8, 4],
        help="the page sizes --adaptive chooses from",
    )
    ap.add_argument(
        "--peer-json",
        help="reuse the peer rows of this earlier --json run on the same prompts (no kvpress)",
    )
    ap.add_argument(
        "--settings",
        nargs="*",
        default=list(DEFAULT_SETTINGS),
        choices=sorted(SETTINGS),
        help="pagekv's settings to run (none: only --peer)",
    )
    args = ap.parse_args(argv)
    variants = dict(args.variant)
    adaptive = {f"{VARIANT_BASE}, adaptive page {t:g}": t for t in args.adaptive}
    if any(not 0.0 <= t <= 1.0 for t in adaptive.values()):
        ap.error(f"--adaptive thresholds must be in [0, 1]; got {args.adaptive}")
    if any(p < 1 for p in args.adaptive_pages):
        ap.error(f"--adaptive-pages must be page sizes >= 1; got {args.adaptive_pages}")
    settings = [*args.settings, *variants, *adaptive]
    reused, reused_names = earlier_peer_rows(args.peer_json, args) if args.peer_json else ({}, [])
    study = Study.load("bundled", decode_dtype=args.dtype)
    runner = study.runner
    # Policy, page reduction, allocation, scorer and budget are each setting's (below).
    base = EvictionConfig(page_size=args.page_size, n_sink=args.n_sink, window=args.window)
    rows: dict[str, dict] = {}
    times = {"prefill_s": [], "reconstruct_s": []}
    specs = (
        [PromptSpec(task=t.kind, curated=t.name, mode=args.mode) for t in load_tasks(args.curated)]
        if args.curated
        else t4_specs(set(args.contexts), args.mode, args.seed_offset)
    )
    prompts, labels = [], []
    for spec in specs:
        what = spec.curated
        if spec.task == "needle":
            what = f"{spec.context} tokens, depth {spec.depth}"
        labels.append(what)
        prep = study.prepare(spec)
        pre = prep.prefill
        prompts.append((pre.ids, pre.question_ids, prep.task))
        times["prefill_s"].append(pre.timings["prefill_s"])
        if variants or adaptive or any(SETTINGS[x][0] == "reconstruct" for x in args.settings):
            scores = runner.reconstruction(pre)  # both aggregations from one pass
            times["reconstruct_s"].append(pre.timings["reconstruct_s"])
        for budget in args.budgets:
            for setting in settings:
                scorer, agg, alloc, policy, reduction = SETTINGS.get(
                    setting, SETTINGS[VARIANT_BASE]
                )
                cfg = base.replace(
                    budget=budget,
                    page_reduction=reduction or args.page_reduction,
                    allocation=alloc,
                    policy="entropy" if policy == "profile" else policy,
                    scorer=scorer,
                ).replace(**variants.get(setting, {}))
                name = f"{setting}, {100 * budget:g}%"
                choice = None
                try:
                    if setting in adaptive:

                        def plan_at(size, c=cfg, p=pre):  # the runner's Plan at that page size
                            return runner.plan(p, c.replace(page_size=size))

                        choice = choose_page_size(plan_at, args.adaptive_pages, adaptive[setting])
                        planned = choice.plan
                        cfg = planned.config
                    elif agg in (None, "max") and policy != "profile":
                        planned = runner.plan(pre, cfg)  # the runner's own path
                    else:
                        # `plan` without masses weights heads by the entropy of the
                        # profile itself (the "profile" setting, and the mean rows,
                        # measured so before `reconstruction_masses`).
                        p = plan(
                            as_profiles(scores[agg]),
                            pre.n_groups,
                            cfg,
                            scales=scores[agg].sum(-1),
                            pool_pages=pooler(runner.backend),
                        )
                        planned = scored(p, "torch", 0.0, 0.0)
                    res = runner.evaluate(
                        pre,
                        cfg,
                        max_new_tokens=default_max_new_tokens(prep.task),
                        planned=planned,
                        needle_positions=prep.needle_positions or None,
                    )
                except ValueError as e:  # an infeasible budget for a short prompt
                    print(f"{spec.curated or spec.depth}: {name}: {e}", file=sys.stderr)
                    continue
                right = bool(score(res.answer, prep.task)["correct"])
                row = rows.setdefault(name, new_row() | {"pages": 0})
                physical = physical_tokens(planned.keep, args.physical_page)
                add_result(row, what, right, sum(map(sum, res.stored_tokens)), physical)
                if res.needle_retention is not None:  # the answer tokens stored, mean (l, g)
                    kept = [x for per_layer in res.needle_retention for x in per_layer]
                    row.setdefault("retention", {})[what] = round(sum(kept) / len(kept), 4)
                row["pages"] += int(planned.union_tokens.sum())
                if choice is not None:
                    row.setdefault("page_sizes", {})[what] = choice.page_size
                    row.setdefault("shares", {})[what] = {
                        str(k): round(v, 4) for k, v in choice.shares.items()
                    }
        print(f"done {pre.n} tokens, {what}", file=sys.stderr)

    def save(**extra):
        if args.json:
            Path(args.json).write_text(json.dumps({"rows": rows, **extra, **meta}, indent=1))

    meta = {"settings": {**vars(args), "decode": runner.decode_path}}
    rows |= reused
    if args.peer:
        run_peer(args.peer, prompts, args.budgets, rows, save, labels, args.physical_page,
                 args.peer_sweep, skip=reused)  # fmt: skip
    names = [*args.peer, *(n for n in reused_names if n not in args.peer)]
    if names and settings:
        rows |= equal_physical_rows(rows, settings[0], args.budgets, names)
    phys = f"physical (pages of {args.physical_page})"
    print(f"{'setting':<64} {'right':>9} {'stored (dense)':>15} {'kept pages':>11} {phys:>24}")
    for name, r in rows.items():
        n = max(r["prompts"], 1)
        physical = "" if r.get("physical") is None else f"{r['physical'] / n:.0f}"
        print(
            f"{name:<64} {r['right']:>4}/{r['prompts']:<4} {r['stored'] / n:>15.0f} "
            f"{r.get('pages', r['stored']) / n:>11.0f} {physical:>24}"
            + (f" ({r['over']} over our memory)" if r.get("over") else "")
        )
    mean = {k: sum(v) / len(v) for k, v in times.items() if v}
    print(
        ", ".join(f"{k[:-2]} {v:.2f} s" for k, v in mean.items())
        + f" (mean per prompt, {len(specs)} prompts)"
    )
    save(mean_s=mean)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
