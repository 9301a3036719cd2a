r"""RULER, built and scored by lm-evaluation-harness's own task code, under pagekv's
eviction policies.

    python experiments/ruler.py [--models bundled qwen-coder-0.5b] [--lengths 2048]
        [--samples 20] [--minutes 60] [--out assets/results/ruler.jsonl]
        [--table docs/ruler.md] [--figure docs/ruler_memory.svg]

For each model, length (lm-eval's `max_seq_lengths`), task and sample, lm-eval's task
code builds the prompt (offline: the six RULER tasks that need no download) and scores
the answers, and pagekv's runner answers it under every method (question `after`:
`lm_eval_model.split_question`); `HEADER`, the table's preamble, says how.

Resumable: each answer is one JSON line appended to `--out`, and a case already there
is skipped, so the command can be run again (`--minutes` stops it starting new
prompts). `--table` writes the Markdown table of everything in `--out`: per model,
length, question mode and method, each task's mean score, the samples behind it and
the seconds they took. `--figure` draws score against memory (SVG) and writes its
numbers, which the app's lessons read, beside `--out` (`ruler_memory.json`: by default
`pagekv.paths.RULER_MEMORY_PATH`).

`--ours agnostic` adds the question-agnostic rows (`agnostic_methods`: the reconstruction
pass scores the prompt; one prefill and one reconstruction pass per prompt serve every
row of ours). `--peers snapkv kvzip keydiff chunkkv none` adds NVIDIA kvpress's presses
(`experiments.peer`: kvpress's own pipeline in its own environment, on the same token
ids, one batch per task; `PEERS` their options; `none`, its pipeline without a press) at
`--peer-budgets` (default: ours, and `--peer-sweep` fractions of them), on the first
`--peer-samples` documents. Every answer row records the memory of its kept set
(`experiments/ruler_memory.py`: the pages it takes in three cache layouts), and the
table matches, per prompt and layout, each rival's run nearest ours in memory. A row
answered before its `gathered` memory was recorded gets it when the command runs again
over its prompt: ours from the plan re-made on the same prefill, a press's from the
press run again for one token.

The question-agnostic comparison at equal memory (the run that made docs/ruler.md's
qwen-coder-0.5b block; `--samples 10` first gives every method the prompts the presses
answered)::

    python experiments/ruler.py --models qwen-coder-0.5b --modes after --ours agnostic \
        --samples 20 --peers kvzip keydiff chunkkv --peer-samples 10 \
        --peer-budgets 0.01 0.02 0.05 0.1 0.2 --table docs/ruler.md \
        --figure docs/ruler_memory.svg
    # KVzip at two more budgets (its scores are computed once a prompt), and kvpress's
    # pipeline without a press beside our full cache (one runtime against the other):
    python experiments/ruler.py --models qwen-coder-0.5b --modes after --ours agnostic \
        --samples 20 --peers kvzip none --peer-samples 10 \
        --peer-budgets 0.01 0.02 0.03 0.05 0.07 0.1 0.2 --table docs/ruler.md \
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
    LAYOUTS,
    compare,
    curves,
    equal_memory,
    equal_memory_table,
    family_of,
    figure_svg,
    fraction,
    gathered,
    memory_fields,
    plan_memory,
    press_of,
    task_mean,
    verdict,
)
from pagekv import EvictionConfig  # noqa: E402
from pagekv.integrations.lm_eval_model import (  # noqa: E402
    RULER_OFFLINE_TASKS as TASKS,
)
from pagekv.paths import RULER_MEMORY_PATH, RULER_RESULTS_PATH  # noqa: E402

#: The methods compared: the two poolings the app contrasts, and the per-head
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


#: The question-agnostic rows' budgets and page sizes.
AGNOSTIC_BUDGETS = (0.05, 0.1, 0.2)
AGNOSTIC_PAGES = (16, 4, 1)


def agnostic_name(policy: str, budget: float, page_size: int, allocation="global") -> str:
    """`"entropy reconstruct/global 10%"` in pages of 16, `"... 10% (pages of 4)"` else."""
    name = f"{policy} reconstruct/{allocation} {round(100 * budget)}%"
    return name if page_size == PAGE else f"{name} (pages of {page_size})"


def agnostic_methods() -> dict[str, EvictionConfig]:
    """The question-agnostic rows (`--ours agnostic`): the reconstruction pass scores
    the prompt (`scorer="reconstruct"`); mean and entropy pooling with one budget
    shared by every (layer, KV head) (`allocation="global"`) at 5, 10 and 20 %, in pages
    of 16, 4 and 1 (pages against tokens in our own engine), and entropy with a budget
    per (layer, KV head) (`"uniform"`) at 10 and 20 % in pages of 16."""
    out = {"full": EvictionConfig(policy="full")}
    for page in AGNOSTIC_PAGES:
        for budget in AGNOSTIC_BUDGETS:
            for policy in POOLINGS:
                out[agnostic_name(policy, budget, page)] = EvictionConfig(
                    policy=policy, budget=budget, allocation="global", scorer="reconstruct",
                    page_size=page,
                )  # fmt: skip
    for budget in BUDGETS:
        out[agnostic_name("entropy", budget, PAGE, "uniform")] = EvictionConfig(
            policy="entropy", budget=budget, scorer="reconstruct", page_size=PAGE
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
    default at each of ours and each `sweep` fraction of it; `"none"` (kvpress's
    pipeline without a press: its full cache) at 100 % alone."""
    if not budgets:
        budgets = sorted({round(b * f, 4) for b in BUDGETS for f in (1.0, *sweep)})
    return {f"{p} {100 * b:g}%": (p, b) for p in peers
            for b in ([1.0] if p == "none" else sorted(budgets))}  # fmt: skip


