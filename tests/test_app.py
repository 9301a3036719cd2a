"""The Gradio app through its HTTP API (gradio_client against a launched app): every endpoint with
good and bad input, the answers table, the figures' traces and the exported files. Bad input
comes back as a message (never a traceback) and the next request still works. Tests share one
server and client; the first `/run` is the `first_run` session fixture."""

from __future__ import annotations

import base64
import csv
import json
import logging
import math
import re
import time
from pathlib import Path

import numpy as np
import pytest

from .app_server import answer_headers, answer_rows, launched_app

pytest.importorskip("gradio_client")
from gradio_client import Client  # noqa: E402
from gradio_client.exceptions import AppError  # noqa: E402

import app  # noqa: E402  (RUN_VIEWS: the names of the run outputs)
from pagekv.app.handlers import MODELS  # noqa: E402
from pagekv.app.run_figures import ANSWER_HEADERS  # noqa: E402

#: gradio's own use of pandas (not ours) warns on every Dataframe output.
pytestmark = [
    pytest.mark.filterwarnings("ignore:.*no_silent_downcasting"),
    pytest.mark.filterwarnings("ignore:The copy keyword is deprecated"),
]

#: SmolLM2-135M (the bundled model): 30 layers, 3 KV groups of 3 query heads.
LAYERS, GROUPS, HEADS = 30, 3, 9
#: What /run returns: every run view but the session's last run (a gr.State, kept
#: server-side), in the order app.RUN_VIEWS names them.
N_OUT = len([v for v in app.RUN_VIEWS if v != "last"])
PLOTS = [
    "frame",
    "retention",
    "weights",
    "overview",
    "sink_mass",
    "sink_adv",
    "uor",
    "stored",
    "memory",
    "capacity",
    "glance",
]

#: A short needle prompt, question asked after compression.
GOOD = dict(
    model="bundled",
    task="needle",
    context=300,
    depth=0.5,
    seed=0,
    needles=1,
    mode="after",
    curated=None,
    haystack="",
    needle="",
    question="",
    answer="",
    budget_pct=30,
    page_size=16,
    n_sink=4,
    window=32,
    tau=1.0,
    policy_a="mean",
    policy_b="entropy",
    layer=0,
)
HAY = "The river ran past the old mill. Farmers brought their grain in autumn. "
NEEDLE = "The vault code is 4417."
QUESTION = "What is the vault code?"


@pytest.fixture(scope="session")
def server():
    with launched_app() as (demo, url):
        yield demo, url


@pytest.fixture(scope="session")
def client(server):
    return Client(server[1], verbose=False)


@pytest.fixture
def fresh_client(server):
    """A client with its own session (no earlier /run in its state)."""
    return Client(server[1], verbose=False)


def run(client, api_name="/run", **changes):
    out = client.predict(**(GOOD | changes), api_name=api_name)
    assert len(out) == N_OUT
    return out


def array(v) -> list:
    """A plotly JSON array as lists: plain lists as they are, numpy arrays as plotly
    sends them (base64 `bdata` with `dtype` and `shape`) decoded."""
    if isinstance(v, dict) and "bdata" in v:
        shape = [int(x) for x in str(v.get("shape", "-1")).split(",")]
        flat = np.frombuffer(base64.b64decode(v["bdata"]), dtype=np.dtype(v["dtype"]))
        return flat.reshape(shape).tolist()
    return v


def plotly(value) -> dict:
    """The figure JSON of a gr.Plot output."""
    assert value is not None and value["type"] == "plotly", value
    return json.loads(value["plot"])


def assert_error(out, *phrases):
    """A failed run: a message (no traceback) in the status, every other output empty."""
    status = out[0]
    assert status.startswith("**Error:**"), status
    assert "Traceback" not in status and 'File "' not in status, status
    for phrase in phrases:
        assert phrase.lower() in status.lower(), (phrase, status)
    assert answer_rows(out[1]) == []
    views = dict(zip(app.RUN_VIEWS, out, strict=False))
    for name in PLOTS:  # no empty frame, and nothing of an earlier run: a figure saying why
        fig = plotly(views[name])
        assert fig["data"] == [] and "No result" in fig["layout"]["annotations"][0]["text"]
    assert views["files"] is None


