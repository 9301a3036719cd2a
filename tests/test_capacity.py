"""Many prompts in one fixed pool (`pagekv.runtime.block_pool`, `pagekv.runtime.serve`):
blocks admitted, reused and returned by hand; a batch of rows of different lengths
attended as each row alone (torch path and paged-decode kernel); and on the bundled
model every row's greedy tokens equal the prompt decoded alone, in float32, for the
full cache and evicted ones, with rows admitted mid-decode."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagekv import EvictionConfig
from pagekv.runtime.block_pool import BlockPool, blocks_needed
from pagekv.runtime.runner import Runner
from pagekv.tasks.needle import make_needle_task
from tests.test_kernels import assert_close


def filled_pool(counts_per_row, P=2, d=4, num_blocks=64, seed=0, kernel=False, dtype=torch.float32):
    """A pool holding one row per entry of `counts_per_row` (`[L][G]` kept tokens each,
    extra 3), admitted from random caches whose kept tokens are every other one: the
    pool, the row ids, and each row's kept `(keys, values)` per (layer, group)."""
    gen = torch.Generator().manual_seed(seed)
    pool = BlockPool(num_blocks, len(counts_per_row[0]), len(counts_per_row[0][0]), d, P,
                     torch.zeros((), dtype=dtype), kernel=kernel)  # fmt: skip
    rows, want = [], []
    for counts in counts_per_row:
        n = 2 * max(map(max, counts)) + 1
        keys = [torch.randn(1, len(c), n, d, generator=gen).to(dtype) for c in counts]
        values = [torch.randn(1, len(c), n, d, generator=gen).to(dtype) for c in counts]
        kept = [torch.arange(0, n, 2).expand(len(c), -1) for c in counts]
        rows.append(pool.admit(keys, values, kept, counts, extra=3))
        want.append([[(k[0, g, 0 : 2 * t : 2], v[0, g, 0 : 2 * t : 2]) for g, t in enumerate(c)]
                     for k, v, c in zip(keys, values, counts, strict=True)])  # fmt: skip
    return pool, rows, want


def test_blocks_are_reserved_returned_and_reused_by_hand():
    """Pages of 2, extra 1: counts [[3, 1], [2, 2]] take ceil(4/2) + ceil(2/2) +
    ceil(3/2) + ceil(3/2) = 7 blocks; a row that needs more than the free ones is
    refused with nothing changed; a released row's blocks serve the next."""
    assert blocks_needed([[3, 1], [2, 2]], 1, 2) == 7
    assert blocks_needed([[0, 0]], 0, 4) == 2  # every (layer, group) holds a block
    pool = BlockPool(10, 2, 2, 4, 2, torch.zeros(()))
    keys = [torch.randn(1, 2, 5, 4) for _ in range(2)]
    values = [torch.randn(1, 2, 5, 4) for _ in range(2)]
    kept = [torch.tensor([[0, 2, 4], [1, 3, 4]]), torch.tensor([[1, 2, 3], [0, 1, 2]])]
    a = pool.admit(keys, values, kept, [[3, 1], [2, 2]], extra=1)
    assert (pool.used_blocks, pool.free_blocks) == (7, 3)
    k, v = pool.read(a, 0, 0)
    assert torch.equal(k, keys[0][0, 0, [0, 2, 4]]) and torch.equal(v, values[0][0, 0, [0, 2, 4]])
    assert torch.equal(pool.read(a, 1, 1)[0], keys[1][0, 1, [0, 1]])
    assert pool.lengths(a) == [[3, 1], [2, 2]]
    assert pool.admit(keys, values, None, [[5, 5], [5, 5]], extra=0) is None  # 12 > 3 free
    assert (pool.used_blocks, list(pool.rows)) == (7, [a])
    held = {b for layer in pool.rows[a].blocks for g in layer for b in g}
    pool.release(a)
    assert pool.free_blocks == 10 and not pool.rows
    c = pool.admit(keys, values, None, [[5, 5], [5, 5]], extra=0)  # 12 blocks: too many
    assert c is None
    c = pool.admit(keys, values, None, [[5, 4], [3, 0]], extra=0)  # 3 + 2 + 2 + 1 = 8
    mine = {b for layer in pool.rows[c].blocks for g in layer for b in g}
    assert len(mine) == 8 and held <= mine  # the returned blocks, reused
    assert torch.equal(pool.read(c, 0, 0)[0], keys[0][0, 0])