#: The presses `--peers` runs, and their options: SnapKV's window as ours; ChunkKV
#: in chunks of a page, around KeyDiff (question-agnostic); KVzip scores each prompt
#: once for every budget (`reuse_scores`: tests/test_kvpress_peer.py shows the kept
#: sets are its pipeline's).
PEERS = {
    "snapkv": dict(press_kwargs={"window_size": 32}),
    "kvzip": dict(reuse_scores=True),
    "keydiff": {},
    "chunkkv": dict(press_kwargs={"scorer": "keydiff", "chunk_length": PAGE}),
    "none": {},
}


def run_peers(args, model_name, length, cases, out: Path) -> None:
    """kvpress's presses on `cases` (`(task, index, prompt sha, c_ids, q_ids, max_new,
    doc, task object, todo)`), one batch for all, each answer scored and appended with
    its memory (`ruler_memory.memory_fields` of its kept tokens per (layer, KV head)); a
    request the press fails is appended with its `error` and no score. A `todo` entry
    `(mode, name, True)` is a row answered before without `gathered_pages`: its press runs
    again for one token, and only the memory of its kept set is written into that row
    (`backfill_memory`)."""
    from experiments.peer import kvpress_peer as kp

    requests, meta = [], {}
    theirs = peer_methods(args.peers, args.peer_sweep, args.peer_budgets)
    for task, index, sha, c_ids, q_ids, max_new, doc, task_obj, todo in cases:
        for mode, name, *again in todo:
            press, budget = theirs[name]
            ids = dict(input_ids=c_ids + q_ids) if mode == "inside" else dict(
                context_ids=c_ids, question_ids=q_ids)  # fmt: skip
            rid = f"{task}/{index}/{mode}/{name}"
            new = 1 if again else max_new
            requests.append(kp.make_request(rid, press, budget=budget, max_new_tokens=new,
                                            **PEERS.get(press, {}), **ids))  # fmt: skip
            compressed = len(c_ids) + (len(q_ids) if mode == "inside" else 0)
            meta[rid] = (task, index, sha, mode, name, doc, task_obj, len(c_ids) + len(q_ids),
                         compressed, bool(again))  # fmt: skip
    if not requests:
        return
    # KVzip answers in up to ~2 minutes on the 2-core CPU: the batch's limit grows with it.
    timeout = max(kp.RUN_TIMEOUT, 300 * len(requests))
    results = kp.run_kvpress(kp.bundled_model_dir(model_name), requests, timeout, progress=None)
    found = {}
    for res in results:
        task, index, sha, mode, name, doc, task_obj, n, compressed, again = meta[res["id"]]
        key = (model_name, length, task, index, mode, name)
        if again:
            pages = (res.get("touched_pages") or {}).get("16")
            if res.get("error") or not pages:
                print(f"ruler: {res['id']}: no memory re-measured: {res.get('error')}")
            else:
                found[key] = memory_fields(pages, compressed, kept=res["attended_tokens"])
            continue
        if res.get("error"):
            print(f"ruler: {res['id']}: {res['error']}")
            _append_error(out, key, sha, n, res["error"], res.get("seconds"))
            continue
        pages = (res.get("touched_pages") or {}).get("16")
        # The tokens a (layer, KV head) attends to: a masking press (KVzip) keeps the
        # whole context in its cache and hides the rest, so its cache length says nothing.
        att = [c for row in res["attended_tokens"] for c in row]
        mem = memory_fields(pages, compressed, kept=res["attended_tokens"]) if pages else {}
        _append(out, key, sha, n, res["answer"], doc, task_obj, res.get("seconds"),
                round(sum(att) / len(att)), kept_tokens_max=max(att),
                reused_scores=res.get("reused_scores", False), **mem)  # fmt: skip
    if found:
        backfill_memory(out, found)


