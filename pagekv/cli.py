"""`python -m pagekv`: run eviction on a real model from the command line.

    python -m pagekv run --model bundled --task needle --context 2000 --depth 0.5 \
        --budget 0.2 --page-size 16 --policy entropy --seed 0 --json
    python -m pagekv run --policy all                     # every policy, one prefill
    python -m pagekv run --haystack-file essay.txt --needle "..." --question "..." --answer "..."
    python -m pagekv replay --model bundled --out runs/replay --quick
    python -m pagekv models [--prepare qwen-coder-0.5b]   # what scripts/setup.sh --models runs
    python -m pagekv eval --model pagekv --model_args pretrained=bundled,policy=entropy \
        --tasks niah_single_1 --limit 5      # lm-eval's command line (pip install ".[eval]")

Bad arguments print one line on stderr and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time

from pagekv.maths.config import ALLOCATIONS, POLICIES, SCORERS, EvictionConfig
from pagekv.maths.policies import get_policy
from pagekv.runtime.decode import DECODE_DTYPES

EXIT_USAGE = 2
#: What the installed package does not hold: the app's parts (`lessons`) and the research
#: harness (`replay`); those commands run from a checkout.
CHECKOUT_ONLY = ("pagekv.app", "experiments")
DTYPE_HELP = (
    "the decode step's linear weights: auto (default: float16 on the CPU, the model's own "
    "dtype on a GPU), float32 (the prefill's numerics), float16 or bfloat16"
)


class UsageError(Exception):
    """A bad argument or input: one line on stderr, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage block
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="python -m pagekv", description="Page-EntroKV on a real model.")
    sub = ap.add_subparsers(dest="command", required=True, parser_class=_Parser)

    run = sub.add_parser("run", help="prefill one prompt, evict, decode, score")
    run.add_argument("--model", default="bundled", help="'bundled' (default) or a hub name")
    run.add_argument(
        "--task", default="needle", choices=["needle", "qa", "code", "custom"], help="prompt kind"
    )
    run.add_argument("--name", default=None, help="curated qa/code task name (default: first)")
    run.add_argument("--context", type=int, default=2000, help="needle context length, tokens")
    run.add_argument("--depth", type=float, default=0.5, help="needle depth in [0, 1]")
    run.add_argument("--needles", type=int, default=1, help="needles in the haystack (1-4)")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--haystack-file", default=None, help="custom haystack text file")
    run.add_argument("--needle", default=None, help="custom needle sentence")
    run.add_argument("--question", default=None, help="custom question")
    run.add_argument("--answer", default=None, help="custom expected answer")
    run.add_argument("--question-after", action="store_true", help="ask after compression")
    run.add_argument("--policy", default="entropy", choices=[*POLICIES, "all"])
    run.add_argument("--budget", type=float, default=0.2, help="fraction of the prompt kept")
    run.add_argument("--page-size", type=int, default=16)
    run.add_argument("--n-sink", type=int, default=4)
    run.add_argument("--window", type=int, default=32)
    run.add_argument("--tau", type=float, default=1.0)
    run.add_argument("--smoothing", type=int, default=1, help="odd pooling width (1 = off)")
    run.add_argument("--page-reduction", default="max", choices=["max", "sum"])
    run.add_argument(
        "--scorer",
        default="window",
        choices=list(SCORERS),
        help="window: the last --window prompt tokens' queries score the prompt; reconstruct: "
        "the model's attention while it repeats the context (question-agnostic, one extra "
        "pass over the context)",
    )
    run.add_argument(
        "--allocation",
        default="uniform",
        choices=list(ALLOCATIONS),
        help="uniform: k tokens per (layer, group); global: the L*G*k tokens shared across "
        "them by normalised page scores; layer: each layer's G*k tokens shared across its "
        "groups (global and layer: pooled policies; with --policy all, head_independent "
        "stays uniform)",
    )
    run.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="answer tokens to decode (default: the task's own, enough for its answer)",
    )
    run.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"])
    run.add_argument("--dtype", default="auto", choices=DECODE_DTYPES, help=DTYPE_HELP)
    run.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    run.add_argument("--json", action="store_true", help="print one JSON object")
    run.add_argument("-v", "--verbose", action="store_true")

    rep = sub.add_parser("replay", help="measure the paper's claims (tables T1-T7)")
    rep.add_argument("--model", default="bundled")
    rep.add_argument("--out", required=True, help="output folder (results.json, CSVs, figures)")
    rep.add_argument("--quick", action="store_true", help="a small grid (minutes)")
    rep.add_argument(
        "--grid",
        choices=["quick", "shared-cpu", "extended", "full", "agnostic"],
        default=None,
        help="the grid (default: full, or quick with --quick); see experiments/replay/grid.py",
    )
    rep.add_argument("--no-peer", action="store_true", help="skip the kvpress peer")
    rep.add_argument(
        "--peer-minutes",
        type=float,
        default=None,
        help="start no kvpress batch after this many minutes (what finished is kept; "
        "the next run resumes)",
    )
    rep.add_argument(
        "--update-presets",
        action="store_true",
        help="also copy the measured presets over the app's assets/presets.json",
    )
    rep.add_argument("--device", default=None)

    sub.add_parser("eval", add_help=False, help="lm-evaluation-harness's command line "
                   "with the `pagekv` model (pip install '.[eval]')")  # fmt: skip
    mod = sub.add_parser("models", help="the bundled models: installed? converted?")
    mod.add_argument(
        "--prepare",
        nargs="+",
        metavar="NAME",
        help="join and check the GGUF of these bundled models and convert it once (what "
        "scripts/setup.sh --models runs); exit 2, saying what to run, if one is not installed",
    )

    les = sub.add_parser("lessons", help="the app's lessons, each checked on the model")
    les.add_argument(
        "--check",
        action="store_true",
        help="run every lesson and check its observation; exit 1 if one does not hold",
    )
    les.add_argument("--json", action="store_true", help="print one JSON object")
    les.add_argument("--only", nargs="+", metavar="ID", help="these lessons only")
    les.add_argument("--model", default="bundled")
    for p in (rep, les):  # both end with these options
        p.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"])
        p.add_argument("--dtype", default="auto", choices=DECODE_DTYPES, help=DTYPE_HELP)
        p.add_argument("-v", "--verbose", action="store_true")
    return ap


