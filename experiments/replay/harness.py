"""`run_replay`: measure the paper's claims on one model and write tables and figures.

    python -m pagekv replay --model bundled --out runs/replay [--quick] [--no-peer]

Resumable: every finished unit (a prompt's profile-only measurements, one decoded
configuration, one peer request) is appended to `OUT/units.jsonl` and skipped by a
re-run; a prompt whose units are all done is not even prefilled again.
"""

from __future__ import annotations

import os
import platform
import sys
import time
from dataclasses import asdict
from functools import partial
from pathlib import Path

import torch

from experiments.replay import report, tables
from experiments.replay.grid import FULL, QUICK, Grid
from experiments.replay.jobs import PromptJob, build_jobs
from experiments.replay.measure import cardinality_unit, decode_unit, profile_unit
from experiments.replay.peer import WANTED, PeerAdapter
from experiments.replay.store import UnitStore, unit_key
from pagekv.engine.study import Study
from pagekv.paths import PRESETS_PATH
from pagekv.tasks import task_names

SEED = 0


def _say(msg: str) -> None:
    print(f"[replay] {msg}", file=sys.stderr, flush=True)


class _Lazy:
    """Loads the model only when a unit actually needs it (a fully cached re-run never does)."""

    def __init__(self, model, device, backend, decode_dtype="auto"):
        self.args = (model, device, backend, decode_dtype)
        self._study = None

    @property
    def study(self) -> Study:
        if self._study is None:
            from pagekv.runtime.models import load_model

            model, device, backend, decode_dtype = self.args
            _say(f"loading model {model!r} ...")
            loaded = load_model(model, device=device, allow_fallback=True)
            if loaded.fell_back:
                _say(loaded.note)
            self._study = Study(loaded, backend=backend, memo_size=1, decode_dtype=decode_dtype)
            _say(
                f"model {loaded.name} ({loaded.n_layers} layers, {loaded.n_heads} heads, "
                f"{loaded.n_kv_heads} KV heads) on {loaded.device}, "
                f"{self._study.runner.backend} backend, decode: {self._study.runner.decode_path}, "
                f"load {loaded.load_s:.1f}s"
            )
        return self._study


def run_replay(
    model: str = "bundled",
    out: str | Path = "runs/replay",
    quick: bool = False,
    peer: bool = True,
    device: str | None = None,
    backend: str = "auto",
    grid: Grid | None = None,
    update_presets: bool = False,
    decode_dtype: str = "auto",
    peer_minutes: float | None = None,
) -> dict:
    """Run the replay grid (`QUICK` or `FULL`, or `grid`) and write everything to `out`.

    With `update_presets` the measured presets also replace the app's tracked
    `assets/presets.json` (never otherwise). `decode_dtype` is the runner's
    (`--dtype`); decode units made with another than "float32" carry it in their key,
    so units cached from the float32 decode are reused only by a float32 run. Returns
    the results dict that is also written to `out/results.json`. `peer_minutes` stops
    sending kvpress batches after that long (`_run_peer`); what finished is kept and
    reported, the rest runs on the next call.
    """
    t_start = time.perf_counter()
    torch.manual_seed(SEED)
    grid = grid or (QUICK if quick else FULL)
    out = Path(out)
    store = UnitStore(out)
    _say(f"grid {grid.name}, output {out} ({store.loaded} cached units)")
    lazy = _Lazy(model, device, backend, decode_dtype)
    jobs = build_jobs(grid, {"qa": task_names("qa"), "code": task_names("code")})
    profile_units, decode_units, card_units, errors = [], [], [], []
    _say(f"{len(jobs)} prompts, {sum(len(j.decodes) for j in jobs)} decodes")
    bar = _progress(len(jobs))
    for i, job in enumerate(jobs):
        keys = _job_keys(model, grid, job, decode_dtype)
        missing = [k for k in keys.values() if k not in store]
        if missing:
            try:
                _compute_job(lazy, store, grid, job, keys)
            except Exception as e:  # a prompt that cannot be built or prefilled
                msg = " ".join(f"{type(e).__name__}: {e}".split())
                errors.append({"spec": job.spec_dict(), "error": msg})
                _say(f"prompt {job.spec_dict()} failed: {msg}")
                bar(i, job, "failed")
                continue
        spec = job.spec_dict()
        if keys["profile"] in store:
            profile_units.append(
                {"spec": spec, "tables": sorted(job.tables), **store.get(keys["profile"])}
            )
        if job.cardinality and keys.get("t5") in store:
            card_units.append({"spec": spec, **store.get(keys["t5"])})
        for tag, cfg, label in job.decodes:
            k = keys[("decode", tag, cfg, label)]
            if k in store:
                decode_units.append(
                    {"spec": spec, "table": tag, "label": label, "config": cfg.to_dict()}
                    | store.get(k)
                )
        bar(i, job, "cached" if not missing else "done")

    peer_adapter = PeerAdapter(peer, quick, model_dir=_peer_model_dir(model), progress=_say)
    peer_units = _run_peer(peer_adapter, lazy, store, model, jobs, grid, peer_minutes)

    wall = time.perf_counter() - t_start
    results = tables.build(
        grid=grid,
        profile_units=profile_units,
        decode_units=decode_units,
        card_units=card_units,
        peer_units=peer_units,
        peer_status=peer_adapter.status(),
    )
    results["meta"] = {
        "command": _command(model, out, quick, peer, grid.name, update_presets),
        "model": model,
        "grid": grid.name,
        "grid_definition": asdict(grid),
        "wall_s": wall,
        "units": store.stats(),
        "prompts": len(jobs),
        "prompt_errors": errors,
        **_environment(lazy),
    }
    report.write_all(out, results, update_presets=PRESETS_PATH if update_presets else None)
    _say(
        f"done in {wall:.0f}s: {store.computed} units computed, {store.reused} reused; "
        f"see {out / 'results.json'}"
    )
    return results


