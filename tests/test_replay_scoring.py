"""The replay's question-agnostic rows: the jobs a grid with `scorings` makes, and T4, T6, T7 and
the peer's table keeping them apart (no model)."""

from __future__ import annotations

from experiments.replay import tables
from experiments.replay.grid import AGNOSTIC, AGNOSTIC_GRID, FULL, QUICK, Scoring
from experiments.replay.jobs import build_jobs
from pagekv import EvictionConfig

CURATED = {"qa": ["qa_one", "qa_two"], "code": ["code_one"]}


def test_scoring_labels():
    assert tables.scoring(EvictionConfig().to_dict()) == "window/uniform"
    assert tables.scoring({}) == "window/uniform"  # units stored without a scoring
    rec = EvictionConfig(scorer="reconstruct", allocation="global", window=8).to_dict()
    assert tables.scoring(rec) == "reconstruct/global, w8"
    rec32 = EvictionConfig(scorer="reconstruct", allocation="global").to_dict()
    assert tables.scoring(rec32) == "reconstruct/global"
    assert tables.scoring(EvictionConfig(window=8).to_dict()) == "window/uniform"


def test_the_agnostic_grid_decodes_every_setting_at_every_budget():
    jobs = build_jobs(AGNOSTIC_GRID, CURATED)
    t4 = [j for j in jobs if "T4" in j.tables]
    t6 = [j for j in jobs if "T6" in j.tables]
    assert len(t4) == 3 * 5 * 2 and len(t6) == 3 * 2  # contexts x depths x modes; tasks x modes
    for j in t4 + t6:
        got = sorted(
            (cfg.policy, cfg.budget, cfg.scorer, cfg.allocation, cfg.window, label)
            for _, cfg, label in j.decodes
        )
        want = sorted(
            [("entropy", b, "window", "uniform", 32, "") for b in (0.1, 0.2, 0.5)]
            + [
                ("entropy", b, "reconstruct", "global", 8, AGNOSTIC[0].label)
                for b in (0.1, 0.2, 0.5)
            ]  # fmt: skip
            + [("full", 1.0, "window", "uniform", 32, "full")]
        )
        assert got == want, j.spec
        assert j.peer_budgets == (0.1, 0.2, 0.5)
    # The T4 prompts are FULL's: same specs, so their units are shared.
    full_t4 = {j.spec for j in build_jobs(FULL, CURATED) if "T4" in j.tables}
    assert {j.spec for j in t4} == full_t4


def test_grids_without_scorings_decode_the_window_scorer_uniformly():
    for j in build_jobs(FULL, CURATED):
        cfgs = [cfg for _, cfg, _ in j.decodes]
        assert all(c.scorer == "window" and c.allocation == "uniform" for c in cfgs)
    quick = build_jobs(QUICK, CURATED)
    assert any(cfg.scorer == "reconstruct" for j in quick for _, cfg, _ in j.decodes)


def _unit(table, spec, cfg, correct, label="", stored=900, pages=900):
    return {
        "spec": spec,
        "table": table,
        "label": label,
        "config": cfg.to_dict(),
        "feasible": True,
        "correct": correct,
        "answer": "right" if correct else "wrong",
        "stored_tokens": stored,
        "page_tokens": pages,
    }


def test_window_and_reconstruct_rows_stay_apart():
    spec = {"task": "needle", "context": 500, "depth": 0.5, "seed": 0, "mode": "after"}
    spec2 = spec | {"seed": 1}
    win = EvictionConfig(budget=0.2)
    rec = win.replace(**Scoring("r").config_fields())
    units = [
        _unit("T4", spec, win, False),
        _unit("T4", spec2, win, False),
        _unit("T4", spec, rec, True, "r", stored=1000, pages=880),
        _unit("T4", spec2, rec, True, "r", stored=960, pages=860),
        _unit("T4", spec, win.replace(policy="mean"), False),
        _unit("T4", spec2, win.replace(policy="mean"), True),
    ]
    summary, detail, _, _ = tables.t4(units, [], [])
    by = {(r["policy"], r["scoring"]): r for r in summary}
    assert set(by) == {
        ("entropy", "window/uniform"),
        ("entropy", "reconstruct/global, w8"),
        ("mean", "window/uniform"),
    }
    assert by[("entropy", "window/uniform")]["recall"] == 0.0
    rrow = by[("entropy", "reconstruct/global, w8")]
    assert (rrow["recall"], rrow["right"], rrow["prompts"]) == (1.0, 2, 2)
    assert (rrow["stored_tokens"], rrow["page_tokens"]) == (980, 870)
    assert len(detail) == 3  # one cell (context, depth): a row per policy and scoring
    # T7 pairs entropy with mean under the window scorer only: one loss, one tie.
    answers, _ = tables.t7(units, [], QUICK)[:2]
    assert sum(r["prompts"] for r in answers) == 2
    assert sum(r["entropy_loses"] for r in answers) == 1
    assert sum(r["ties"] for r in answers) == 1
    # The headline keeps its old keys for the window scorer, and names the other.
    head = tables._headline([], [], {}, summary, [], [], [], [])
    assert head["needle_recall_20pct"] == {
        "after|entropy": 0.0,
        "after|entropy|reconstruct/global, w8": 1.0,
        "after|mean": 0.5,
    }


