"""The byte-bounded memo (`pagekv.engine.memo.ByteLRU`) and `Study`'s use of it: LRU by bytes, the
cap never exceeded, one computation per missing key under concurrency; a repeated `Study.run`
served from the memo, uncorruptible, a changed configuration computed anew."""

from __future__ import annotations

import json
import logging
import random
import threading
import time

import pytest
import torch

from pagekv import EvictionConfig
from pagekv.app.model_registry import MAX_FAILURES, ModelRefused, ModelRegistry
from pagekv.engine.comparison import Side
from pagekv.engine.memo import ByteLRU, nbytes
from pagekv.engine.study import Prompt, PromptSpec, Study
from pagekv.runtime.models import LoadedModel, ModelLoadError
from pagekv.tasks import Task
from tests.test_runner import prompt, tiny_model


def test_evicts_least_recently_used_by_bytes():
    memo = ByteLRU(100, size_of=len)
    assert memo.put("a", "x" * 30) and memo.put("b", "y" * 30) and memo.put("c", "z" * 30)
    assert memo.get("a") == "x" * 30  # "a" becomes the most recent; "b" is now the oldest
    assert memo.put("d", "w" * 30)  # 120 > 100: one entry must go, and it is "b"
    assert memo.keys() == ["c", "a", "d"] and memo.nbytes == 90
    assert memo.put("e", "v" * 70)  # 160 > 100: "c" and "a" go, oldest first
    assert memo.keys() == ["d", "e"] and memo.nbytes == 100
    assert memo.stats()["evictions"] == 3


def test_an_item_larger_than_the_cap_is_not_stored_and_evicts_nothing():
    memo = ByteLRU(100, size_of=len)
    memo.put("a", "x" * 60)
    assert not memo.put("big", "y" * 101)
    assert "big" not in memo and memo.keys() == ["a"] and memo.nbytes == 60
    # replacing a key with a too-large value drops the old value (never a stale one)
    assert not memo.put("a", "z" * 200)
    assert "a" not in memo and memo.nbytes == 0


def test_the_cap_is_never_exceeded():
    rng = random.Random(0)
    memo = ByteLRU(1000, size_of=len)
    for i in range(2000):
        memo.put(rng.randrange(50), "x" * rng.randrange(0, 1200))
        if i % 7 == 0:
            memo.get(rng.randrange(50))
        assert memo.nbytes <= 1000
        assert memo.nbytes == sum(len(v) for _, v in memo.items())


def test_max_entries_and_disabled_memo():
    memo = ByteLRU(10**6, size_of=len, max_entries=2)
    for k in "abc":
        memo.put(k, k)
    assert memo.keys() == ["b", "c"]
    off = ByteLRU(0, size_of=len)
    assert off.put("a", "") is False and "a" not in off and len(off) == 0  # even size 0
    with off.computing("k") as owner:
        assert owner and off.put("k", "v") is False
    assert off.get_or_wait("k") is None  # nothing is kept: every caller computes


def test_refresh_measures_again_and_evicts():
    memo = ByteLRU(100, size_of=len)
    grows = ["x" * 10]
    memo.put("a", "y" * 50)
    memo.put("g", grows)
    memo.size_of = lambda v: 30 * len(v) if isinstance(v, list) else len(v)
    grows.extend(["x"] * 2)  # now 90 "bytes": 140 in all, "a" (oldest) goes
    memo.refresh("g")
    assert memo.keys() == ["g"] and memo.nbytes == 90
    memo.refresh("absent")  # ignored


def test_nbytes_counts_tensor_storage_once():
    t = torch.zeros(1000)  # 4000 bytes
    assert nbytes(t) == 4000
    assert 4000 <= nbytes({"a": t, "b": t[:10], "c": [t]}) < 4000 + 1000
    assert nbytes([torch.zeros(1000), torch.zeros(1000)]) >= 8000