# --------------------------------------------------------------------------- units


def _job_keys(model: str, grid: Grid, job: PromptJob, decode_dtype: str = "float32") -> dict:
    spec = job.spec_dict()
    decode = {} if decode_dtype == "float32" else {"decode": decode_dtype}
    keys = {
        "profile": unit_key(
            unit="profile",
            model=model,
            spec=spec,
            geometries=grid.geometries,
            budgets=grid.t1_budgets,
            v=2,  # v2: pooled UOR measured on the compacted caches (not the plans)
        )
    }
    if job.cardinality:
        keys["t5"] = unit_key(
            unit="t5", model=model, spec=spec, pages=grid.t5_page_sizes, b=grid.t5_budgets, v=1
        )
    for tag, cfg, label in job.decodes:
        keys[("decode", tag, cfg, label)] = unit_key(
            unit="decode", model=model, spec=spec, config=cfg.to_dict(), m=grid.max_new_tokens, v=1,
            **decode,
        )  # fmt: skip
    return keys


def _compute_job(lazy: _Lazy, store: UnitStore, grid: Grid, job: PromptJob, keys: dict) -> None:
    study = lazy.study
    prep = study.prepare(job.spec)
    # Work on the model and the prefill's tensors runs as jobs on the model worker, as
    # every model job does (docs/design.md, "One model worker"); the decodes are jobs
    # of `Study.run` already.
    for name, unit in (("profile", profile_unit), ("t5", cardinality_unit)):
        if name in keys and keys[name] not in store:  # keys has "t5" for a `cardinality` job
            fn = partial(unit, study.runner, grid=grid)
            store.put(keys[name], study.derive(prep, (f"replay-{name}", grid), fn))
    for tag, cfg, label in job.decodes:
        k = keys[("decode", tag, cfg, label)]
        if k in store:
            continue
        try:
            rec = decode_unit(study, prep, cfg, grid.max_new_tokens)
        except (ValueError, RuntimeError) as e:
            rec = {"feasible": False, "error": " ".join(str(e).split())[:300]}
        store.put(k, rec)


def _progress(total: int):
    """A tqdm bar on stderr when tqdm is importable, else one line per prompt."""
    try:
        from tqdm import tqdm

        bar = tqdm(total=total, file=sys.stderr, desc="replay", unit="prompt", leave=True)
    except ImportError:
        bar = None

    def step(i: int, job: PromptJob, state: str) -> None:
        s = job.spec
        what = f"{s.task} {s.curated or ''} ctx={s.context} needles={s.needles} {s.mode}"
        if bar is not None:
            bar.set_postfix_str(f"{what} ({state})", refresh=False)
            bar.update(1)
            if i == total - 1:
                bar.close()
        else:
            _say(f"[{i + 1}/{total}] {what}: {state}")

    return step