def test_a_row_reads_its_tokens_through_blocks_that_are_not_consecutive():
    """Admit A and B, release A, admit C larger than A: C takes A's blocks and more past
    B's, and still reads its own tokens in order."""
    pool, (a, b), _ = filled_pool([[[3, 3]], [[2, 2]]], num_blocks=16)
    pool.release(a)
    gen = torch.Generator().manual_seed(1)
    keys, values = (
        [torch.randn(1, 2, 9, 4, generator=gen)],
        [torch.randn(1, 2, 9, 4, generator=gen)],
    )
    c = pool.admit(keys, values, None, [[9, 7]], extra=0)
    blocks = pool.rows[c].blocks[0][0] + pool.rows[c].blocks[0][1]
    assert blocks != list(range(min(blocks), min(blocks) + len(blocks)))  # not one run
    assert torch.equal(pool.read(c, 0, 0)[1], values[0][0, 0])
    assert torch.equal(pool.read(c, 0, 1)[0], keys[0][0, 1, :7])
    assert pool.lengths(b) == [[2, 2]] and pool.read(b, 0, 1)[0].shape == (2, 4)


def reference(pool, rows, layer, q, scale):
    """Each (row, group) alone: SDPA of its queries over `pool.read`, causal among the
    `t` newest tokens, in float64."""
    B, H, t, d = q.shape
    G = pool.n_groups
    r = H // G
    out = torch.empty(B, H, t, d, dtype=torch.float64)
    for b, row in enumerate(rows):
        for g in range(G):
            k, v = (x.double() for x in pool.read(row, layer, g))
            n = k.shape[0]
            mask = torch.arange(n)[None, :] < (n - t + 1 + torch.arange(t))[:, None]
            qg = q[b, g * r : (g + 1) * r].double()
            out[b, g * r : (g + 1) * r] = F.scaled_dot_product_attention(
                qg, k[None], v[None], attn_mask=mask, scale=scale
            )
    return out