def backfill_memory(path: Path, found: dict[tuple, dict]) -> None:
    """Write `found` (`(model, length, task, index, mode, method)` -> memory fields of a
    row answered before `gathered_pages` was recorded, from its plan re-made on the same
    prefill) into those rows of `path`. A re-made plan whose `pages_sum` differs from
    the row's is not the plan that answered: it is reported and that row left as it was."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for r in rows:
        key = (r["model"], r["length"], r["task"], r["index"], r["mode"], r["method"])
        if key in found:
            if r.get("pages_sum") != found[key]["pages_sum"]:
                print(f"ruler: {key}: the re-made plan touches {found[key]['pages_sum']} "
                      f"pages, the row {r.get('pages_sum')}: left as it was")  # fmt: skip
                continue
            r.update(found[key])
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(path)


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


def unmeasured_cases(path: Path) -> set[tuple]:
    """The rows of `path` that record their memory but not their `gathered` pages, nor
    anything that fixes them (`rows_with_memory`)."""
    if not path.exists():
        return set()
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {(r["model"], r["length"], r["task"], r["index"], r["mode"], r["method"])
            for r in rows_with_memory(rows) if r.get("score") is not None
            and r.get("pages_sum") is not None and gathered(r) is None}  # fmt: skip


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
    unmeasured = unmeasured_cases(out)
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
            built = list(prompts(args.tasks, tokenizer_name(model_name), length,
                                 max(args.samples, peer_samples)))  # fmt: skip
            if not args.peers:  # sample by sample over the tasks: a stopped run stays balanced
                built.sort(key=lambda p: (p[1], args.tasks.index(p[0])))
            for task, index, prompt, max_new, doc, task_obj in built:
                sha = prompt_sha(prompt)
                case = (model_name, length, task, index)
                check_same_prompt(done, case, sha)
                if peer_cases and peer_cases[-1][0] != task:  # a task's batch is complete
                    run_peers(args, model_name, length, peer_cases, out)
                    peer_cases = []
                todo = [(m, n) for m in args.modes for n in ours
                        if (*case, m, n) not in done and index < args.samples]  # fmt: skip
                refill = [(m, n) for m in args.modes for n in ours
                          if (*case, m, n) in unmeasured and index < args.samples]  # fmt: skip
                peer_todo = [(m, n) for m in args.modes for n in theirs
                             if (*case, m, n) not in done and index < peer_samples]  # fmt: skip
                peer_todo += [(m, n, True) for m in args.modes for n in theirs
                              if (*case, m, n) in unmeasured and index < peer_samples]  # fmt: skip
                if not todo and not peer_todo and not refill:
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
                    again = [name for m, name in refill if m == mode]
                    if not names and not again:
                        continue
                    t0 = time.perf_counter()
                    pre = prefill(runner, c_ids, q_ids, mode, window)
                    prefill_s = time.perf_counter() - t0
                    if any(ours[n].scorer == "reconstruct" for n in names + again):
                        runner.reconstruction(pre)  # once, in `reconstruct_s`, not a row's
                    if again:  # rows answered before: their plans re-made, memory recorded
                        backfill_memory(out, {(*case, mode, n): plan_memory(
                            runner.plan(pre, ours[n])) for n in again})  # fmt: skip
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
                if todo or refill:
                    spent += time.perf_counter() - t_case
                    answered += len(todo) or 1
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


TITLE = "# RULER under pagekv's eviction, on lm-evaluation-harness's own task code"
HEADER = """Made by `python experiments/ruler.py --table docs/ruler.md --figure
docs/ruler_memory.svg` from the answers in `assets/results/ruler.jsonl` (one JSON line
per answer; the command is resumable, see its docstring). lm-eval 0.4.13 builds each prompt (its
RULER tasks that need no download, seeded as its `simple_evaluate` seeds them, sized
with the model's tokenizer to the length named) and scores each answer
(`process_results`: RULER's `string_match_all`, the fraction of the expected strings the
answer contains). pagekv's runner prefills each prompt once per question mode and that
prefill serves every method; prompts are raw (no chat template), answers greedy, at most
the task's `max_gen_toks` tokens. `inside`: the whole prompt is compressed (the
question's queries score the cache); `after`: the context alone, then the question (the
prompt's last paragraph) is prefilled into the evicted cache. Window-scored methods:
the full cache; mean pooling, Page-EntroKV (`entropy`) and head-independent selection
at 10 % and 20 % of the prompt, pages of 16, 4 sink tokens, a window of 32. Each cell:
the mean score over the samples (their count in brackets); `mean`: the mean of the task
means; `seconds`: the time of those answers on the 2-core CPU machine: eviction and
decode, plus for a row scored by the reconstruction pass that pass (`reconstruct_s`,
one per prompt, which every such row of the prompt would pay alone); not the prefills;
a kvpress row's, its whole pipeline (KVzip's first budget on a prompt includes its
scoring, which its other budgets reuse). Our rows decode with float16 linear weights
(the runner's default on the CPU), kvpress's presses in float32.

The question-agnostic comparison (qwen-coder-0.5b, question after: `--ours agnostic`):
our rows scored by the reconstruction pass (`reconstruct/`: the model reads "Repeat the
previous context exactly." and the prompt again; no question), with one budget shared
by every (layer, KV head) (`global`) in pages of 16, 4 and 1, or a budget per (layer,
KV head) (`uniform`) in pages of 16; kvpress's KVzip (its own reconstruction scores,
computed once per prompt and applied at each budget), KeyDiff and ChunkKV (chunks of 16
tokens, scored by KeyDiff), none of which sees the question. Each answer's kept set is
costed in three cache layouts, in 16-token pages (`experiments/ruler_memory.py`):
`gathered` (each (layer, KV head)'s kept tokens rounded up to whole pages: pagekv's own
decode pool, KVzip's flattened cache, any cache that compacts), `in_place` (the pages
the kept tokens touch, per (layer, KV head): a paged cache that frees whole blocks and
never moves a token) and `uniform` (the fullest (layer, KV head)'s pages times their
count: a cache that gives every KV head of a layer the same blocks). The tables at
equal memory match, per prompt and layout, each rival's run (any budget) whose memory is
nearest ours, if within 10 % of it; prompts where none is are left out and counted.
Differences are `rival - ours` in means of task means on the matched prompts, with a
95 % bootstrap interval over prompts resampled within each task; an interval that
crosses 0 is a tie.
"""

#: The row of ours the summary and lesson 8 compare, per budget (pages of 16), and the
#: rivals beside it: two kvpress presses and ours at token level.
REFERENCE = "entropy reconstruct/global {pct}%"
RIVALS = ("kvzip", "chunkkv", "entropy reconstruct/global (pages of 1)")
SUMMARY_BUDGETS = (10, 20)
RIVAL_LABELS = {"kvzip": "KVzip", "chunkkv": "ChunkKV",
                "entropy reconstruct/global (pages of 1)": "ours in pages of 1"}  # fmt: skip


def rows_with_memory(rows: list[dict]) -> list[dict]:
    """`rows` with what fixes their `gathered` memory where they did not record it
    (`ruler_memory.gathered`): our rows' `page_size`, ChunkKV's `chunk_length`, and
    `per_head_count` for the presses that keep the same count in every head."""
    ours = {**methods(), **agnostic_methods()}
    out = []
    for r in rows:
        extra = {}
        if r["method"] in ours and ours[r["method"]].policy != "full":
            extra["page_size"] = ours[r["method"]].page_size
        elif press_of(r["method"]) == "chunkkv":
            extra["chunk_length"] = PEERS["chunkkv"]["press_kwargs"]["chunk_length"]
        elif press_of(r["method"]) in ("keydiff", "snapkv"):
            extra["per_head_count"] = True
        out.append(r | extra if extra else r)
    return out


def memory_block(rows: list[dict]) -> tuple[tuple, list[dict]] | None:
    """The first block whose rows of ours record their memory, and its scored rows
    (`rows_with_memory`); None where no block does."""
    rows = rows_with_memory([r for r in rows if r.get("score") is not None])
    ours = [r for r in rows if r["method"] in OUR_METHODS and r.get("pages_sum") is not None]
    measured = sorted({_block_of(r) for r in ours})
    if not measured:
        return None
    return measured[0], [r for r in rows if _block_of(r) == measured[0]]


def leads(block: list[dict]) -> list[dict]:
    """Per layout and summary budget, `REFERENCE` against each of `RIVALS` at equal
    memory (`ruler_memory.compare`), each with its `verdict` in words."""
    out = []
    for layout in LAYOUTS:
        for pct in SUMMARY_BUDGETS:
            ours = REFERENCE.format(pct=pct)
            for rival in RIVALS:
                c = compare(block, rival, ours, layout)
                if c is not None:
                    out.append(c | {"budget": pct, "says": verdict(c, rival, "ours")})
    return out


def summary_lines(block: list[dict]) -> list[str]:
    """docs/ruler.md's opening: a line per layout and budget, who leads at equal memory
    and by how much, with the interval and the prompts behind it."""
    lines, compared = [], leads(block)  # every comparison once (each bootstraps)
    for layout in LAYOUTS:
        for pct in SUMMARY_BUDGETS:
            got = [c for c in compared if c["layout"] == layout and c["budget"] == pct]
            if not got:
                continue
            parts = []
            for c in got:
                name = RIVAL_LABELS.get(c["rival"], c["rival"])
                says = verdict(c, name, "ours")
                if c["leader"] != "none":
                    left = f" ({c['unmatched']} with no run within 10 %)" if c["unmatched"] else ""
                    says += f", {c['prompts']} prompts{left}"
                parts.append(f"against {name}: {says}")
            lines.append(f"- **{layout}, ours at {pct} %** (entropy, reconstruction scorer, "
                         f"shared budget, pages of 16): " + "; ".join(parts) + ".")  # fmt: skip
    return lines


def scoring_cost(block: list[dict]) -> dict | None:
    """Our scoring pass against KVzip's on the prompts KVzip answered: our mean
    `reconstruct_s` a prompt (each prompt's least, as runs of it that shared the cores
    with other work record more), and KVzip's scoring estimated per prompt as its first run
    (scoring and one answer) less the median of its runs that reused the scores (an
    answer alone)."""
    import statistics

    ours: dict = {}
    for r in block:  # the fastest record of a prompt's pass: the least disturbed by other work
        if r.get("reconstruct_s") is not None:
            key = (r["task"], r["index"])
            ours[key] = min(ours.get(key, r["reconstruct_s"]), r["reconstruct_s"])
    runs = defaultdict(list)
    for r in block:
        if press_of(r["method"]) == "kvzip" and r.get("seconds") is not None:
            runs[(r["task"], r["index"])].append(r)
    theirs = {}
    for key, got in runs.items():
        first = [r["seconds"] for r in got if not r.get("reused_scores")]
        reused = [r["seconds"] for r in got if r.get("reused_scores")]
        if first and reused and key in ours:
            theirs[key] = min(first) - statistics.median(reused)
    if not theirs:
        return None
    return {"prompts": len(theirs), "ours_s": sum(ours[k] for k in theirs) / len(theirs),
            "kvzip_s": sum(theirs.values()) / len(theirs)}  # fmt: skip


def runtime_check(block: list[dict]) -> dict | None:
    """Our full cache (float16 linear weights in the decode) against kvpress's pipeline
    without a press (`none 100%`: its full cache, float32) on the prompts both answered:
    how many answers are the same text, and both means of task means."""
    theirs = {(r["task"], r["index"]): r for r in block if r["method"] == "none 100%"}
    ours = {(r["task"], r["index"]): r for r in block if r["method"] == "full"}
    both = sorted(set(theirs) & set(ours))
    if not both:
        return None
    same = sum(theirs[k]["answer"].strip() == ours[k]["answer"].strip() for k in both)
    return {"prompts": len(both), "same": same,
            "ours": task_mean([ours[k] for k in both]),
            "kvpress": task_mean([theirs[k] for k in both])}  # fmt: skip


def table(rows: list[dict]) -> str:
    """Markdown: the summary at equal memory (`summary_lines`), then per model, length
    and question mode a row per method with each task's mean score (samples) and the
    seconds; in the block whose rows record memory, the same on the prompts every press
    answered, pages against tokens in our own engine, each press against our rows at
    equal memory in each layout, and the scoring passes' cost. Failed requests are
    counted under their block."""
    failed = [r for r in rows if r.get("score") is None]
    rows = [r for r in rows if r.get("score") is not None]
    theirs = {r["method"] for r in rows} - OUR_METHODS
    cells = defaultdict(list)
    for r in rows:
        cells[(*_block_of(r), r["method"], r["task"])].append(r)
    lines = [TITLE, ""]
    measured = memory_block(rows)
    if measured:
        key, block = measured
        lines += [f"At equal memory ({key[0]}, {key[1]} tokens, question {key[2]}; "
                  "`rival - ours`, 95 % interval):", ""]  # fmt: skip
        lines += [*summary_lines(block), ""]
    lines += [HEADER, ""]
    by_budget = sorted(theirs, key=lambda m: (press_of(m), float(m.split(" ")[1][:-1])))
    order = [*methods(), *[m for m in agnostic_methods() if m not in methods()], *by_budget]
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
        if measured and key == measured[0]:
            lines += _memory_section(measured[1], sorted(by_press))
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


def _memory_section(block: list[dict], presses: list[str]) -> list[str]:
    """The memory tables of the block whose rows record it: pages against tokens, each
    press at equal memory, and the scoring passes' cost."""
    lines = ["Pages against tokens in our own engine: each of our shared-budget rows' mean "
             "memory in each layout (share of the full cache, over the prompts where it is "
             "known) and its score over every prompt it answered:", "",
             "| ours | score (prompts) | gathered | in place | uniform |",
             "|---|---|---|---|---|"]  # fmt: skip
    for name in agnostic_methods():
        got = [r for r in block if r["method"] == name and r.get("pages_sum") is not None]
        if not got:
            continue
        mem = []
        for lay in LAYOUTS:
            known = [f for f in (fraction(r, lay) for r in got) if f is not None]
            mem.append(f"{sum(known) / len(known):.1%}" if known else "-")
        lines.append(f"| {name} | {task_mean(got):.2f} ({len(got)}) | " + " | ".join(mem) + " |")
    lines += [""]
    ours = [REFERENCE.format(pct=p) for p in (5, *SUMMARY_BUDGETS)]
    tokens = [family_of(agnostic_name("entropy", 0.1, p)) for p in AGNOSTIC_PAGES[1:]]
    lines += ["Ours in pages of 16 against ours in pages of 4 and 1, at equal memory:", ""]
    lines += equal_memory_table(block, ours, tokens)
    ours += [REFERENCE.replace("global", "uniform").format(pct=p) for p in SUMMARY_BUDGETS]
    lines += ["Each press against our rows at equal memory:", ""]
    lines += equal_memory_table(block, ours, presses)
    same = runtime_check(block)
    if same:
        lines += [f"One runtime: our full cache (float16 linear weights) and kvpress's pipeline "
                  f"without a press (`none 100%`, float32) gave the same answer text on "
                  f"{same['same']} of {same['prompts']} prompts, scoring {same['ours']:.2f} "
                  f"and {same['kvpress']:.2f}.", ""]  # fmt: skip
    cost = scoring_cost(block)
    if cost:
        lines += [f"Scoring cost on the {cost['prompts']} prompts KVzip answered: our "
                  f"reconstruction pass {cost['ours_s']:.1f} s a prompt, KVzip's scoring "
                  f"about {cost['kvzip_s']:.1f} s (its first run less the median of its runs "
                  "that reused the scores), on the 2-core CPU machine.", ""]  # fmt: skip
    return lines


def memory_summary(rows: list[dict]) -> dict:
    """What the app's lessons 2 and 8 and the docs read of the comparison at equal
    memory (written beside the figure as JSON): the block whose rows of ours record
    their memory, `title`, `prompts` (those that the full cache and every method there
    that records memory answered), `full` (the full cache's score on them), on them each
    layout's `curves`
    (`ruler_memory.curves`); `leads` (`leads`, on every prompt) and `equal_memory` of
    our question-agnostic rows against every rival family."""
    measured = memory_block(rows)
    if measured is None:
        raise SystemExit("ruler: no answers record their memory; run with --ours agnostic")
    key, block = measured
    asked: dict[str, set] = defaultdict(set)
    for r in block:  # the methods the figure draws: those that record memory, and full
        if r.get("pages_sum") is not None or r["method"] == "full":
            asked[r["method"]].add((r["task"], r["index"]))
    common = set.intersection(*asked.values())
    # kvpress without a press is the full cache in another runtime (`runtime_check`).
    same = [r for r in block if (r["task"], r["index"]) in common and press_of(r["method"])
            != "none"]  # fmt: skip
    rivals = sorted({family_of(r["method"]) for r in block} - {"full", "none"})
    ours = [REFERENCE.format(pct=p) for p in SUMMARY_BUDGETS]
    return {
        "block": list(key),
        "title": f"RULER, {key[0]}, {key[1]} tokens, question {key[2]}: the {len(common)} "
        "prompts every method answered",
        "prompts": len(common),
        "full": task_mean([r for r in same if r["method"] == "full"]),
        "curves": {lay: curves(same, lay) for lay in LAYOUTS},
        "leads": leads(block),
        "equal_memory": equal_memory(block, ours, rivals),
    }


def memory_figure(rows: list[dict]) -> str:
    """`ruler_memory.figure_svg` of `memory_summary(rows)`."""
    summary = memory_summary(rows)
    return figure_svg(summary["curves"], summary["title"], summary["full"])


def _block_of(r: dict) -> tuple:
    return r["model"], r["length"], r["mode"]


def _grid(cells: dict, key: tuple, order: list[str]) -> list[str]:
    """One Markdown table: a row per method of `order` that has answers under `key`."""
    lines = ["| method | " + " | ".join(TASKS) + " | mean | seconds |"]
    lines.append("|---" * (len(TASKS) + 3) + "|")
    for name in order:
        row, scores, seconds = [], [], 0.0
        for task in TASKS:
            got = cells.get((*key, name, task), [])
            if got:
                mean = sum(r["score"] for r in got) / len(got)
                scores.append(mean)
                seconds += sum(r["seconds"] + (r.get("reconstruct_s") or 0) for r in got)
                row.append(f"{mean:.2f} ({len(got)})")
            else:
                row.append("-")
        if scores:
            avg = f"{sum(scores) / len(scores):.2f}"
            lines.append(f"| {name} | " + " | ".join(row) + f" | {avg} | {seconds:.0f} |")
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
    ap.add_argument("--out", default=str(RULER_RESULTS_PATH))
    ap.add_argument("--table", default=None, help="write the Markdown table here (and run nothing "
                    "with --table-only)")  # fmt: skip
    ap.add_argument("--table-only", action="store_true")
    ap.add_argument("--figure", default=None,
                    help="write the memory figure here (SVG; its numbers: "
                    "ruler_memory.json beside --out)")  # fmt: skip
    args = ap.parse_args(argv)
    if not args.table_only:
        run(args)
    if args.table:
        rows = [json.loads(x) for x in Path(args.out).read_text().splitlines() if x.strip()]
        Path(args.table).write_text(table(rows) + "\n")
        print(f"ruler: wrote {args.table} from {len(rows)} answers")
    if args.figure:
        rows = [json.loads(x) for x in Path(args.out).read_text().splitlines() if x.strip()]
        summary = memory_summary(rows)
        Path(args.figure).write_text(
            figure_svg(summary["curves"], summary["title"], summary["full"])
        )
        data = Path(args.out).with_name(RULER_MEMORY_PATH.name)
        data.write_text(json.dumps(summary, indent=1) + "\n")
        print(f"ruler: wrote {args.figure} and {data}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