# --------------------------------------------------------------------------- peer


def _peer_model_dir(model: str):
    from experiments.peer.kvpress_peer import bundled_model_dir
    from pagekv.runtime.models import bundled_model

    spec = bundled_model(model)
    return bundled_model_dir(spec.key) if spec is not None else model


#: Requests per kvpress batch: each batch is one worker process, and its results are
#: stored when it returns, so a stopped run loses at most one batch.
PEER_BATCH = 16


def _run_peer(
    adapter: PeerAdapter, lazy, store, model, jobs, grid, minutes: float | None = None
) -> list[dict]:
    """kvpress on the same token ids and budgets (T4 and T6 prompts), cached per request.

    The requests go in batches of `PEER_BATCH`, question-after prompts first, then by
    press (the grid's order) and budget, each batch stored as it returns; with `minutes`
    no batch starts after that long."""
    requests, meta = [], {}
    presses = adapter.presses or list(WANTED)  # cached results are reported either way
    if grid.peer_presses is not None:
        presses = [p for p in presses if p in grid.peer_presses]
    for job in jobs:
        if not job.peer_budgets or not (set(grid.peer_tables) & job.tables):
            continue
        tag = "T4" if "T4" in job.tables else "T6"
        for b in job.peer_budgets:
            for press in presses:
                key = unit_key(
                    unit="peer", model=model, spec=job.spec_dict(), press=press, budget=b, v=1
                )
                meta[key] = (job, tag, press, b)
                if key in store or not adapter.available:
                    continue
                study = lazy.study
                task = study.make_task(job.spec)
                ids = task.build_prompt_ids(study.tokenizer, mode=job.spec.mode)
                if job.spec.mode != "after":
                    ids = {"input_ids": ids["input_ids"]}
                requests.append(adapter.request(key, press, b, ids, grid.max_new_tokens))
    order = {p: i for i, p in enumerate(presses)}

    def rank(req):
        job, _, press, b = meta[req["id"]]
        return (job.spec.mode != "after", order[press], b)

    requests.sort(key=rank)  # stable: prompts keep the jobs' order within a rank
    t0 = time.perf_counter()
    for start in range(0, len(requests), PEER_BATCH):
        if minutes is not None and time.perf_counter() - t0 > 60 * minutes:
            _say(f"kvpress peer: stopped after {minutes:g} min, {len(requests) - start} left")
            break
        batch = requests[start : start + PEER_BATCH]
        _say(f"kvpress peer: requests {start + 1}-{start + len(batch)} of {len(requests)}")
        for res in adapter.run(batch):
            key = res.get("id")
            if key not in meta:
                continue
            job = meta[key][0]
            data = {k: v for k, v in res.items() if k != "id"}
            if not data.get("error"):
                from pagekv.tasks import score

                task = lazy.study.make_task(job.spec)
                data["correct"] = bool(score(data.get("answer", ""), task)["correct"])
                store.put(key, data)
    return [
        {"spec": job.spec_dict(), "table": tag, "press": press, "budget": b} | store.get(key)
        for key, (job, tag, press, b) in meta.items()
        if key in store
    ]


# --------------------------------------------------------------------------- meta


def _environment(lazy: _Lazy) -> dict:
    import transformers

    env = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "cpu_count": _cpu_count(),
        "platform": platform.platform(),
        "cuda": torch.cuda.is_available(),
    }
    if lazy._study is not None:
        ld, runner = lazy._study.loaded, lazy._study.runner
        names = ("name", "n_layers", "n_heads", "n_kv_heads")
        env["model_info"] = {k: getattr(ld, k) for k in names} | {
            "r": ld.group_size,
            "device": ld.device,
            "dtype": str(ld.dtype),
            "backend": runner.backend,
            "decode": runner.decode_path,
            "fell_back": ld.fell_back,
            "note": ld.note,
        }
    return env


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 0


def _command(model, out, quick, peer, grid_name, update_presets) -> str:
    cmd = f"python -m pagekv replay --model {model} --out {out}"
    if quick:
        cmd += " --quick"
    elif grid_name != "full":
        cmd += f" --grid {grid_name}"
    if not peer:
        cmd += " --no-peer"
    if update_presets:
        cmd += " --update-presets"
    return cmd