@pytest.mark.parametrize("t", [1, 3])
def test_a_batch_attends_each_row_as_alone(t):
    """Three rows whose (layer, group)s hold different lengths, grown by `t` tokens and
    written through their block tables: the batch's attention is each row's alone."""
    counts = [[[5, 1], [2, 7]], [[11, 4], [3, 3]], [[1, 1], [9, 2]]]
    pool, rows, want = filled_pool(counts, P=2, num_blocks=80)
    batch = pool.batch(rows)
    assert batch.room() == 3  # extra 3 past each row's kept tokens
    gen = torch.Generator().manual_seed(2)
    B, G, d = 3, 2, 4
    batch.grow(t)
    for layer in range(2):
        k_new, v_new = torch.randn(2, B, G, t, d, generator=gen)
        batch.write(layer, k_new, v_new)
        for b, row in enumerate(rows):
            for g in range(G):
                k, v = pool.read(row, layer, g)
                wk, wv = want[b][layer][g]
                assert torch.equal(k, torch.cat([wk, k_new[b, g]]))
                assert torch.equal(v, torch.cat([wv, v_new[b, g]]))
        q = torch.randn(B, G * 3, t, d, generator=gen)
        got = batch.attend(layer, q, 0.5)
        ref = reference(pool, rows, layer, q, 0.5)
        assert_close("pool batch vs each row alone (float64)", got.double(), ref, ref, floor=1e-5)
    assert pool.lengths(rows[1]) == [[11 + t, 4 + t], [3 + t, 3 + t]]
    with pytest.raises(ValueError, match="full"):
        batch.grow(4 - t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_kernel_reads_a_batch_of_rows_of_different_lengths(device, dtype):
    """The paged-decode kernel over a batch's tables and lengths (rows of different
    lengths in blocks shuffled by earlier releases) gives each row's attention alone."""
    counts = [[[40, 3]], [[17, 60]], [[9, 9]], [[70, 1]]]
    pool, rows, _ = filled_pool(counts, P=4, d=16, num_blocks=200, dtype=dtype)
    pool.release(rows[2])  # its blocks go to the next row, out of order
    gen = torch.Generator().manual_seed(3)
    keys = [torch.randn(1, 2, 50, 16, generator=gen).to(dtype)]
    rows[2] = pool.admit(keys, keys, None, [[50, 23]], extra=1)
    pool.k, pool.v = pool.k.to(device), pool.v.to(device)
    pool.kernel = True
    batch = pool.batch(rows)
    q = torch.randn(4, 6, 1, 16, generator=gen).to(device=device, dtype=dtype)
    got = batch.attend(0, q, 16**-0.5)
    pool.k, pool.v = pool.k.cpu(), pool.v.cpu()
    ref = reference(pool, rows, 0, q.cpu(), 16**-0.5)
    low = reference(pool, rows, 0, q.cpu().to(dtype).float(), 16**-0.5)
    floor = 1e-5 if dtype == torch.float32 else 2e-3
    assert_close("pool kernel vs each row alone (float64)", got.cpu().double(), ref, low,
                 floor=floor)  # fmt: skip


# ------------------------------------------------------------------ the bundled model

#: (context tokens, question position): rows of different lengths and both modes.
PROMPTS = [(600, "inside"), (700, "after"), (500, "inside"), (650, "after"), (550, "inside")]
NEW = 12


@pytest.fixture(scope="module")
def bundled(bundled_study):
    """The suite's bundled model (the session's `Study`'s; skipped where it is missing)."""
    return bundled_study.loaded


@pytest.fixture(scope="module")
def runner(bundled):
    return Runner(bundled.model, bundled.tokenizer, decode_dtype="float32")


@pytest.fixture(scope="module")
def prompts(bundled):
    out = []
    for i, (context, mode) in enumerate(PROMPTS):
        task = make_needle_task(bundled.tokenizer, context_tokens=context, seed=i,
                                depth=0.3 + 0.1 * i, question_position=mode)  # fmt: skip
        ids = task.build_prompt_ids(bundled.tokenizer)
        out.append(
            ids["input_ids"] if mode == "inside" else (ids["context_ids"], ids["question_ids"])
        )
    return out


def prefill(runner, prompt):
    ids, question = prompt if isinstance(prompt, tuple) else (prompt, None)
    return runner.prefill(ids, question_ids=question)


def pool_bytes(runner, blocks):
    """The bytes of `blocks` blocks of 16 tokens of the bundled model (float32, d = 64)."""
    return blocks * 2 * 16 * 64 * 4


CONFIGS = {
    "full": EvictionConfig(policy="full", page_size=16),
    "entropy-20": EvictionConfig(policy="entropy", budget=0.2, page_size=16),
    # a global plan: layers and KV heads of one row hold different numbers of pages
    "entropy-15-global": EvictionConfig(
        policy="entropy", budget=0.15, page_size=16, allocation="global"
    ),
}


@pytest.fixture(scope="module")
def served(runner, prompts):
    """Every config's pool run in one pool that holds two full prompts, and the
    prompts decoded alone."""
    size = pool_bytes(runner, 9000)
    prefills = [prefill(runner, p) for p in prompts]  # each decoded alone under every config
    return {
        name: (
            runner.serve(prompts, cfg, size, max_new_tokens=NEW),
            [runner.evaluate(pre, cfg, max_new_tokens=NEW).tokens for pre in prefills],
        )  # fmt: skip
        for name, cfg in CONFIGS.items()
    }


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_row_decodes_as_it_would_alone(served, name):
    run, want = served[name]
    assert run.tokens == want
    assert all(len(t) == NEW for t in run.tokens) or "eos" in run.stop_reasons
    assert max(run.blocks_in_use) <= run.pool_blocks == 9000
    assert len(run.live) == len(run.blocks_in_use) > 0


def test_rows_are_admitted_mid_decode_when_blocks_return(served):
    """With the full cache the pool holds two prompts: the others wait, and each is
    admitted at the step a row finished and returned its blocks."""
    run, _ = served["full"]
    assert run.max_live == 2
    assert sorted(run.admitted_at)[2:] == sorted(run.finished_at)[:3]
    assert min(run.admitted_at[2:]) > 0


def test_each_row_holds_the_blocks_of_its_kept_pages_and_answer(served, prompts):
    """A full prompt of n tokens, q question tokens and NEW answer tokens holds
    ceil((n + q + NEW) / 16) blocks per (layer, KV head): 30 layers x 3 KV heads."""
    run, _ = served["full"]
    sizes = [(len(p), NEW) if not isinstance(p, tuple) else (len(p[0]), len(p[1]) + NEW)
             for p in prompts]  # fmt: skip
    assert run.blocks == [90 * -(-(n + extra) // 16) for n, extra in sizes]


def test_a_budget_buys_rows_in_the_same_pool(served):
    """In the bytes that hold two full prompts, entropy at 20 % holds all five at once,
    each in fewer blocks, and the batched steps are fewer."""
    full, _ = served["full"]
    ent, _ = served["entropy-20"]
    assert ent.max_live == len(PROMPTS) > full.max_live
    assert all(e < 0.4 * f for e, f in zip(ent.blocks, full.blocks, strict=True))
    assert len(ent.live) < len(full.live)


def test_the_pool_refuses_what_it_cannot_hold(runner, prompts):
    with pytest.raises(ValueError, match="needs .* blocks .* the pool holds 100"):
        runner.serve(prompts[:1], CONFIGS["full"], pool_bytes(runner, 100), max_new_tokens=2)
    with pytest.raises(ValueError, match="at least one prompt"):
        runner.serve([], CONFIGS["full"], pool_bytes(runner, 100))
    with pytest.raises(ValueError, match="at least one block"):
        runner.serve(prompts[:1], CONFIGS["full"], 100)
    run = runner.serve(
        prompts[:2], CONFIGS["entropy-20"], pool_bytes(runner, 2000), max_new_tokens=0
    )
    assert run.tokens == [[], []] and run.live == []


# ------------------------------------------------------------------ the view and the lesson


def fake_comparison(n=1000, union_a=((100, 300), (50, 50)), allocation_b="global"):
    """A comparison of 2 layers x 2 KV heads, head dim 4, float32 (32 bytes a token's
    key and value): side A uniform, side B `allocation_b`, both keeping `union_a`."""
    from types import SimpleNamespace

    from pagekv.maths.plan import Plan

    pre = SimpleNamespace(token_bytes=32, n_layers=2, n_groups=2, question_ids=None)
    prep = SimpleNamespace(prefill=pre, n=n)

    def plan(allocation):
        config = EvictionConfig(policy="entropy", budget=0.2, page_size=16, allocation=allocation)
        p = SimpleNamespace(union_counts=lambda: [list(r) for r in union_a], config=config,
                            dense=False)  # fmt: skip
        p.allocated = Plan.allocated.fget(p)  # the rules Runner.evict stores by
        p.stored_counts = lambda: Plan.stored_counts(p)
        return p

    plans = {"A": plan("uniform"), "B": plan(allocation_b)}
    return SimpleNamespace(prep=prep, preps={"A": prep, "B": prep}, labels={"A": "A", "B": "B"},
                           plan_of=plans.__getitem__)  # fmt: skip


def test_the_pool_view_counts_prompts_by_hand():
    """A 1,000-token prompt with 24 answer tokens, full: 4 x 64 pages of 16 tokens x 32
    bytes = 131,072 bytes; the pool holds two, 262,144 bytes. Side A (uniform: each
    layer at its largest group) stores [[300, 300], [50, 50]]: 2 x 21 + 2 x 5 pages =
    832 tokens, 26,624 bytes, 9 held. Side B (global: each group its own) [[100, 300],
    [50, 50]]: 8 + 21 + 5 + 5 = 39 pages, 19,968 bytes, 13 held."""
    from pagekv.app.lessons import pool_holds
    from pagekv.app.run_figures import pool_rows

    live = pool_rows(fake_comparison())
    assert live["pool_bytes"] == 262_144
    got = {r["side"]: (r["bytes"], r["held"]) for r in live["rows"]}
    assert got == {"full": (131_072, 2), "A": (26_624, 9), "B": (19_968, 13)}
    assert pool_holds(4, 6).check(fake_comparison()).holds
    assert not pool_holds(4, 7).check(fake_comparison()).holds  # 13 < 7 x 2
    assert not pool_holds(5, 6).check(fake_comparison()).holds  # 9 < 5 x 2


@pytest.fixture(scope="module")
def bench_json(bundled, tmp_path_factory):
    """benchmarks/bench_capacity.py on two short prompts of the bundled model, with
    transformers' continuous batching, its JSON written."""
    from tests.benchmark_scripts import load

    out = tmp_path_factory.mktemp("capacity") / "capacity.json"
    args = ["--models", "bundled", "--prompts", "3", "--context", "800", "--new", "4",
            "--profile-rows", "1,2", "--out", str(out)]  # fmt: skip
    assert load("bench_capacity").main(args) == 0
    import json

    return json.loads(out.read_text())


def test_the_benchmark_measures_every_side_in_the_same_bytes(bench_json):
    block = bench_json["results"][0]
    sides = block["sides"]
    assert list(sides) == ["full", "entropy 20%", "entropy 10%", "transformers CB"]
    assert sides["full"]["fits"] == 2 == sides["full"]["held"]  # the pool: 2 full prompts
    assert sides["entropy 10%"]["held"] == 3 and sides["entropy 10%"]["fits"] >= 9
    assert sides["transformers CB"]["held"] <= 2  # it evicts nothing in the same bytes
    for name, s in sides.items():
        assert s["held"] <= s["fits"] or name == "transformers CB", name
        assert s["tokens"] > 0 and s["tok_s"] > 0 and 0 <= s["correct"] <= 1
    assert set(block["step_ms"]) == {"float16", "float32"}
    assert all(list(t) == ["1", "2"] for t in block["step_ms"].values())  # --profile-rows
    assert bench_json["cpu"]["model"] and bench_json["command"].startswith("python benchmarks/")


def test_the_lesson_quotes_the_benchmark_s_file(bench_json):
    """What the lesson says of the benchmark is read from its JSON, never restated."""
    from pagekv.app.figures import capacity_bars
    from pagekv.app.lessons import capacity_numbers, measured, pool_rows

    n = capacity_numbers("bundled", bench_json)
    sides = bench_json["results"][0]["sides"]
    assert n["cap_held_full"] == 2 and n["cap_held_e10"] == sides["entropy 10%"]["held"]
    assert n["cap_tps_e20"] == f"{sides['entropy 20%']['decode_tok_s']:.1f}"
    assert n["cap_held_x10"] == f"{sides['entropy 10%']['held'] / 2:.1f}"
    assert "cap_tps_cb" not in n  # transformers' decode alone is not measured
    with pytest.raises(ValueError, match="no block"):
        capacity_numbers("qwen-coder-0.5b", {**bench_json, "results": []})
    fig = capacity_bars(pool_rows(fake_comparison()), measured("bundled", bench_json))
    assert [list(t.y) for t in fig.data][0] == [2, 9, 13]
    assert "measured earlier, not live" in fig.layout.title.text


@pytest.mark.slow
def test_the_view_counts_the_same_on_a_served_comparison(bundled_study):
    """A finished run's views are drawn from the comparison without its prefill (what a
    lesson served from memory keeps): the pool's counts are the same on it."""
    from pagekv.app.run_figures import pool_rows
    from pagekv.engine.comparison import Side, compare
    from pagekv.engine.study import PromptSpec

    spec = PromptSpec(context=600, mode="after")
    a = Side.of("entropy", budget=0.3)
    b = Side.of("entropy", budget=0.2, allocation="global")
    comp = compare(bundled_study, spec, a, b, max_new_tokens=2)
    live = pool_rows(comp)
    assert pool_rows(comp.detached()) == live
    held = {r["side"]: r["held"] for r in live["rows"]}
    assert held["full"] == 2 and held["B"] > held["A"] > held["full"]