def _config_from(args, policy: str, every: bool = False) -> EvictionConfig:
    """The run's configuration for `policy`; with `every` (`--policy all`) a per-head
    policy keeps the uniform allocation (a shared budget needs pooled page scores)."""
    allocation = "uniform" if every and get_policy(policy).per_head else args.allocation
    keys = ("scorer", "budget", "page_size", "n_sink", "window", "tau", "smoothing")
    return EvictionConfig(
        allocation=allocation,
        policy=policy,
        page_reduction=args.page_reduction,
        **{k: getattr(args, k) for k in keys},
    )


def _check_task_and_model(args) -> None:
    """Refuse, before any model loads, a curated task name that does not exist and a
    model that cannot load (`offline_refusal`): what `Study` and `load_model` would say
    after loading."""
    if args.task in ("qa", "code"):
        from pagekv.tasks import curated_name

        curated_name(args.task, args.name)  # a TaskError (ValueError): one line
    from pagekv.runtime.models import offline_refusal

    refused = offline_refusal(args.model)
    if refused is not None:
        raise refused
    _check_budget_floor(args)


#: A needle prompt's tokens beyond `--context` (its question and template), at most.
NEEDLE_EXTRA_TOKENS = 512


def _check_budget_floor(args) -> None:
    """Refuse, before any model loads, a budget that no needle prompt of about
    `--context` tokens can take: below the smallest feasible budget
    (`pagekv.maths.paging.min_feasible_budget`: its sinks' and window's pages) of every
    length from `--context` to `NEEDLE_EXTRA_TOKENS` more. A budget near the floor is
    left to the check after tokenizing, which knows the exact length."""
    if args.task != "needle" or args.haystack_file:
        return
    from pagekv.maths.paging import min_feasible_budget

    lo, hi = args.context, args.context + NEEDLE_EXTRA_TOKENS
    floor = min(min_feasible_budget(n, args.page_size, args.n_sink, args.window)
                for n in range(lo, hi + 1))  # fmt: skip
    if args.budget < floor:
        raise UsageError(
            f"--budget {args.budget:g} keeps fewer tokens than the protected pages (sinks "
            f"and window) of a needle prompt of about {args.context} tokens hold: at least "
            f"{math.ceil(floor * 1000) / 1000:.3f} is needed; raise --budget or lower "
            "--n-sink, --window or --page-size"
        )


def _spec_from(args):
    from pagekv.engine.study import PromptSpec
    from pagekv.tasks import load_haystack_file, needle_depth

    haystack = None
    task = args.task
    if args.haystack_file:
        haystack = load_haystack_file(args.haystack_file)
        if task == "needle" and not any([args.needle, args.question, args.answer]):
            raise UsageError("--haystack-file needs --needle, --question and --answer")
        task = "custom" if task in ("needle", "custom") else task
    depth = needle_depth(haystack, args.needle, args.depth) if task == "custom" else args.depth
    return PromptSpec(
        task=task,
        context=args.context,
        depth=depth,
        seed=args.seed,
        needles=args.needles,
        curated=args.name,
        haystack=haystack,
        needle=args.needle,
        question=args.question,
        answer=args.answer,
        mode="after" if args.question_after else "inside",
    )


