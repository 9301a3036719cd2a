r"""RULER, built and scored by lm-evaluation-harness's own task code, under pagekv's
eviction policies (issue 43).

    python experiments/ruler.py [--models bundled qwen-coder-0.5b] [--lengths 2048]
        [--samples 20] [--minutes 60] [--out docs/ruler.jsonl] [--table docs/ruler.md]

For each model, length (lm-eval's `max_seq_lengths`), task and sample, lm-eval's task
code builds the prompt (offline: the six RULER tasks that need no download) and scores
the answers, and pagekv's runner answers it under every method (question `after`:
`lm_eval_model.split_question`); `HEADER`, the table's preamble, says how.

Resumable: each answer is one JSON line appended to `--out`, and a case already there
is skipped, so the command can be run again (`--minutes` stops it starting new
prompts). `--table` writes the Markdown table of everything in `--out`: per model,
length, question mode and method, each task's mean score, the samples behind it and
the seconds they took.

`--ours agnostic` adds the question-agnostic rows (`agnostic_methods`: the reconstruction
pass scores the prompt; one prefill and one reconstruction pass per prompt serve every
row of ours). `--peers snapkv kvzip keydiff chunkkv` adds NVIDIA kvpress's presses
(`experiments.peer`: kvpress's own pipeline in its own environment, on the same token
ids, one batch per task; `PEERS` their options) at `--peer-budgets` (default: ours, and
`--peer-sweep` fractions of them), on the first `--peer-samples` documents. Every new
answer row records the physical memory of its kept set in two measures
(`experiments/ruler_memory.py`: `pages_sum`, `pages_max`), and the table matches, per
prompt, each press's run with the most memory that is still at most ours.

The question-agnostic comparison at equal physical memory (issue 58)::

    python experiments/ruler.py --models qwen-coder-0.5b --modes after --ours agnostic \
        --samples 20 --peers kvzip keydiff chunkkv --peer-samples 10 \
        --peer-budgets 0.01 0.02 0.05 0.1 0.2 --table docs/ruler.md \
        --figure docs/ruler_memory.svg

Each prompt prints the seconds an answer of ours has taken so far.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from experiments.ruler_memory import (  # noqa: E402
    MEASURES,
    curves,
    equal_memory,
    equal_memory_table,
    figure_svg,
    match,
    memory_fields,
    plan_memory,
    press_of,
)
from pagekv import EvictionConfig  # noqa: E402
from pagekv.integrations.lm_eval_model import (  # noqa: E402
    RULER_OFFLINE_TASKS as TASKS,
)

#: The methods compared (issue 43): the two poolings the app contrasts, and the per-head
#: selection whose union a group pays for.
POOLINGS = ("mean", "entropy")
PER_HEAD = "head_independent"
BUDGETS = (0.1, 0.2)
PAGE = 16
MODES = ("inside", "after")
#: Samples a task and length the table is run to (`--samples`'s default).
SAMPLES = 20


def methods() -> dict[str, EvictionConfig]:
    """The window-scored rows (`--ours window`)."""
    out = {"full": EvictionConfig(policy="full")}
    for budget in BUDGETS:
        for policy in (*POOLINGS, PER_HEAD):
            out[f"{policy} {round(100 * budget)}%"] = EvictionConfig(
                policy=policy, budget=budget, page_size=PAGE
            )
    return out


#: The question-agnostic rows' budgets (issue 58).
AGNOSTIC_BUDGETS = (0.05, 0.1, 0.2)


def agnostic_methods() -> dict[str, EvictionConfig]:
    """The question-agnostic rows (`--ours agnostic`): the reconstruction pass scores
    the prompt (`scorer="reconstruct"`); mean and entropy pooling with one budget
    shared by every (layer, KV head) (`allocation="global"`) at 5, 10 and 20 %, entropy
    with a budget per (layer, KV head) (`"uniform"`) at 10 and 20 %, and entropy in
    pages of 1 (token level) at 10 %: what pages cost at equal kept tokens."""
    out = {"full": EvictionConfig(policy="full")}
    rec = dict(scorer="reconstruct", page_size=PAGE)
    for budget in AGNOSTIC_BUDGETS:
        for policy in POOLINGS:
            out[f"{policy} reconstruct/global {round(100 * budget)}%"] = EvictionConfig(
                policy=policy, budget=budget, allocation="global", **rec
            )
    for budget in BUDGETS:
        out[f"entropy reconstruct/uniform {round(100 * budget)}%"] = EvictionConfig(
            policy="entropy", budget=budget, **rec
        )
    out["entropy reconstruct/global 10% (pages of 1)"] = EvictionConfig(
        policy="entropy", budget=0.1, allocation="global", scorer="reconstruct", page_size=1
    )
    return out


#: `--ours`: the row sets.
OURS = {"window": methods, "agnostic": agnostic_methods}
#: The names of every row of ours (a row not among them is a press's).
OUR_METHODS = frozenset(methods()) | frozenset(agnostic_methods())


def prompts(task_names, tokenizer: str, length: int, samples: int):
    """`(task, index, prompt, max_gen_toks, doc, task object)` for the first `samples`
    documents of each task, as lm-eval builds them."""
    import numpy as np
    import torch
    from lm_eval.tasks import TaskManager, get_task_dict

    # lm-eval's simple_evaluate seeds these (its defaults) before building the tasks, so
    # the prompts are its own, the same in every run (what a resumed run relies on).
    random.seed(0)
    np.random.seed(1234)
    torch.manual_seed(1234)
    tm = TaskManager(metadata={"tokenizer": tokenizer, "max_seq_lengths": [length]})
    tasks = get_task_dict(list(task_names), tm)
    for name in task_names:
        task = tasks[name]
        task.build_all_requests(limit=samples)
        for inst in task.instances:
            prompt, kwargs = inst.args
            yield name, inst.doc_id, prompt, int(kwargs.get("max_gen_toks", 128)), inst.doc, task


def peer_methods(peers, sweep=(), budgets=None) -> dict[str, tuple[str, float]]:
    """`{"snapkv 10%": ("snapkv", 0.1), ...}`: each press at each of `budgets`, or by
    default at each of ours and each `sweep` fraction of it."""
    if not budgets:
        budgets = sorted({round(b * f, 4) for b in BUDGETS for f in (1.0, *sweep)})
    return {f"{p} {100 * b:g}%": (p, b) for p in peers for b in sorted(budgets)}


#: The presses `--peers` runs, and their options: SnapKV's window as ours; ChunkKV
#: in chunks of a page, around KeyDiff (question-agnostic); KVzip scores each prompt
#: once for every budget (`reuse_scores`: tests/test_kvpress_peer.py shows the kept
#: sets are its pipeline's).
PEERS = {
    "snapkv": dict(press_kwargs={"window_size": 32}),
    "kvzip": dict(reuse_scores=True),
    "keydiff": {},
    "chunkkv": dict(press_kwargs={"scorer": "keydiff", "chunk_length": PAGE}),
}


#: Physical memory is counted in pages of this many tokens (a paged cache's page).
PHYSICAL_PAGE = 16


def physical(row: dict) -> int | None:
    """The tokens of the 16-token pages a row's kept set touches in the (layer, KV
    head) that touches most: a press's recorded `pages_16`; ours keeps whole pages of
    16 but the prompt's last, so its kept tokens rounded up to a page."""
    if row.get("pages_16") is not None:
        return PHYSICAL_PAGE * int(row["pages_16"])
    if row["method"] in OUR_METHODS and row.get("kept_tokens") is not None:
        return -(-int(row["kept_tokens"]) // PHYSICAL_PAGE) * PHYSICAL_PAGE
    return None


def physical_match(rows: list[dict], press: str, ours: str) -> list[dict]:
    """Per prompt (model, length, task, sample, mode) that our method `ours` answered:
    `press`'s run on it (of any budget) with the most physical memory (`physical`) that
    is at most ours, the one keeping most tokens among runs of equal memory, or its
    smallest run where none fits (marked `over`): `ruler_memory.match`'s rule. The
    picked rows, each renamed `"{press} at {ours}'s memory"`."""
    return match(rows, press, ours, physical)


def run_peers(args, model_name, length, cases, out: Path) -> None:
    """kvpress's presses on `cases` (`(task, index, prompt sha, c_ids, q_ids, max_new,
    doc, task object, todo)`), one batch for all, each answer scored and appended with
    its memory (`ruler_memory.memory_fields` of the pages its kept tokens touch); a
    request the press fails is appended with its `error` and no score."""
    from experiments.peer import kvpress_peer as kp

    requests, meta = [], {}
    theirs = peer_methods(args.peers, args.peer_sweep, args.peer_budgets)
    for task, index, sha, c_ids, q_ids, max_new, doc, task_obj, todo in cases:
        for mode, name in todo:
            press, budget = theirs[name]
            ids = dict(input_ids=c_ids + q_ids) if mode == "inside" else dict(
                context_ids=c_ids, question_ids=q_ids)  # fmt: skip
            rid = f"{task}/{index}/{mode}/{name}"
            requests.append(kp.make_request(rid, press, budget=budget, max_new_tokens=max_new,
                                            **PEERS.get(press, {}), **ids))  # fmt: skip
            compressed = len(c_ids) + (len(q_ids) if mode == "inside" else 0)
            meta[rid] = (task, index, sha, mode, name, doc, task_obj, len(c_ids) + len(q_ids),
                         compressed)  # fmt: skip
    if not requests:
        return
    # KVzip answers in up to ~2 minutes on the 2-core CPU: the batch's limit grows with it.
    timeout = max(kp.RUN_TIMEOUT, 300 * len(requests))
    results = kp.run_kvpress(kp.bundled_model_dir(model_name), requests, timeout, progress=None)
    for res in results:
        task, index, sha, mode, name, doc, task_obj, n, compressed = meta[res["id"]]
        key = (model_name, length, task, index, mode, name)
        if res.get("error"):
            print(f"ruler: {res['id']}: {res['error']}")
            _append_error(out, key, sha, n, res["error"], res.get("seconds"))
            continue
        pages = (res.get("touched_pages") or {}).get("16")
        # The tokens a (layer, KV head) attends to: a masking press (KVzip) keeps the
        # whole context in its cache and hides the rest, so its cache length says nothing.
        att = [c for row in res["attended_tokens"] for c in row]
        mem = memory_fields(pages, compressed) if pages else {}
        _append(out, key, sha, n, res["answer"], doc, task_obj, res.get("seconds"),
                round(sum(att) / len(att)), kept_tokens_max=max(att),
                reused_scores=res.get("reused_scores", False), **mem)  # fmt: skip


def done_cases(path: Path) -> dict[tuple, str | None]:
    """The cases answered in `path`: `(model, length, task, index, mode, method)` -> the
    SHA-1 of the prompt they answered."""
    if not path.exists():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {
        (r["model"], r["length"], r["task"], r["index"], r["mode"], r["method"]): r.get("prompt")
        for r in rows
    }


def prompt_sha(prompt: str) -> str:
    return hashlib.sha1(prompt.encode()).hexdigest()[:12]


def check_same_prompt(done: dict, key: tuple, sha: str) -> None:
    """A resumed run must be answering the prompts the earlier run answered."""
    earlier = {v for k, v in done.items() if k[:4] == key and v is not None}
    if earlier and earlier != {sha}:
        raise SystemExit(f"ruler: {key} is not the prompt the earlier answers in the file had "
                         "(lm-eval built another); use a new --out")  # fmt: skip


def run(args) -> None:
    from pagekv.integrations.lm_eval_model import prefill, prompt_ids, tokenizer_name
    from pagekv.runtime.models import load_model
    from pagekv.runtime.runner import Runner

    out = Path(args.out)
    done = done_cases(out)
    ours = {k: v for s in args.ours for k, v in OURS[s]().items()}
    theirs = peer_methods(args.peers, args.peer_sweep, args.peer_budgets)
    window = max(cfg.window for cfg in ours.values())
    peer_samples = args.samples if args.peer_samples is None else args.peer_samples
    stop_at = time.time() + 60 * args.minutes
    spent, answered = 0.0, 0
    for model_name in args.models:
        loaded = load_model(model_name, device="cpu")
        runner = Runner(loaded.model, loaded.tokenizer)
        tok = loaded.tokenizer
        for length in args.lengths:
            peer_cases = []
            for task, index, prompt, max_new, doc, task_obj in prompts(
                args.tasks, tokenizer_name(model_name), length, max(args.samples, peer_samples)
            ):
                sha = prompt_sha(prompt)
                case = (model_name, length, task, index)
                check_same_prompt(done, case, sha)
                if peer_cases and peer_cases[-1][0] != task:  # a task's batch is complete
                    run_peers(args, model_name, length, peer_cases, out)
                    peer_cases = []
                todo = [(m, n) for m in args.modes for n in ours
                        if (*case, m, n) not in done and index < args.samples]  # fmt: skip
                peer_todo = [(m, n) for m in args.modes for n in theirs
                             if (*case, m, n) not in done and index < peer_samples]  # fmt: skip
                if not todo and not peer_todo:
                    continue
                if time.time() > stop_at:
                    print(f"ruler: --minutes {args.minutes} reached; run again to go on")
                    run_peers(args, model_name, length, peer_cases, out)
                    return
                c_ids, q_ids = prompt_ids(tok, prompt)
                if peer_todo:
                    peer_cases.append(
                        (task, index, sha, c_ids, q_ids, max_new, doc, task_obj, peer_todo)
                    )
                t_case = time.perf_counter()
                for mode in args.modes:
                    names = [name for m, name in todo if m == mode]
                    if not names:
                        continue
                    t0 = time.perf_counter()
                    pre = prefill(runner, c_ids, q_ids, mode, window)
                    prefill_s = time.perf_counter() - t0
                    if any(ours[n].scorer == "reconstruct" for n in names):
                        runner.reconstruction(pre)  # once, in `reconstruct_s`, not a row's
                    for name in names:
                        t0 = time.perf_counter()
                        planned = runner.plan(pre, ours[name])  # one reconstruction
                        res = runner.evaluate(pre, ours[name], max_new_tokens=max_new,
                                              planned=planned)  # fmt: skip
                        answer = tok.decode(res.tokens, skip_special_tokens=True)
                        extra = {"prefill_s": prefill_s, **plan_memory(planned)}
                        if "reconstruct_s" in pre.timings:
                            extra["reconstruct_s"] = pre.timings["reconstruct_s"]
                        _append(out, (*case, mode, name), sha, len(c_ids) + len(q_ids), answer,
                                doc, task_obj, time.perf_counter() - t0, max(res.kept_tokens),
                                **extra)  # fmt: skip
                if todo:
                    spent += time.perf_counter() - t_case
                    answered += len(todo)
                    print(f"ruler: {model_name} {length} {task} #{index}: {len(todo)} answers, "
                          f"{spent / answered:.1f} s an answer so far (prefill and "
                          "reconstruction included)", flush=True)  # fmt: skip
            run_peers(args, model_name, length, peer_cases, out)


def _append(out: Path, key, sha, n, answer, doc, task_obj, seconds, kept, **extra) -> None:
    """One answer as a JSON line of `out`, scored by the task's own `process_results`:
    `key` is `(model, length, task, index, mode, method)`."""
    model, length, task, index, mode, method = key
    row = {
        "model": model, "length": length, "task": task, "index": index, "mode": mode,
        "method": method, "prompt": sha, "prompt_tokens": n,
        "score": task_obj.process_results(doc, [answer])[str(length)],
        "answer": answer, "expected": doc["outputs"], "seconds": seconds,
        "kept_tokens": kept, **extra,
    }  # fmt: skip
    with out.open("a") as f:
        f.write(json.dumps(row) + "\n")


def _append_error(out: Path, key, sha, n, error: str, seconds) -> None:
    """A request the press failed, as a JSON line with its `error` and no score (so a
    resumed run does not retry it, and the table counts it apart)."""
    model, length, task, index, mode, method = key
    row = {"model": model, "length": length, "task": task, "index": index, "mode": mode,
           "method": method, "prompt": sha, "prompt_tokens": n, "score": None,
           "error": error, "seconds": seconds}  # fmt: skip
    with out.open("a") as f:
        f.write(json.dumps(row) + "\n")


HEADER = """# RULER under pagekv's eviction, on lm-evaluation-harness's own task code

Made by `python experiments/ruler.py --table docs/ruler.md` from the answers in
`docs/ruler.jsonl` (one JSON line per answer; the command is resumable, see its
docstring). lm-eval 0.4.13 builds each prompt (its RULER tasks that need no download,
seeded as its `simple_evaluate` seeds them, sized with the model's tokenizer to the
length named) and scores each answer (`process_results`: RULER's `string_match_all`,
the fraction of the expected strings the answer contains). pagekv's runner prefills
each prompt once per question mode and that prefill serves every method; prompts are
raw (no chat template), answers greedy, at most the task's `max_gen_toks` tokens.
`inside`: the whole prompt is compressed (the question's queries score the cache);
`after`: the context alone, then the question (the prompt's last paragraph) is
prefilled into the evicted cache. Methods: the full cache; mean pooling, Page-EntroKV
(`entropy`) and head-independent selection at 10 % and 20 % of the prompt, pages of
16, 4 sink tokens, a window of 32. Each cell: the mean score over the samples (their
count in brackets); `mean`: the mean of the task means; `seconds`: the decode-side
time of those answers (eviction and decode, not the prefills; a kvpress row's, its
whole pipeline), on the 2-core CPU machine. Where a kvpress press ran (`--peers`), its
rows at each budget it ran at, and `PRESS at METHOD's memory`: per prompt, the press's
run with the most physical memory that is at most METHOD's (the tokens of the 16-token
pages the kept set touches, in the (layer, KV head) that touches most; ours keeps whole
pages); `(N over)`: prompts where no run fits and its smallest stands in. Since the
presses have answered fewer samples than ours, each block where one ran is followed by
the same table on the prompts every press answered, every method on those alone.

The question-agnostic comparison (qwen-coder-0.5b, question after: `--ours agnostic`):
our rows scored by the reconstruction pass (`reconstruct/`: the model reads "Repeat the
previous context exactly." and the prompt again; no question), with one budget shared
by every (layer, KV head) (`global`) or a budget per (layer, KV head) (`uniform`), in
pages of 16 or of 1; kvpress's KVzip (its own reconstruction scores, computed once per
prompt and applied at each budget, the kept sets its pipeline's), KeyDiff and ChunkKV
(chunks of 16 tokens, scored by KeyDiff), none of which sees the question. Each answer
records the physical memory of its kept set in two measures, in 16-token pages
(`experiments/ruler_memory.py`): `pages_sum`, the pages touched summed over every
(layer, KV head) (a cache paged per (layer, KV head), as pagekv's decode pool: for our
rows in pages of 16 it is the pool's size, `tests/test_ruler_memory.py`), and
`pages_max`, the fullest (layer, KV head)'s pages times their count (a cache giving
every one the same pages). The table after that block's grids matches, per prompt,
each press's run with the most memory at most ours, in each measure: `press vs ours`
are both means of task means on those prompts; `memory` is ours as a share of the
full cache. `docs/ruler_memory.svg` draws score against memory (its numbers:
`docs/ruler_memory.json`).
"""


def table(rows: list[dict]) -> str:
    """Markdown: per model, length and question mode, a row per method with each
    task's mean score (samples) and the total seconds; where a press ran, also the
    press at equal physical memory to our rows: in a block whose rows carry both
    measures (`ruler_memory`), a table of our question-agnostic rows against each
    press in each measure; else, rows of each press at our entropy and mean rows'
    memory (`physical_match`). Failed requests are counted under their block."""
    failed = [r for r in rows if r.get("score") is None]
    rows = [r for r in rows if r.get("score") is not None]
    theirs = {r["method"] for r in rows} - OUR_METHODS
    presses = sorted({press_of(m) for m in theirs})
    measured = {_block_of(r) for r in rows if r["method"] in OUR_METHODS and "pages_sum" in r}
    matched = [m for p in presses for b in BUDGETS for pool in POOLINGS
               for m in physical_match(rows, p, f"{pool} {round(100 * b)}%")
               if _block_of(m) not in measured]  # fmt: skip
    cells = defaultdict(list)
    for r in rows + matched:
        cells[(*_block_of(r), r["method"], r["task"])].append(r)
    lines = []
    by_budget = sorted(theirs, key=lambda m: (press_of(m), float(m.split(" ")[1][:-1])))
    order = [*methods(), *[m for m in agnostic_methods() if m not in methods()], *by_budget,
             *sorted({r["method"] for r in matched})]  # fmt: skip
    for key in sorted({_block_of(r) for r in rows}):
        lines += [f"### {key[0]}, {key[1]} tokens, question {key[2]}", ""]
        lines += _grid(cells, key, order)
        block = [r for r in rows if _block_of(r) == key]
        # Our rows average more samples than a press's: the prompts every press answered,
        # every method on those alone.
        by_press = defaultdict(set)
        for r in block:
            if r["method"] in theirs:
                by_press[press_of(r["method"])].add((r["task"], r["index"]))
        asked = set.intersection(*by_press.values()) if by_press else set()
        if asked:
            same = {
                k: [r for r in got if (r["task"], r["index"]) in asked]
                for k, got in cells.items()
                if k[:3] == key
            }
            lines += [f"On the {len(asked)} prompts every press answered:", ""]
            lines += _grid(same, key, order)
        if key in measured and by_press:
            ours = [m for m in agnostic_methods() if m != "full"]
            lines += ["At equal physical memory (`ruler_memory`): per prompt, each press's "
                      "run with the most memory that is at most ours, in each measure; "
                      "`press vs ours (prompts, N over)`, on the prompts both answered. "
                      "The score and memory columns are ours over every prompt it "
                      "answered:", ""]  # fmt: skip
            lines += equal_memory_table(block, ours, sorted(by_press))
        lost = defaultdict(list)
        for r in failed:
            if _block_of(r) == key:
                lost[r["method"]].append(r)
        if lost:
            counts = ", ".join(f"{m} {len(v)}" for m, v in sorted(lost.items()))
            first = next(iter(lost.values()))[0]["error"]
            lines += [f"Requests the press failed (not in the means): {counts}; the first "
                      f"said: {first}", ""]  # fmt: skip
    return "\n".join(lines)


def memory_summary(rows: list[dict]) -> dict:
    """What the app's lesson 8 and the docs read of the comparison at equal physical
    memory (written beside the figure as JSON): the first block whose rows carry the
    memory measures, `title`, `prompts` (those every method there answered) and on
    them each measure's `curves` (`ruler_memory.curves`), and `equal_memory` (per prompt
    each press against our question-agnostic rows, on every prompt)."""
    rows = [r for r in rows if r.get("score") is not None and r.get("pages_sum") is not None]
    if not rows:
        raise SystemExit("ruler: no answers record their memory; run with --ours agnostic")
    key = min(_block_of(r) for r in rows)
    block = [r for r in rows if _block_of(r) == key]
    asked: dict[str, set] = defaultdict(set)
    for r in block:
        asked[r["method"]].add((r["task"], r["index"]))
    common = set.intersection(*asked.values())
    same = [r for r in block if (r["task"], r["index"]) in common]
    presses = sorted({press_of(m) for m in asked} - {press_of(m) for m in OUR_METHODS})
    return {
        "block": list(key),
        "title": f"RULER, {key[0]}, {key[1]} tokens, question {key[2]}: the {len(common)} "
        "prompts every method answered",
        "prompts": len(common),
        "curves": {m: curves(same, m) for m in MEASURES},
        "equal_memory": equal_memory(
            block, [m for m in agnostic_methods() if m != "full"], presses
        ),  # fmt: skip
    }


def memory_figure(rows: list[dict]) -> str:
    """`ruler_memory.figure_svg` of `memory_summary(rows)`."""
    summary = memory_summary(rows)
    return figure_svg(summary["curves"], summary["title"])


def _block_of(r: dict) -> tuple:
    return r["model"], r["length"], r["mode"]


def _grid(cells: dict, key: tuple, order: list[str]) -> list[str]:
    """One Markdown table: a row per method of `order` that has answers under `key`."""
    lines = ["| method | " + " | ".join(TASKS) + " | mean | seconds |"]
    lines.append("|---" * (len(TASKS) + 3) + "|")
    for name in order:
        row, scores, seconds, over = [], [], 0.0, 0
        for task in TASKS:
            got = cells.get((*key, name, task), [])
            if got:
                mean = sum(r["score"] for r in got) / len(got)
                scores.append(mean)
                seconds += sum(r["seconds"] for r in got)
                over += sum(r.get("over", False) for r in got)
                row.append(f"{mean:.2f} ({len(got)})")
            else:
                row.append("-")
        if scores:
            avg = f"{sum(scores) / len(scores):.2f}"
            label = f"{name} ({over} over)" if over else name
            lines.append(f"| {label} | " + " | ".join(row) + f" | {avg} | {seconds:.0f} |")
    return [*lines, ""]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["bundled"])
    ap.add_argument("--lengths", nargs="+", type=int, default=[2048])
    ap.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    ap.add_argument("--samples", type=int, default=SAMPLES,
                    help="our rows answer the first N documents of each task")  # fmt: skip
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--ours", nargs="+", default=["window"], choices=tuple(OURS),
                    help="our rows: window-scored, question-agnostic")  # fmt: skip
    ap.add_argument("--peers", nargs="*", default=[], choices=tuple(PEERS),
                    help="kvpress presses to run too (in kvpress's own environment)")  # fmt: skip
    ap.add_argument("--peer-samples", type=int, default=None,
                    help="presses answer the first N documents (default --samples)")  # fmt: skip
    ap.add_argument("--peer-budgets", nargs="*", type=float, default=None,
                    help="presses' budgets (fractions kept); default: ours, swept")  # fmt: skip
    ap.add_argument("--peer-sweep", nargs="*", type=float, default=[],
                    help="also run the presses at these fractions of each budget")  # fmt: skip
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument("--out", default="docs/ruler.jsonl")
    ap.add_argument("--table", default=None, help="write the Markdown table here (and run nothing "
                    "with --table-only)")  # fmt: skip
    ap.add_argument("--table-only", action="store_true")
    ap.add_argument("--figure", default=None,
                    help="write the memory figure here (SVG; its numbers: .json)")  # fmt: skip
    args = ap.parse_args(argv)
    if not args.table_only:
        run(args)
    if args.table:
        rows = [json.loads(x) for x in Path(args.out).read_text().splitlines() if x.strip()]
        Path(args.table).write_text(HEADER + "\n" + table(rows) + "\n")
        print(f"ruler: wrote {args.table} from {len(rows)} answers")
    if args.figure:
        rows = [json.loads(x) for x in Path(args.out).read_text().splitlines() if x.strip()]
        summary = memory_summary(rows)
        Path(args.figure).write_text(figure_svg(summary["curves"], summary["title"]))
        data = Path(args.figure).with_suffix(".json")
        data.write_text(json.dumps(summary, indent=1) + "\n")
        print(f"ruler: wrote {args.figure} and {data}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