def prompt_tokens(status: str) -> int:
    m = re.search(r"(\d+) prompt tokens", status)
    assert m, status
    return int(m.group(1))


def prefill_seconds(status: str) -> str:
    m = re.search(r"prefill ([\d.]+)s", status)
    assert m, status
    return m.group(1)


def page_sizes(n: int, page: int) -> list[int]:
    return [min(page, n - s) for s in range(0, n, page)]


def protected_tokens(n: int, page: int, n_sink: int, window: int) -> int:
    """Tokens on the pages that hold a sink token (t < n_sink) or a window token."""
    pages = {t // page for t in range(min(n_sink, n))}
    pages |= {t // page for t in range(max(n - window, 0), n)}
    sizes = page_sizes(n, page)
    return sum(sizes[j] for j in pages)


def expected_kept(n: int, budget: float, page: int, n_sink: int, window: int) -> int:
    """Protected pages plus as many whole pages as fit in floor(budget * n)."""
    prot = protected_tokens(n, page, n_sink, window)
    k = math.floor(budget * n + 1e-9)
    assert prot <= k, "the test's spec must be feasible"
    return prot + (k - prot) // page * page


def server_prep(server, context: int):
    """The memoised prefill of the GOOD spec with `context` tokens (server side)."""

    study = MODELS.studies["bundled"]
    memo = study.prefills.items()
    found = [
        p for s, p in memo if s.task == "needle" and s.context == context and s.seed == GOOD["seed"]
    ]  # other tests prefill other seeds of the same length
    assert len(found) == 1, list(study.prefills)
    return found[0]


@pytest.fixture(scope="session")
def first_run(client):
    t0 = time.perf_counter()
    out = run(client)
    wall = time.perf_counter() - t0
    print(f"\nfirst /run ({GOOD['context']} tokens, model load + prefill): {wall:.1f}s")
    return out, wall


@pytest.mark.slow
def test_run_status_names_prompt_and_answer(server, first_run):
    out, _ = first_run
    status = out[0]
    assert status.startswith("**Done:**"), status
    prep = server_prep(server, GOOD["context"])
    n = prompt_tokens(status)
    assert n == prep.n and GOOD["context"] - 20 <= n <= GOOD["context"] + 40
    assert f"Expected: **{prep.task.answer}**" in status
    assert prep.task.question in status
    assert f"budget {math.floor(0.3 * n)} tokens" in status
    assert "page size 16" in status


@pytest.mark.slow
def test_run_answers_table(server, first_run):
    out, _ = first_run
    n = prompt_tokens(out[0])
    expected = server_prep(server, GOOD["context"]).task.answer
    table = out[1]
    assert answer_headers(table) == ANSWER_HEADERS
    rows = answer_rows(table)
    assert [r[0] for r in rows] == ["full cache", "A: mean", "B: entropy"]
    kept = expected_kept(n, 0.3, 16, 4, 32)
    assert kept <= math.floor(0.3 * n)
    assert [r[3] for r in rows] == [str(n), str(kept), str(kept)]
    for r in rows:
        right = expected.casefold() in r[2].casefold()
        assert r[1] == ("✓ right" if right else "✗ wrong"), r
        assert 0.0 <= float(r[4]) <= 1.0  # needle fraction kept
        assert re.fullmatch(r"\d+ of 90", r[5]), r  # needle page kept in X of L*G
        assert float(r[6]) == 1.0  # pooled policies store exactly their budget: UOR 1
    assert rows[0][5] == "90 of 90", "the full cache keeps the needle page everywhere"
    assert rows[0][7] == "-", "the full cache evicts nothing: no eviction time"
    assert all(r[7].endswith(" ms") for r in rows[1:])
    assert rows[0][1] == "✓ right", "the full cache should find a 300-token needle"
    assert rows[0][4] == "1.00"


@pytest.mark.slow
def test_run_page_frame(first_run):
    out, _ = first_run
    n = prompt_tokens(out[0])
    fig = plotly(out[2])
    heat = [
        t
        for t in fig["data"]
        if t["type"] == "heatmap" and t.get("meta", {}).get("role") == "overview"
    ]
    assert len(heat) == 2  # policy A and policy B side by side
    strips = [t for t in fig["data"] if t.get("meta", {}).get("role") == "needle_strip"]
    assert len(strips) == 2, "a needle strip per side (a needle task)"
    sizes = page_sizes(n, 16)
    kept = int(answer_rows(out[1])[1][3])
    for t in heat:
        assert len(t["y"]) == LAYERS * GROUPS == 90
        assert t["y"][:4] == ["L0 g0", "L0 g1", "L0 g2", "L1 g0"]
        z = array(t["z"])
        assert all(len(row) == len(sizes) for row in z)
        # Every (layer, group) keeps the same number of tokens as the table reports.
        for row in z:
            assert set(row) <= {0, 1, 2}
            assert sum(s for s, v in zip(sizes, row, strict=True) if v) == kept
            assert row[0] == 2 and row[-1] == 2  # sink and window pages are protected
    titles = [a["text"] for a in fig["layout"]["annotations"]]
    assert "A: mean" in titles and "B: entropy" in titles
    assert any(s["type"] == "rect" for s in fig["layout"].get("shapes", []))  # needle outline
    legend = {t.get("name") for t in fig["data"] if t["type"] == "scatter"}
    assert {"evicted", "kept", "protected"} <= legend


@pytest.mark.slow
def test_run_other_plots(first_run):
    out, _ = first_run
    figs = dict(zip(PLOTS, out[2 : 2 + len(PLOTS)], strict=True))
    for name, value in figs.items():
        assert plotly(value)["data"], name
    ret = [t for t in plotly(figs["retention"])["data"] if t["type"] == "heatmap"]
    assert len(ret) == 2 and all(len(t["y"]) == LAYERS and len(t["x"]) == GROUPS for t in ret)
    bars = plotly(figs["weights"])["data"]
    assert [t["type"] for t in bars] == ["bar", "bar"]
    assert all(len(t["x"]) == HEADS for t in bars)
    for t in bars:  # weights within each group of 3 heads sum to 1
        for g in range(GROUPS):
            assert sum(t["y"][3 * g : 3 * g + 3]) == pytest.approx(1.0, abs=1e-4)
    assert "layer 0" in plotly(figs["weights"])["layout"]["title"]["text"]
    over = plotly(figs["overview"])["data"][0]
    assert over["type"] == "heatmap" and len(over["z"]) == LAYERS and len(over["z"][0]) == HEADS
    stored = [t for t in plotly(figs["stored"])["data"] if t["type"] == "heatmap"]
    assert len(stored) == 2 and all(len(t["z"]) == LAYERS for t in stored)
    n = prompt_tokens(out[0])
    kept, k = int(answer_rows(out[1])[1][3]), math.floor(0.3 * n)  # stored tokens of A, the budget
    ratios = [v for t in stored for row in t["z"] for v in row]
    assert len(ratios) == 2 * LAYERS * GROUPS
    assert all(v == pytest.approx(kept / k) for v in ratios), "pooled: the same count everywhere"
    mem = plotly(figs["memory"])["data"][0]
    # Each bar names its policy, and how it was planned (at side B's settings).
    assert mem["type"] == "bar" and "entropy<br>window, uniform" in mem["x"] and "full" in mem["x"]
    held = plotly(figs["capacity"])["data"][0]  # the live panel: a pool of two full caches
    assert held["x"][0] == "full cache" and held["y"][0] == 2 < held["y"][1]


@pytest.mark.slow
def test_run_exports_on_request(fresh_client, first_run, caplog):
    """A run writes no files; the Export tab's /export writes this session's last run."""
    with pytest.raises(AppError, match="Nothing to export yet"):
        fresh_client.predict(api_name="/export")
    caplog.set_level(logging.INFO, logger="pagekv.app")
    out = run(fresh_client)  # the same settings as first_run: served from memory
    assert "served from memory" in out[0] and "served from memory" not in first_run[0][0]
    lines = [r.getMessage() for r in caplog.records if "views served from memory" in r.getMessage()]
    assert len(lines) == 1 and "mean budget 0.3 page 16" in lines[0], lines
    assert answer_rows(out[1]) == answer_rows(first_run[0][1])  # the answers of the first run
    assert dict(zip(app.RUN_VIEWS, out, strict=False))["files"] is None  # none until asked
    n = prompt_tokens(out[0])
    paths = {Path(p).name: Path(p) for p in fresh_client.predict(api_name="/export")}
    assert set(paths) == {"pagekv_run.json", "pagekv_run.csv", "pagekv_figures.html"}
    assert all(p.is_file() and p.stat().st_size > 0 for p in paths.values())
    data = json.loads(paths["pagekv_run.json"].read_text())
    assert set(data["runs"]) == {"full", "A", "B"}
    assert data["runs"]["A"]["policy"] == "mean" and data["runs"]["B"]["policy"] == "entropy"
    assert data["prompt_tokens"] == n
    assert data["runs"]["full"]["answer"] == answer_rows(out[1])[0][2]
    assert str(data["runs"]["B"]["kept_tokens"][0]) == answer_rows(out[1])[2][3]
    with paths["pagekv_run.csv"].open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 3 * LAYERS * GROUPS
    assert {r["run"] for r in rows} == {"full", "A", "B"}
    assert "plotly" in paths["pagekv_figures.html"].read_text()[:200_000].lower()


@pytest.mark.slow
def test_budget_reuses_the_prefill(server, client, first_run):
    """/budget after a /run of the same prompt reuses its Prompt: no new prefill."""
    out1 = run(client)
    prep = server_prep(server, GOOD["context"])
    assert prep is not None
    t0 = time.perf_counter()
    out = run(client, api_name="/budget", budget_pct=40)
    wall = time.perf_counter() - t0
    print(f"\n/budget after /run: {wall:.1f}s (first /run {first_run[1]:.1f}s)")
    assert out[0].startswith("**Done:**"), out[0]
    assert server_prep(server, GOOD["context"]) is prep  # the same Prompt: no new prefill
    assert prefill_seconds(out[0]) == prefill_seconds(out1[0])
    n = prompt_tokens(out[0])
    rows = answer_rows(out[1])
    assert [int(r[3]) for r in rows] == [n] + [expected_kept(n, 0.4, 16, 4, 32)] * 2
    assert rows[0][2] == answer_rows(out1[1])[0][2]  # the full cache's answer is memoised


@pytest.mark.slow
def test_layer_redraws_from_the_last_run(client, first_run):
    fig = plotly(client.predict(7, api_name="/layer"))
    assert "layer 7" in fig["layout"]["title"]["text"]
    assert [len(t["x"]) for t in fig["data"]] == [HEADS, HEADS]
    fig = plotly(client.predict(LAYERS - 1, api_name="/layer"))
    assert f"layer {LAYERS - 1}" in fig["layout"]["title"]["text"]


def test_layer_without_a_run_is_empty_and_out_of_range_is_refused(fresh_client):
    assert fresh_client.predict(1, api_name="/layer") is None  # before a run: slider 0..1
    with pytest.raises(AppError, match="maximum"):
        fresh_client.predict(99, api_name="/layer")
    assert fresh_client.predict(0, api_name="/layer") is None  # and the next call works


@pytest.mark.slow
@pytest.mark.parametrize(
    "changes, phrases",
    [
        pytest.param(dict(task="custom", haystack="   "), ["custom prompt is empty"], id="empty"),
        pytest.param(
            dict(task="custom", haystack=HAY, needle="", question=QUESTION, answer="4417"),
            ["needs needle"],
            id="no-needle",
        ),
        pytest.param(
            dict(task="custom", haystack=HAY, needle=NEEDLE, question=QUESTION, answer=""),
            ["needs answer"],
            id="no-answer",
        ),
        pytest.param(
            dict(
                task="custom",
                haystack="The quick brown fox jumps over the lazy dog by the river. " * 800,
                needle=NEEDLE,
                question=QUESTION,
                answer="4417",
            ),
            ["more than the model's context of 8192", "shorten it"],
            id="too-long",
        ),
    ],
)
def test_run_bad_input_gives_a_message(client, first_run, changes, phrases):
    assert_error(run(client, **changes), *phrases)


@pytest.mark.slow
@pytest.mark.parametrize(
    "changes, phrases",
    [
        pytest.param(
            dict(budget_pct=5),
            ["Budget A must be a number from", "to 100 (% of the prompt)", "got 5."],
            id="budget-below-protected",
        ),
        pytest.param(
            dict(
                task="custom",
                haystack=HAY,
                needle=NEEDLE,
                question=QUESTION,
                answer="4417",
                page_size=64,
                budget_pct=60,
            ),
            ["Budget A must be a number from 100 to 100", "in pages of 64", "got 60."],
            id="page-larger-than-prompt",
        ),
    ],
)
def test_a_refused_budget_keeps_the_sessions_last_results(client, first_run, changes, phrases):
    """A refused budget keeps the last run's results and puts the box back at 30."""
    assert run(client)[0].startswith("**Done:**")  # GOOD: 30 %, served from memory
    out = run(client, **changes)
    status = out[0]
    assert status.startswith("**Error:**") and "Traceback" not in status, status
    for phrase in phrases:
        assert phrase in status, (phrase, status)
    assert "Nothing ran: the budget is back at 30 %" in status, status
    views = dict(zip(app.RUN_VIEWS, out, strict=False))
    assert views["budget"]["value"] == 30 and views["budget_b"]["value"] == 30
    kept = [views[name] for name in ("answers", *PLOTS)]  # updates that change nothing
    assert all(isinstance(v, dict) and v.get("__type__") == "update" for v in kept), kept
    assert not any("value" in v or "value" in v.get("props", {}) for v in kept), kept


@pytest.mark.slow
def test_budget_message_names_the_smallest_feasible_budget(client, first_run):
    out = run(client, budget_pct=5)
    n = prompt_tokens(first_run[0][0])
    prot = protected_tokens(n, 16, 4, 32)
    m = re.search(r"from ([\d.]+) to 100 .* in this (\d+)-token prompt; got 5\.", out[0])
    assert m and int(m.group(2)) == n, out[0]
    named = float(m.group(1)) / 100  # on the page's step, rounded up: itself feasible
    assert prot / n <= named < prot / n + 0.005 and math.floor(named * n + 1e-9) >= prot
    assert "the first 4 tokens and the last 32, in pages of 16" in out[0], out[0]


@pytest.mark.slow
def test_needle_already_in_the_haystack_stays_where_it_is(client, server):
    """The app passes depth=None when the needle is in the text: no second copy is added."""
    hay = HAY * 2 + NEEDLE + " " + HAY * 2
    out = run(
        client,
        task="custom",
        haystack=hay,
        needle=NEEDLE,
        question=QUESTION,
        answer="4417",
        budget_pct=60,
        window=16,
    )
    assert out[0].startswith("**Done:**"), out[0]
    assert "Expected: **4417**" in out[0]

    study = MODELS.studies["bundled"]
    (prep,) = [p for s, p in study.prefills.items() if s.task == "custom" and s.haystack == hay]
    assert prep.spec.depth is None
    assert prep.task.context.count(NEEDLE) == 1
    assert prep.needle_positions  # the needle's answer tokens are tracked


@pytest.mark.slow
def test_next_run_after_errors_works(client, first_run):
    assert_error(run(client, task="custom", haystack=""), "empty")
    out = run(client, budget_pct=30)
    assert out[0].startswith("**Done:**"), out[0]
    # The same configuration as the first run: the same answers and kept tokens.
    assert [r[:6] for r in answer_rows(out[1])] == [r[:6] for r in answer_rows(first_run[0][1])]


@pytest.mark.slow
def test_a_name_the_server_does_not_offer_is_refused_in_one_sentence(client, first_run):
    loaded_before = MODELS.loaded_names()
    for name in ("no-such-org/no-such-model", "/etc", "../models"):
        out = run(client, model=name)
        assert out[0].startswith("**Error:** this server does not offer the model"), out[0]
        assert "\n" not in out[0]
        assert out[1] is None or answer_rows(out[1]) in ([], [[]]), out[1]  # no answers
    assert MODELS.loaded_names() == loaded_before and MODELS.failures() == 0  # nothing tried
    out = run(client)  # and the bundled model again
    assert out[0].startswith("**Done:**") and "fell back" not in out[0]


@pytest.mark.slow
def test_unknown_model_falls_back_to_bundled_when_hub_models_are_allowed(
    client, first_run, monkeypatch
):
    monkeypatch.setattr(MODELS, "allow_hub", True)
    out = run(client, model="no-such-org/no-such-model")
    status = out[0]
    assert status.startswith("**Done:**"), status
    assert "**bundled**" in status
    assert "no-such-org/no-such-model" in status and "fell back to the bundled" in status
    assert len(answer_rows(out[1])) == 3
    out = run(client)  # and the bundled model again
    assert out[0].startswith("**Done:**") and "fell back" not in out[0]


def test_preset_fills_the_controls(client):
    import app
    from pagekv.tasks import task_names

    for p in app.PRESETS:
        out = client.predict(p["title"], api_name="/preset")
        assert out[0] == p["task"]
        if p["task"] in ("qa", "code"):  # the curated picker follows the preset
            picked = out[1]["value"] if isinstance(out[1], dict) else out[1]
            assert picked == (p["curated"] or task_names(p["task"])[0])
        assert list(out[2:]) == [
            p["context"], p["depth"], p["seed"], p["needles"], p["mode"],
            round(100 * p["budget"], 1), p["page_size"], p["n_sink"], p["window"], p["tau"],
            p["policy_a"], p["policy_b"],
            *(p.get(f"{w}_{s}", d) for s in ("a", "b")
              for w, d in (("scorer", "window"), ("allocation", "uniform"))),
            p["model"] or "bundled",  # a preset's own model, else the server's default
        ]  # fmt: skip


def test_unknown_preset_is_refused_and_the_next_works(client):
    import app

    with pytest.raises(AppError, match="not in the list of choices"):
        client.predict("no such preset", api_name="/preset")
    assert client.predict(app.PRESETS[0]["title"], api_name="/preset")[0] == "needle"


MECH = dict(heads=3, retrieval=0.9, distractors=2, distractor_strength=0.48, sink_head=False)


def mechanism(client, **changes):
    kw = MECH | dict(n=64, budget_pct=19) | changes
    return client.predict(*kw.values(), api_name="/mechanism")


def test_mechanism_defaults(client):
    text, table, plot = mechanism(client)
    assert text.startswith("**Note:**") and "w* = " in text and "1/r = 0.333" in text
    rows = {r[0]: r for r in table["data"]}
    assert set(rows) == {"entropy", "entropy_nosink", "mean", "max"}
    # The construction: entropy pooling keeps the needle page, mean pooling loses it.
    assert rows["entropy"][1] == "kept" and rows["mean"][1] == "evicted"
    assert rows["mean"][2] == "retrieval 0.33, distractor 0.33, distractor 0.33"
    w = [float(x.split()[-1]) for x in rows["entropy"][2].split(", ")]
    assert sum(w) == pytest.approx(1.0, abs=0.02) and w[0] > 1 / 3
    assert plotly(plot)["data"]


def test_mechanism_with_a_sink_head(client):
    text, table, _ = mechanism(client, heads=4, sink_head=True)
    assert text.startswith("**Note:**")
    roles = table["data"][0][2]
    assert "sink" in roles and roles.count(", ") == 3


@pytest.mark.parametrize(
    "changes, phrase",
    [
        pytest.param(dict(heads=2, distractors=6), "do not fit in 2 heads", id="too-many-heads"),
        pytest.param(dict(heads=3, distractors=2, sink_head=True), "using 1", id="no-room"),
        pytest.param(dict(budget_pct=5), "cannot hold the sink and window pages", id="budget"),
    ],
)
def test_mechanism_adjusts_impossible_values_and_says_so(client, changes, phrase):
    """Every slider combination gives a view; what had to change is said in the text."""
    text, table, plot = mechanism(client, **changes)
    assert text.startswith("**Note:**") and phrase in text, text
    assert len(table["data"]) == 4 and plot is not None


def test_mechanism_out_of_range_is_taken_at_the_nearest_end_and_said(client):
    """As the page's box shows it after leaving it: the nearest end of the range."""
    text, table, plot = mechanism(client, retrieval=1.9, n=5000)
    assert "Retrieval s*: 1.9 is above its range (0 to 1), using 1." in text, text
    assert "Tokens: 5000 is above its range (32 to 1024), using 1024." in text, text
    assert table["data"] and plot is not None
    text, *_ = mechanism(client, heads=None)
    assert "Heads per group: no number, using 2." in text, text
    assert mechanism(client)[0].startswith("**Note:**")


@pytest.mark.slow
def test_each_side_is_a_full_configuration(client, first_run):
    """B with its own budget and page size (link_b off): both run on one prefill, the
    table titles say what differs, and B stores exactly its own budget (pages of 1)."""
    b = dict(mode_b="after", budget_b=60, page_size_b=1, n_sink_b=4, window_b=32, tau_b=1.0)
    out = run(client, link_b=False, **b)
    assert out[0].startswith("**Done:**"), out[0]
    n = prompt_tokens(out[0])
    rows = answer_rows(out[1])
    assert [r[0] for r in rows[1:]] == [
        "A: mean, page 16, budget 30%",
        "B: entropy, page 1, budget 60%",
    ]
    assert int(rows[2][3]) == math.floor(0.6 * n)  # token-level pages: exactly the budget
    assert rows[1][3] == answer_rows(first_run[0][1])[1][3]  # A as in the first run


def test_lesson_sets_both_sides(client):
    """/lesson fills every control from the lesson: here page size 16 against 1."""
    i = [x.id for x in app.LESSONS].index("pages-vs-tokens")
    out = client.predict(app.LESSON_TITLES[i], api_name="/lesson")
    values = dict(zip(app.LESSON_CONTROLS, out, strict=False))
    lesson = app.LESSONS[i]
    assert values["page_size"] == lesson.a.config.page_size == 16
    assert values["page_size_b"] == lesson.b.config.page_size == 1
    assert values["link_b"] is False
    assert values["policy_a"] == values["policy_b"] == "entropy"
    assert lesson.title in out[len(app.LESSON_CONTROLS)]  # the text (the tabs stay client-side)


@pytest.mark.slow
def test_a_class_of_concurrent_runs_pairs_and_lessons_never_hangs(server):
    """Eight sessions at once (lessons, batched pairs, sides on different prompts, repeats): every
    request returns in time with its answers."""
    url = server[1]
    lessons = [t for t, x in zip(app.LESSON_TITLES, app.LESSONS, strict=True) if x.kind == "live"]
    side_b = dict(mode_b="inside", budget_b=35, page_size_b=16, n_sink_b=4, window_b=32, tau_b=1.0)
    requests = [
        ("/lesson", (lessons[0],)),
        ("/lesson", (lessons[1],)),
        ("/lesson", (lessons[0],)),
        ("/run", GOOD | dict(budget_pct=25)),  # A and B: one batched pair
        ("/run", GOOD | dict(budget_pct=25)),  # the same run: computed once
        ("/run", GOOD | dict(budget_pct=35, link_b=False, **side_b)),  # sides apart
        ("/budget", GOOD | dict(budget_pct=40)),
        ("/run", GOOD | dict(budget_pct=25, policy_a="head_independent")),
    ]
    jobs = []
    for api, args in requests:
        c = Client(url, verbose=False)
        if isinstance(args, dict):
            job = c.submit(**args, api_name=api)
        else:
            job = c.submit(*args, api_name=api)
        jobs.append((api, job))
    for api, job in jobs:
        out = job.result(timeout=600)  # raises TimeoutError when a request hangs
        if api == "/lesson":
            status = out[len(app.LESSON_CONTROLS) + 1]  # after the controls and the text
        else:
            status = out[0]
        assert str(status).startswith("**Done:**"), (api, status)


def test_both_question_positions_follow_one_rule():
    """Both sides' question positions follow one rule: a change runs at once (neither
    only marks the results stale), and both say so under the control."""
    import app
    from pagekv.app.page_text import MODE_INFO

    demo = app.build_demo()
    radios = [b for b in demo.blocks.values() if getattr(b, "label", None) and
              str(b.label).startswith("Question position")]  # fmt: skip
    assert len(radios) == 2

    def on_input(block) -> set:
        """What an edit of `block` triggers: handler names, or "js" for a browser-only one."""
        return {
            getattr(f.fn, "__name__", None) or "js"
            for f in demo.fns.values()
            if (block._id, "input") in [(t[0], t[1]) for t in f.targets]
        }

    assert on_input(radios[0]) == on_input(radios[1]) == {"run_comparison"}
    assert all(r.info == MODE_INFO for r in radios)


def test_the_page_uses_the_systems_fonts():
    """The theme names system fonts only (Gradio's default asks for a web font in two
    weights, and bold capitals fell back to another face): no face is fetched."""
    import app

    theme = app.launch_assets()["theme"]
    assert all(isinstance(f, str) for f in (*theme._font, *theme._font_mono)), theme._font
    assert theme._stylesheets == [] and "system-ui" in theme.font