def cmd_run(args) -> int:
    policies = list(POLICIES) if args.policy == "all" else [args.policy]
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1; got {args.max_new_tokens}")
    if not (isinstance(args.budget, float) and math.isfinite(args.budget)):
        raise UsageError(f"--budget must be a number in (0, 1]; got {args.budget}")
    every = len(policies) > 1
    configs = [_config_from(args, p, every) for p in policies]  # checked before a model loads
    _check_task_and_model(args)  # likewise, in one line
    spec = _spec_from(args)

    from pagekv.engine.study import Study
    from pagekv.progress import Steps
    from pagekv.runtime.models import load_model

    steps = Steps(total=2 + len(configs))  # on a terminal: each step, its seconds, a bar
    with steps.step(f"loading {args.model}"):
        loaded = load_model(args.model, device=args.device)
        study = Study(loaded, backend=args.backend, decode_dtype=args.dtype)
    with steps.step("tokenizing and prefilling the prompt"):
        prep = study.prepare(spec)
    runs = []
    for cfg in configs:
        what = f"{cfg.policy}: " + (
            "reconstruction pass, eviction, decoding"
            if cfg.scorer == "reconstruct" and not runs
            else "eviction and decoding"
        )
        with steps.step(what):
            runs.append(study.run(prep, cfg, max_new_tokens=args.max_new_tokens))
    if args.json:
        objects = [r.to_dict() for r in runs]
        if len(runs) == 1:
            print(json.dumps(objects[0]))
        else:
            common = {k: objects[0][k] for k in ("model", "task", "expected", "prompt_tokens")}
            print(json.dumps({**common, "policy": "all", "runs": objects}))
    else:
        print(format_table(runs))
    return 0


def format_table(runs: list) -> str:
    """A readable table of runs (`RunResult`s) on one prompt (the cells of the app's
    answers table)."""
    from pagekv.runtime.result import run_cells

    r0 = runs[0]
    t = r0.timings
    if r0.mode == "after":  # the budgets are of the context, which alone is evicted
        tokens = (
            f"{r0.prompt_tokens} prompt tokens: {r0.context_tokens} of context (evicted, and "
            f"what the budgets count) and {r0.prompt_tokens - r0.context_tokens} of question"
        )
    else:
        tokens = f"{r0.prompt_tokens} prompt tokens (what the budgets count)"
    head = (
        f"model {r0.model} ({r0.device}, {r0.backend} backend), task {r0.task}, "
        f"{tokens}, mode {r0.mode}; expected {r0.expected!r}\n"
        f"load {t['load_s']:.1f}s, prefill {t['prefill_s']:.2f}s\n"
    )
    cols = f"{'policy':<17}{'stored':>7}{'budget':>8}{'UOR max':>9}{'needle':>8}{'evict s':>9}"
    cols += f"{'decode s':>10}  {'ok':<4}answer"
    lines = [head + cols, "-" * len(cols)]
    for r in runs:
        c = run_cells(r)  # the app's answers table reads the same cells
        needle = "-" if c["needle"] is None else f"{c['needle']:.2f}"
        evict = "-" if c["evict_s"] is None else f"{c['evict_s']:.3f}"  # full: nothing
        ans = c["answer"].replace("\n", " ")
        ans = ans if len(ans) <= 60 else ans[:57] + "..."
        lines.append(
            f"{r.policy:<17}{c['stored']:>7}{r.budget_tokens:>8}{c['uor']:>9.3f}"
            f"{needle:>8}{evict:>9}{c['decode_s']:>10.2f}  "
            f"{'yes' if r.correct else 'no':<4}{ans}"
        )
    if r0.mode == "inside":
        lines.append(
            "note: question inside the prompt: the first answer token comes from the prefill, "
            "which saw the whole prompt"
        )
    return "\n".join(lines)


def cmd_replay(args) -> int:
    """The replay of the paper's claims: the research harness in the checkout's
    experiments/ folder, which the wheel does not hold."""
    from experiments.replay import run_replay
    from experiments.replay.grid import GRIDS

    same = ("model", "out", "quick", "device", "backend", "update_presets", "peer_minutes")
    run_replay(
        grid=GRIDS[args.grid] if args.grid else None,
        peer=not args.no_peer,
        decode_dtype=args.dtype,
        **{k: getattr(args, k) for k in same},
    )
    return 0