def test_thread_safety_smoke():
    memo = ByteLRU(5000, size_of=len)
    errors = []

    def worker(seed):
        rng = random.Random(seed)
        try:
            for _ in range(2000):
                k = rng.randrange(40)
                op = rng.random()
                if op < 0.4:
                    memo.put(k, "x" * rng.randrange(1, 400))
                elif op < 0.8:
                    memo.get(k)
                else:
                    with memo.computing(k):
                        memo.put(k, "y" * rng.randrange(1, 400))
                if memo.nbytes > 5000:
                    errors.append(f"over the cap: {memo.nbytes}")
        except Exception as e:  # pragma: no cover (a failure is reported below)
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert memo.nbytes == sum(len(v) for _, v in memo.items()) <= 5000


def _watched(memo, key) -> threading.Event:
    """An event set when a thread starts waiting on `key`'s pending computation (its
    `wait`, wrapped on the instance `computing` made)."""
    pending, waiting = memo._pending[key], threading.Event()
    wait = pending.wait

    def watched_wait(timeout=None):
        waiting.set()
        return wait(timeout)

    pending.wait = watched_wait
    return waiting


def test_get_or_wait_waits_for_a_computation_announced_with_computing():
    memo = ByteLRU(100, size_of=len)
    assert memo.get_or_wait("k") is None  # nothing computing: no wait, nothing there
    entered, got = threading.Event(), []

    def owner():
        with memo.computing("k") as first:
            assert first
            waiting = _watched(memo, "k")
            entered.set()
            assert waiting.wait(10)  # the waiter is waiting: only now is "k" computed
            memo.put("k", "done")

    def waiter():
        entered.wait()
        got.append(memo.get_or_wait("k", timeout=5))

    threads = [threading.Thread(target=owner), threading.Thread(target=waiter)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # The waiter asked while the owner computed, when "k" held nothing: it has the
    # owner's value only because it waited for it.
    assert got == ["done"]
    with memo.computing("k") as first, memo.computing("k") as second:
        assert first and not second  # a second caller computes without announcing


def test_get_or_wait_gives_none_when_the_computation_fails_or_times_out():
    memo = ByteLRU(100, size_of=len)
    with pytest.raises(RuntimeError), memo.computing("k"):
        raise RuntimeError("boom")
    assert memo.get_or_wait("k", timeout=1) is None and "k" not in memo._pending
    with memo.computing("slow"):
        pending, waits = memo._pending["slow"], []
        wait = pending.wait
        pending.wait = lambda timeout=None: waits.append((timeout, wait(timeout))) or waits[-1][1]
        assert memo.get_or_wait("slow", timeout=0.05) is None
        assert waits == [(0.05, False)]  # it waited its timeout, and the value never came


@pytest.fixture
def study():
    """A fresh Study (empty memos) on the tiny model: no test depends on another."""
    model = tiny_model("llama")
    cfg = model.config
    loaded = LoadedModel(
        model=model,
        tokenizer=None,  # the runner's answers are the token ids
        name="tiny-llama",
        device="cpu",
        dtype=torch.float32,
        n_layers=cfg.num_hidden_layers,
        n_heads=cfg.num_attention_heads,
        n_kv_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        max_context=cfg.max_position_embeddings,
        load_s=0.0,
    )
    return Study(loaded, backend="torch")


def prepared(study: Study, n: int = 160, seed: int = 1) -> Prompt:
    ids = prompt(n, seed=seed)
    spec = PromptSpec(task="needle", context=max(n, 64), seed=seed)
    task = Task(name=f"tiny-{seed}", kind="needle", context="c", question="q", answer="7")
    return Prompt(
        spec=spec,
        task=task,
        prompt={"input_ids": ids},
        prefill=study.runner.prefill(ids, window_max=32),
        needle_positions=[80, 81],
        prepare_s=0.0,
    )


@pytest.fixture
def counted(study, monkeypatch):
    """Count the runner's evaluations."""
    calls = []
    real = study.runner.evaluate

    def evaluate(*args, **kwargs):
        calls.append(args[1] if len(args) > 1 else kwargs["config"])
        return real(*args, **kwargs)

    monkeypatch.setattr(study.runner, "evaluate", evaluate)
    return calls


def _same(a, b) -> None:
    """Two served results of one computation: equal, own copies, the memo's one plan."""
    pa, pb = a.plan, b.plan
    assert a.to_dict() == b.to_dict() and a is not b
    assert torch.equal(pa.keep, pb.keep) and torch.equal(pa.page_scores, pb.page_scores)
    assert pa is pb, "a served plan is the memo's own (no tensor copy per request)"


def test_repeated_run_is_served_from_the_memo(study, counted, caplog):
    prep = prepared(study)
    cfg = EvictionConfig(policy="entropy", budget=0.5, page_size=8, window=16)
    caplog.set_level(logging.INFO, logger="pagekv.engine.study")
    t0 = time.perf_counter()
    first = study.run(prep, cfg, max_new_tokens=6)
    t_first = time.perf_counter() - t0
    t0 = time.perf_counter()
    again = study.run(prep, cfg, max_new_tokens=6)
    t_again = time.perf_counter() - t0
    assert len(counted) == 1, "the repeat evaluated again"
    print(f"\ntiny model: computed {1000 * t_first:.1f} ms, from memory {1000 * t_again:.1f} ms")
    lines = [r.getMessage() for r in caplog.records if r.name == "pagekv.engine.study"]
    assert len(lines) == 2 and "computed in" in lines[0] and "served from memory" in lines[1]
    assert "entropy budget 0.5 page 8" in lines[0] and "torch backend on cpu" in lines[0]
    _same(first, again)


def test_callers_cannot_corrupt_the_memo(study, counted):
    prep = prepared(study)
    cfg = EvictionConfig(policy="mean", budget=0.5, page_size=8, window=16)
    first = study.run(prep, cfg, max_new_tokens=4)
    answer = first.answer
    first.answer = "corrupted"
    first.stored_tokens[0][0] = -1
    first.timings["decode_s"] = -1.0
    first.uor["max"] = 99.0
    again = study.run(prep, cfg, max_new_tokens=4)
    assert again.answer == answer and again.stored_tokens[0][0] > 0
    assert again.timings["decode_s"] >= 0 and again.uor["max"] == 1.0
    assert again.plan is first.plan  # shared, never mutated (Study's docstring)
    assert len(counted) == 1


def test_different_settings_are_computed_anew(study, counted):
    """The negative control: the memo answers only identical requests."""
    prep = prepared(study)
    other = prepared(study, seed=2)
    cfg = EvictionConfig(policy="entropy", budget=0.5, page_size=8, window=16)
    study.run(prep, cfg, max_new_tokens=4)
    study.run(prep, cfg.replace(budget=0.6), max_new_tokens=4)
    study.run(prep, cfg, max_new_tokens=5)
    study.run(other, cfg, max_new_tokens=4)
    study.run_full(prep, max_new_tokens=4)
    assert len(counted) == 5
    study.run_full(prep, max_new_tokens=4)
    study.run(prep, EvictionConfig(policy="full"), max_new_tokens=4)  # run_full's entry
    assert len(counted) == 5


def test_result_memo_is_bounded_by_bytes(study):
    prep = prepared(study)
    cfgs = [EvictionConfig(policy="entropy", budget=b, window=16) for b in (0.4, 0.5, 0.6, 0.7)]
    study.run(prep, cfgs[0], 2)
    one = study.results.nbytes  # one record, its plan's tensors included
    assert one > 1000
    small = Study(study.loaded, backend="torch", result_memo_bytes=int(2.5 * one))
    for cfg in cfgs:
        small.run(prep, cfg, 2)
        assert small.results.nbytes <= int(2.5 * one)
    assert len(small.results) == 2  # the two most recent
    assert [k[1] for k in small.results.keys()] == cfgs[2:]


class FakeStudy:
    def __init__(self, name: str):
        self.loaded = LoadedModel(
            model=None, tokenizer=None, name=name, device="cpu", dtype=torch.float32,
            n_layers=1, n_heads=2, n_kv_heads=1, head_dim=4, max_context=64, load_s=0.0,
        )  # fmt: skip


def fake_factory(loads: list, fail=(), delay: dict | None = None, entered=None):
    def factory(name):
        if delay and name in delay:
            if entered is not None:
                entered.set()  # the loader has started
            delay[name].wait(10)
        loads.append(name)
        if name in fail:
            raise ModelLoadError(f"cannot load model {name!r}: unknown model name")
        return FakeStudy(name)

    return factory


def test_registry_keeps_the_default_and_evicts_the_least_recent_other():
    loads = []
    reg = ModelRegistry(max_others=2, factory=fake_factory(loads), allow_hub=True)
    bundled = reg.get("bundled")
    assert reg.get(" SmolLM2 ") is bundled and reg.get(None) is bundled  # aliases: one key
    a, b = reg.get("org/a"), reg.get("org/b")
    assert reg.get("bundled") is bundled and reg.get("org/a") is a  # "b" is now the oldest
    reg.get("org/c")
    assert reg.loaded_names() == ["bundled", "org/a", "org/c"]
    assert reg.get("org/b") is not b  # loaded again, "a" goes
    assert "bundled" in reg.studies and "org/a" not in reg.studies
    assert loads == ["bundled", "org/a", "org/b", "org/c", "org/b"]


def test_registry_failed_load_changes_nothing_and_falls_back():
    loads = []
    reg = ModelRegistry(max_others=1, factory=fake_factory(loads, fail={"org/bad"}), allow_hub=True)
    bundled, a = reg.get("bundled"), reg.get("org/a")
    before = list(reg.studies.items())
    got = reg.get("org/bad")
    assert dict(reg.studies) == dict(before)  # nothing loaded, nothing evicted
    assert got.loaded.fell_back and "unknown model name" in got.loaded.note
    assert got.loaded.name == "bundled" and not bundled.loaded.fell_back
    assert reg.get("org/a") is a
    reg.get("org/bad")  # remembered: not tried again at once
    assert loads.count("org/bad") == 1


def test_registry_default_that_cannot_load_says_why():
    reg = ModelRegistry(factory=fake_factory([], fail={"bundled", "org/a"}), allow_hub=True)
    with pytest.raises(ModelLoadError, match="cannot load model 'bundled'"):
        reg.get("bundled")
    with pytest.raises(ModelLoadError, match="cannot load model 'bundled'"):
        reg.get("org/a")  # the fallback cannot load either


def test_a_public_registry_refuses_names_it_does_not_offer():
    """Without allow_hub, only the default and the known models load; any other name is
    refused in one sentence and the factory (the download) is never called."""
    loads = []
    reg = ModelRegistry(factory=fake_factory(loads), known=("org/known",))
    for name in ("org/any-model", "/etc", "../models/x", "org/known2"):
        with pytest.raises(ModelRefused, match="does not offer the model") as err:
            reg.get(name)
        assert "\n" not in str(err.value)
    assert loads == [] and reg.loaded_names() == [] and reg.failures() == 0
    assert reg.get("org/known").loaded.name == "org/known" and loads == ["org/known"]
    assert ModelRegistry(factory=fake_factory(loads), allow_hub=True).get("org/x").loaded.name
    assert loads[-1] == "org/x"


def test_registry_remembers_a_bounded_number_of_failures():
    names = [f"org/bad{i}" for i in range(MAX_FAILURES + 5)]
    reg = ModelRegistry(factory=fake_factory([], fail=set(names)), allow_hub=True)
    for name in names:
        assert reg.get(name).loaded.fell_back
    assert reg.failures() == MAX_FAILURES


def test_registry_loading_does_not_block_other_models():
    loads, gate, entered = [], threading.Event(), threading.Event()
    factory = fake_factory(loads, delay={"org/slow": gate}, entered=entered)
    reg = ModelRegistry(factory=factory, allow_hub=True)
    bundled = reg.get("bundled")
    got = []
    slow = [threading.Thread(target=lambda: got.append(reg.get("org/slow"))) for _ in range(3)]
    for t in slow:
        t.start()
    assert entered.wait(10)  # org/slow's loader has started and waits on the gate
    assert reg.get("bundled") is bundled  # served while org/slow is still loading
    assert not gate.is_set() and all(t.is_alive() for t in slow)  # they still wait on it
    gate.set()
    for t in slow:
        t.join()
    assert loads.count("org/slow") == 1 and len({id(s) for s in got}) == 1


def test_prepared_serves_the_memo_only(study):
    spec = PromptSpec(task="needle", context=64, seed=99)
    with pytest.raises(LookupError, match="not prefilled yet"):
        study.prepared(spec)
    prep = prepared(study, seed=99)
    study.prefills.put(prep.spec, prep)
    assert study.prepared(prep.spec) is prep


def test_concurrent_identical_pairs_decode_once_and_the_model_runs_one_at_a_time(
    study, monkeypatch
):
    """Several threads ask for one pair at once: one batched decode, the others are
    served from the memo; and no two evaluations ever overlap (the Study's lock)."""
    prep = prepared(study, seed=5)
    a = EvictionConfig(policy="mean", budget=0.5, page_size=8, window=16)
    b = a.replace(policy="entropy")
    real_pair, real_one = study.runner.evaluate_pair, study.runner.evaluate
    busy, overlaps, pairs = [0], [], []

    def guarded(fn, log):
        def call(*args, **kwargs):
            busy[0] += 1
            overlaps.append(busy[0])
            time.sleep(0.05)
            try:
                return fn(*args, **kwargs)
            finally:
                busy[0] -= 1
                log.append(1)

        return call

    monkeypatch.setattr(study.runner, "evaluate_pair", guarded(real_pair, pairs))
    monkeypatch.setattr(study.runner, "evaluate", guarded(real_one, []))
    start = threading.Barrier(4)
    got = []

    def pair():
        start.wait()
        got.append(study.run_pair(prep, a, b, 4))

    def other():  # a different run on the same model at the same time
        start.wait()
        study.run(prep, a.replace(budget=0.6), 4)

    threads = [threading.Thread(target=pair) for _ in range(3)] + [threading.Thread(target=other)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(pairs) == 1, "the same pair was decoded more than once"
    assert max(overlaps) == 1, "two evaluations ran on the model at once"
    answers = {(ra.answer, rb.answer) for ra, rb in got}
    assert len(got) == 3 and len(answers) == 1


def test_a_detached_comparison_keeps_the_views_but_not_the_prefill(study):
    """What the app keeps after a run (a session's last run, the memo of finished views)
    must not pin the prefill's KV cache; every view and the export read the same."""
    from pagekv.app.run_figures import comparison_figures
    from pagekv.engine.comparison import PrefillShape, compare, summary
    from pagekv.runtime.prefill import Prefill

    prep = prepared(study, seed=7)
    study.prefills.put(prep.spec, prep)
    a = EvictionConfig(policy="mean", budget=0.5, page_size=8, window=16)
    a, b = Side(a), Side(a.replace(policy="entropy"))
    comp = compare(study, prep.spec, a, b, max_new_tokens=3)
    light = comp.detached()
    assert isinstance(comp.prep.prefill, Prefill)  # the original is left as it was
    assert isinstance(light.prep.prefill, PrefillShape) and light.preps["B"] is light.prep
    assert (light.prep.n, light.n_groups) == (comp.prep.n, comp.n_groups)
    assert nbytes(light) < nbytes(comp) - nbytes(comp.prep.prefill.cache) // 2
    same = lambda x: json.dumps(summary(x), sort_keys=True)  # noqa: E731  (NaN == NaN)
    assert same(light) == same(comp)
    figs, light_figs = comparison_figures(comp, layer=1), comparison_figures(light, layer=1)
    assert figs.keys() == light_figs.keys()
    assert all(figs[k].to_json() == light_figs[k].to_json() for k in figs)


def test_the_kept_part_holds_what_keep_if_names_whatever_the_rest_stores():
    memo = ByteLRU(max_bytes=100, size_of=len, kept_bytes=60)
    memo.keep_if = lambda key: key.startswith("lesson")
    assert memo.put("lesson-a", b"a" * 30) and memo.put("lesson-b", b"b" * 30)
    for i in range(10):  # exploration: far more than the first part holds
        memo.put(f"x{i}", b"x" * 70)
    assert memo.get("lesson-a") == b"a" * 30 and memo.get("lesson-b") == b"b" * 30
    assert list(memo) == ["lesson-a", "lesson-b", "x9"]
    assert memo.nbytes == 70 and memo.kept_nbytes == 60
    # The kept part is bounded too: a third lesson entry lets the least recent go.
    memo.get("lesson-a")
    assert memo.put("lesson-c", b"c" * 30)
    assert "lesson-b" not in memo and {"lesson-a", "lesson-c"} <= set(memo)
    assert not memo.put("lesson-huge", b"h" * 61)  # larger than the kept cap
    stats = memo.stats()
    assert (stats["kept_entries"], stats["kept_bytes"], stats["max_kept_bytes"]) == (2, 60, 60)
    assert memo.pop("lesson-a") == b"a" * 30 and memo.kept_nbytes == 30
    # A kept entry that grows past the kept cap goes, as in the first part.
    grow = [b"g" * 10]
    memo.put("lesson-g", grow)  # its size: the list's length, 1
    memo.size_of = lambda v: 999 if v is grow else len(v)
    memo.refresh("lesson-g")
    assert "lesson-g" not in memo and memo.kept_nbytes == 30


def test_keep_now_moves_entries_both_ways_when_keep_if_changes():
    memo = ByteLRU(max_bytes=100, size_of=len, kept_bytes=100)
    memo.put("a", b"a" * 40)
    memo.put("b", b"b" * 40)
    assert memo.kept_nbytes == 0  # nothing named yet
    memo.keep_if = lambda key: key == "a"
    memo.keep_now()
    assert (memo.nbytes, memo.kept_nbytes) == (40, 40)
    memo.put("c", b"c" * 60)  # 100 in the first part: b and c; "a" is not in the way
    memo.put("d", b"d" * 60)  # evicts b and c from the first part, never "a"
    assert list(memo) == ["a", "d"]
    memo.keep_if = lambda key: False
    memo.keep_now()  # "a" back with the rest: 40 + 60 fits
    assert (memo.nbytes, memo.kept_nbytes) == (100, 0) and set(memo) == {"a", "d"}
    memo.clear()
    assert len(memo) == 0 and memo.nbytes == memo.kept_nbytes == 0


def test_a_kept_prompt_is_served_from_memory_after_exploration_fills_the_memos(study, counted):
    """Kept prompts (`Study.keep_prompts`) keep prefill, plans and results while others come and go;
    without keeping, the run is recomputed."""
    lesson, cfg = prepared(study), EvictionConfig(policy="entropy", budget=0.5, window=16)
    one = prepared(study, seed=7)
    study.run(one, cfg, 2)
    size = study.results.nbytes
    for keep in (True, False):
        small = Study(study.loaded, backend="torch", result_memo_bytes=int(1.5 * size),
                      plan_memo_bytes=int(1.5 * size),
                      prefill_memo_bytes=int(1.5 * nbytes(lesson)))  # fmt: skip
        small.runner.evaluate = study.runner.evaluate  # counted
        if keep:
            small.keep_prompts({lesson.spec})
        small.prefills.put(lesson.spec, lesson)
        small.run(lesson, cfg, 2)
        calls = len(counted)
        for seed in range(20, 24):  # exploration: other prompts, each evicting the last
            other = prepared(study, seed=seed)
            small.prefills.put(other.spec, other)
            small.run(other, cfg, 2)
        assert len(counted) == calls + 4
        small.run(lesson, cfg, 2)
        kept = small.prefills.get(lesson.spec) is lesson
        assert (len(counted) == calls + 4, kept) == (keep, keep), keep
        if keep:
            assert small.results.kept_nbytes > 0 and small.plans.kept_nbytes > 0
            assert small.results.nbytes <= int(1.5 * size)  # the first part still bounded
    small.keep_prompts(set())  # let go: back to the ordinary parts
    assert small.results.kept_nbytes == 0