def test_the_peer_is_matched_to_the_window_scorer_only():
    spec = {"task": "needle", "context": 500, "depth": 0.5, "seed": 0, "mode": "after"}
    win = EvictionConfig(budget=0.2)
    rec = win.replace(scorer="reconstruct", allocation="global")  # window 32: same geometry
    rows = tables._flat_decodes(
        [_unit("T4", spec, rec, True, "r"), _unit("T4", spec, win, False)], "T4"
    )
    peer = [
        {"spec": spec, "table": "T4", "press": "pagekv_entropy", "budget": 0.2,
         "answer": "wrong", "attended_tokens": [[10, 20], [30, 40]]},
        {"spec": spec, "table": "T4", "press": "kvzip", "budget": 0.2, "answer": "right",
         "correct": True, "attended_tokens": [[1, 2], [3, 4]],
         "touched_pages": {"16": [[1, 2], [2, 3]]}},
    ]  # fmt: skip
    out = {r["press"]: r for r in tables._peer_rows(peer, "T4", rows)}
    assert out["pagekv_entropy"]["same_answer_as_runner"] == 1.0  # the window decode's
    assert out["pagekv_entropy"]["stored_tokens"] == 100
    assert out["kvzip"]["stored_tokens"] == 10 and out["kvzip"]["recall"] == 1.0
    # What a paged cache of 16-token pages holds: the pages touched, times 16.
    assert out["kvzip"]["physical_tokens"] == 16 * 8
    assert out["pagekv_entropy"]["physical_tokens"] is None  # not reported


def test_t6_rows_by_budget_and_scoring():
    spec = {"task": "qa", "curated": "qa_one", "mode": "after"}
    win = EvictionConfig(budget=0.1)
    rec = win.replace(**Scoring("r").config_fields())
    units = [
        _unit("T6", spec, win, False),
        _unit("T6", spec, win.replace(budget=0.5), True),
        _unit("T6", spec, rec, True, "r"),
    ]
    summary, detail, _ = tables.t6(units, [])
    got = {(r["budget"], r["scoring"]): r["solved"] for r in summary}
    assert got == {
        (0.1, "window/uniform"): 0,
        (0.5, "window/uniform"): 1,
        (0.1, "reconstruct/global, w8"): 1,
    }
    assert {r["page_tokens"] for r in summary} == {900}
    assert [(d["budget"], d["scoring"]) for d in detail] == [
        (0.1, "reconstruct/global, w8"),
        (0.1, "window/uniform"),
        (0.5, "window/uniform"),
    ]


class _Task:
    def build_prompt_ids(self, tokenizer, mode):
        return {"input_ids": [1, 2, 3], "context_ids": [1, 2], "question_ids": [3]}


class _Study:
    tokenizer = None

    def make_task(self, spec):
        return _Task()


class _Lazy:
    study = _Study()


class _Adapter:
    available = True
    presses = ["kvzip", "keydiff", "snapkv"]

    def __init__(self, fail_from=None):
        self.batches = []
        self.fail_from = fail_from

    def request(self, rid, press, budget, ids, max_new):
        return {"id": rid, "press": press, "budget": budget}

    def run(self, batch):
        self.batches.append([(r["press"], r["budget"]) for r in batch])
        if self.fail_from is not None and len(self.batches) > self.fail_from:
            raise KeyboardInterrupt  # the run stopped while this batch ran
        return [{"id": r["id"], "answer": "right", "attended_tokens": [[1]]} for r in batch]


def _peer_setup(tmp_path, monkeypatch):
    import pagekv.tasks
    from experiments.replay import harness
    from experiments.replay.store import UnitStore

    monkeypatch.setattr(pagekv.tasks, "score", lambda answer, task: {"correct": True})
    monkeypatch.setattr(harness, "PEER_BATCH", 4)
    jobs = build_jobs(AGNOSTIC_GRID, CURATED)[:6]  # 3 after and 3 inside needle prompts
    return harness, UnitStore(tmp_path), jobs


def test_the_peer_runs_in_stored_batches_after_mode_first(tmp_path, monkeypatch):
    """Only the grid's presses, question-after first, in PEER_BATCH batches stored as they return,
    so a rerun sends only what is missing."""
    from experiments.replay.store import UnitStore

    harness, store, jobs = _peer_setup(tmp_path, monkeypatch)
    modes = [j.spec.mode for j in jobs]
    assert modes.count("after") == 3 and modes.count("inside") == 3
    stopped = _Adapter(fail_from=2)
    try:
        harness._run_peer(stopped, _Lazy(), store, "m", jobs, AGNOSTIC_GRID)
    except KeyboardInterrupt:
        pass
    assert [len(b) for b in stopped.batches] == [4, 4, 4]
    assert UnitStore(tmp_path).loaded == 8  # the two finished batches, on disk
    # 3 prompts x 2 presses x 3 budgets per mode: after first, kvzip before keydiff.
    first = stopped.batches[0] + stopped.batches[1]
    assert first[:4] == [("kvzip", 0.1)] * 3 + [("kvzip", 0.2)]
    again = _Adapter()
    out = harness._run_peer(again, _Lazy(), store, "m", jobs, AGNOSTIC_GRID)
    sent = [x for b in again.batches for x in b]
    assert len(sent) == 36 - 8 and len(out) == 36 and UnitStore(tmp_path).loaded == 36
    assert {p for p, _ in sent} == {"kvzip", "keydiff"}
    assert all(len(b) <= 4 for b in again.batches)
    # A time budget of zero starts no batch: nothing sent, the stored results reported.
    idle = _Adapter()
    fresh = harness._run_peer(idle, _Lazy(), store, "m", jobs, AGNOSTIC_GRID, minutes=0)
    assert idle.batches == [] and len(fresh) == 36