def cmd_lessons(args) -> int:
    """List the lessons, or (`--check`) run each and say whether its observation holds."""
    from pagekv.app.lessons import LESSONS, get_lesson, run_lesson

    lessons = [get_lesson(i) for i in args.only] if args.only else list(LESSONS)
    if not args.check:
        rows = [
            {"id": x.id, "title": x.title, "kind": x.kind, "observation": x.observation.statement}
            for x in lessons
        ]
        if args.json:
            print(json.dumps({"lessons": rows}))
        else:
            for r in rows:
                print(f"{r['id']:<22}{r['title']}\n{'':<22}observation: {r['observation']}")
        return 0
    study = None
    if any(x.kind == "live" for x in lessons):
        from pagekv.engine.study import Study

        study = Study.load(
            args.model, backend=args.backend, allow_fallback=False, decode_dtype=args.dtype
        )
    runs = [run_lesson(study, x) for x in lessons]
    failed = [r.lesson.id for r in runs if not r.verdict.holds]
    if args.json:
        print(json.dumps({"lessons": [r.to_dict() for r in runs], "failed": failed}))
    else:
        for r in runs:
            mark = "holds" if r.verdict.holds else "DOES NOT HOLD"
            print(f"[{mark}] {r.lesson.id} ({r.lesson.kind}): {r.lesson.observation.statement}")
            print(f"    measured: {r.verdict.measured}")
        print(
            f"{len(runs) - len(failed)} of {len(runs)} lessons hold"
            + (f"; failing: {', '.join(failed)}" if failed else "")
        )
    return 1 if failed else 0


def cmd_models(args) -> int:
    """List the bundled models with their state, or (`--prepare`) convert them."""
    from pagekv.runtime import models as m

    if not args.prepare:
        for spec in m.BUNDLED_MODELS.values():
            converted = m.cache_problem(model=spec.key) is None
            installed = spec.installed()
            state = "installed" if installed else "not installed"
            state += ", converted" if converted else ""
            print(f"{spec.key:<18}{spec.description}: {state}")
            if not installed and not converted:
                print(f"{'':<18}{spec.missing}")
        return 0
    for name in args.prepare:
        spec = m.bundled_model(name)
        if spec is None:
            raise UsageError(f"{name!r} is not a bundled model ({', '.join(m.BUNDLED_MODELS)})")
        if m.cache_problem(model=spec.key) is None:
            print(f"{spec.key}: converted copy ready at {m.bundled_cache_dir(spec.key)}")
            continue
        spec.source()  # GGUFMissing: what to install, in one sentence
        t0 = time.perf_counter()
        print(f"{spec.key}: joining, checking and converting its GGUF (about two minutes)")
        path = m.build_bundled_cache(model=spec.key)
        print(f"{spec.key}: converted in {time.perf_counter() - t0:.0f} s to {path}")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] != ["eval"]:  # `eval` is lm-eval's own command line: its own parser
        try:
            args = build_parser().parse_args(argv)
        except UsageError as e:
            print(f"pagekv: error: {e}", file=sys.stderr)
            return EXIT_USAGE
        logging.basicConfig(
            level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
            format="%(name)s: %(message)s",
        )
    try:
        if argv[:1] == ["eval"]:  # with the `pagekv` model registered
            try:
                from pagekv.integrations.lm_eval_model import cli
            except ModuleNotFoundError as e:
                if not (e.name or "").startswith("lm_eval"):
                    raise
                raise UsageError(
                    "eval runs lm-evaluation-harness, which is not installed: "
                    'pip install ".[eval]" (from the checkout) installs it'
                ) from None
            return cli(argv[1:])
        commands = {"run": cmd_run, "lessons": cmd_lessons, "models": cmd_models}
        return commands.get(args.command, cmd_replay)(args)
    except (UsageError, ValueError, OSError) as e:  # BudgetError, TaskError, ModelLoadError
        msg = " ".join(str(e).split())
        print(f"pagekv: error: {msg}", file=sys.stderr)
        return EXIT_USAGE
    except ModuleNotFoundError as e:
        if not (e.name or "").startswith(CHECKOUT_ONLY):
            raise
        command = argv[0] if argv else "this command"
        print(
            f"pagekv: error: {command} runs from a checkout of the repository (the installed "
            f"package does not hold {e.name}): run `python -m pagekv {command}` from its root",
            file=sys.stderr,
        )
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
