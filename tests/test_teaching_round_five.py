"""What a newcomer still tripped on (issue 57), each with a check that failed before its
fix. Browser checks live in tests/test_browser_teaching.py."""

from __future__ import annotations

import re

import pytest

from pagekv import EvictionConfig
from pagekv.app.run_inputs import budget_rule, min_budget_pct

CFG = EvictionConfig(page_size=16, n_sink=4, window=32)


@pytest.mark.parametrize("got", [1e9, 150, "100.5", 101])
def test_a_budget_above_100_is_refused_with_the_upper_limits_reason(got):
    """Item 9: a budget of 1e9 was explained with the floor's reason ("below 3 % the
    protected pages ... do not fit")."""
    said = budget_rule("A", got, CFG, n=2000)
    floor = min_budget_pct(2000, CFG)
    assert said.startswith(f"Budget A must be a number from {floor:g} to 100 (% of the prompt)")
    assert "100 % keeps the whole of this 2000-token prompt, and no budget keeps more" in said
    assert "protected pages" not in said and "do not fit" not in said
    without_n = budget_rule("B", got, CFG)
    assert "keeps the whole of the prompt" in without_n and "do not fit" not in without_n


@pytest.mark.parametrize("got", [1, 0, -5, "abc", None])
def test_a_budget_below_the_floor_keeps_the_floors_reason(got):
    said = budget_rule("A", got, CFG, n=2000)
    assert "the protected pages (the first 4 tokens and the last 32" in said
    assert "keeps the whole" not in said


def test_lesson_8_says_what_it_compares_at():
    """Lesson 8 says what each comparison holds equal: the replay's T4 at one token
    budget, RULER at equal memory in each of three cache layouts (each named with the
    cache that holds memory so), and a lead only where its interval clears 0."""
    from pagekv.app.lessons import LAYOUT_NAMES, get_lesson, lesson_text

    lesson = get_lesson("kvpress-same-memory")
    assert "equal memory" in lesson.title and "cache by cache" in lesson.title
    text = " ".join(lesson_text(lesson).split())
    assert "at 20 % of a needle prompt" in text and "at equal memory in three cache" in text
    assert all(name in text for name in LAYOUT_NAMES.values())
    assert "A lead needs its 95 % interval clear of 0" in text
    assert "{" not in text  # every number filled in from the results


@pytest.mark.parametrize(
    "argv, said",
    [
        (["run", "--task", "qa", "--name", "nope"], "unknown qa task 'nope'; choose from"),
        (["run", "--task", "code", "--name", "qa_larkspur_wifi"], "unknown code task"),
        (["run", "--model", "no-such-model"], "cannot load model 'no-such-model'"),
        (["run", "--model", "no-org/no-model"], "the Hugging Face hub is unreachable"),
        (["run", "--budget", "0.01"], "--budget 0.01 keeps fewer tokens than the protected"),
        (["run", "--budget", "0.05", "--context", "300"], "of about 300 tokens hold: at least"),
    ],
)
def test_the_cli_refuses_a_task_or_model_before_loading_any_model(argv, said, monkeypatch, capsys):
    """Item 10: `--task qa --name nope` was refused after 10 s and `--model no-such-model`
    after 27 s, once a model had loaded. Now in one line, and no model loads."""
    import pagekv.runtime.models as models
    from pagekv.cli import main

    def no_load(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(models, "load_model", no_load)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("pagekv: error:") and err.count("\n") == 1, err
    assert said in err and "a model was loaded" not in err


@pytest.mark.slow
def test_every_refusal_keeps_the_last_results_and_says_why(bundled_study):
    """Item 8: `head_independent` with allocation `global` answered "No result" and
    cleared the table, while a refused budget kept the last results. Now both keep a
    session's last results and say why in one sentence; without earlier results the
    views are cleared, as before."""
    from types import SimpleNamespace

    from pagekv.app import handlers

    # A prompt of its own (seed 29): tests/test_handlers.py counts on prefilling seed 11.
    run = dict(task="needle", context=300, depth=0.5, mode="after", budget_pct=40.0, seed=29)
    shared = dict(policy_b="head_independent", allocation_b="global")
    i_status = handlers.RUN_VIEWS.index("status")
    kept = [handlers.RUN_VIEWS.index(k) for k in ("answers", "frame", "last")]
    # No earlier run in this session (none at all): every view cleared.
    (out,) = list(handlers.run_comparison(**run, **shared))
    assert "side B: allocation 'global' shares one budget" in out[i_status]
    assert out[handlers.RUN_VIEWS.index("last")] is None
    request = SimpleNamespace(session_hash="refusal-keeps-results")
    try:
        *_, done = handlers.run_comparison(**run, request=request)
        assert done[i_status].startswith("**Done:**")
        for refused in (shared, dict(budget_pct=0)):
            (out,) = list(handlers.run_comparison(**(run | refused), request=request))
            status = out[i_status]
            assert status.startswith("**Error:**") and "Nothing ran" in status, status
            assert all(out[i].get("__type__") == "update" and len(out[i]) == 1 for i in kept)
    finally:
        handlers.SESSIONS.end(request.session_hash)


def test_the_memory_chart_labels_say_their_unit():
    """Item 12: lesson 1's memory chart had a MiB axis over bar labels in tokens, with no
    unit on the labels."""
    from pagekv.app.figures.eviction import memory_bars

    fig = memory_bars([{"policy": "entropy", "tokens": 300, "bytes": 3 * 2**20}])
    assert fig.layout.yaxis.title.text == "KV cache kept (MiB)"
    assert list(fig.data[0].text) == ["300 tokens"]
    assert "MiB" in fig.data[0].hovertemplate and "per (layer, group)" in fig.data[0].hovertemplate


def test_the_head_that_gains_most_with_isolation_is_never_a_sink_head():
    """Item 12: in lesson 6 the "gains most with isolation" arrow pointed at a sink head,
    against lesson 3's text (the weight isolation takes from the sink heads goes to the
    others). The arrow and lesson 3's measurement pick among the other heads."""
    from types import SimpleNamespace

    import torch

    from pagekv.app.figures.eviction import head_weights_bars
    from pagekv.maths.metrics import isolation_gain

    iso = torch.tensor([[0.50, 0.30, 0.20, 0.40, 0.35, 0.25]])
    raw = torch.tensor([[0.20, 0.40, 0.40, 0.30, 0.30, 0.40]])  # head 0 gains 0.30, most
    sinks = torch.tensor([[True, False, False, False, True, False]])
    assert isolation_gain(iso[0], raw[0]) == (0, pytest.approx(0.3))  # unmasked: a sink
    assert isolation_gain(iso[0], raw[0], sinks[0]) == (3, pytest.approx(0.1))
    assert isolation_gain(iso[0], raw[0], torch.ones(6, dtype=torch.bool)) == (-1, 0.0)
    mass = torch.tensor([[0.9, 0.2, 0.7, 0.1, 0.8, 0.3]])
    p = SimpleNamespace(weights_isolated=iso, weights_nosink=raw, sink_heads=sinks, n_groups=2,
                        sink_mass=mass)  # fmt: skip
    fig = head_weights_bars(p, 0)
    marks = [a for a in fig.layout.annotations if "gains most" in a.text]
    assert [m.x for m in marks] == ["g1 h3"]
    # Head 2 loses most (0.20), with a sink mass of 0.70 though not labelled a sink.
    lost = [a for a in fig.layout.annotations if "loses most" in a.text]
    assert [(m.x, "(sink mass 0.70)" in m.text) for m in lost] == [("g0 h2", True)]


def test_the_served_study_keeps_the_lessons_prompts_apart(bundled_study):
    """Item 2: the app's study keeps the live lessons' prompts in its memos' kept parts
    (tests/test_memo.py shows exploration then cannot evict them): the 2000-token
    needle prompt, with the question inside and after."""
    from pagekv.app import handlers

    study = handlers.get_study("bundled")
    assert study.kept_prompts == handlers.LESSON_PROMPTS
    assert {(s.task, s.context, s.mode) for s in study.kept_prompts} == {
        ("needle", 2000, "inside"),
        ("needle", 2000, "after"),
    }
    assert study.prefills.kept_bytes >= 2 * 100 * 2**20  # two such prefills, 100 MiB each


def test_both_question_positions_follow_one_rule():
    """Item 6: changing side A's question position only marked the results stale (a
    prompt control), while side B's ran at once. Both now run at once, neither marks
    the results stale, and both say so under the control."""
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


def test_a_lesson_request_overtaken_by_a_later_one_shows_nothing(monkeypatch):
    """Item 7: quick presses of Next wait for the session's turn, which takes them in no
    set order; the last press's lesson must be the one the screen ends on. And a control
    changed while a lesson loads (its run event takes a ticket too) must keep its value.
    A lesson request that a later request of its session has overtaken leaves every
    output as it is from then on (the picker and the controls included); without one,
    each of its outputs carries the lesson's controls (what an API client reads)."""
    from types import SimpleNamespace

    import gradio as gr

    from pagekv.app import handlers
    from pagekv.app import lesson_handlers as lh
    from pagekv.app.sessions import SessionGate

    gate = SessionGate()
    first, second = gate.ticket("s"), gate.ticket("s")
    assert (gate.is_latest("s", first), gate.is_latest("s", second)) == (False, True)
    assert gate.is_latest(None, 0) and gate.ticket(None) == 0
    request = SimpleNamespace(session_hash="overtaken")
    arrives = []  # while the lesson runs: what else of whose session starts

    def stream_run(run, req):
        yield tuple(gr.update() for _ in lh.RUN_VIEWS)  # the plan views
        for start in arrives:
            start()
        yield tuple(gr.update() for _ in lh.RUN_VIEWS)  # the answers

    monkeypatch.setattr(lh, "stream_run", stream_run)
    monkeypatch.setattr(handlers, "stream_run", lambda inputs, req: iter(()))
    one, two = lh.LESSON_TITLES[0], lh.LESSON_TITLES[1]  # lesson 2 runs the model
    head = len(lh.LESSON_CONTROLS) + 2
    other = SimpleNamespace(session_hash="another session")
    cases = {
        "alone": [],
        "another session's press": [lambda: lh.SESSIONS.ticket(other.session_hash)],
        "a later press": [lambda: lh.SESSIONS.ticket(request.session_hash)],
        "a control changed": [lambda: list(handlers.run_comparison(request=request))],
    }
    try:
        for case, arrives[:] in cases.items():
            outs = list(lh.next_lesson(one, request=request))
            overtaken = case in ("a later press", "a control changed")
            assert len(outs) == (1 if overtaken else 2), case
            assert all(len(o) == 1 + len(lh.UNCHANGED) for o in outs)
            assert outs[0][0] == two  # the first output came before anything else
            if not overtaken:  # each output sets the lesson's controls
                assert all(o[0] == two and o[1 : 1 + head] == outs[0][1 : 1 + head] for o in outs)
    finally:
        lh.SESSIONS.end(request.session_hash)
        lh.SESSIONS.end(other.session_hash)


def test_a_long_step_says_what_runs_for_how_long_and_how_long_it_should(bundled_study, monkeypatch):
    """Item 3: a run's long waits (the prefill, the reconstruction pass, the decoding)
    each say in the status line which step runs, the seconds so far and, once a step of
    the kind was measured on the model, the seconds expected, with a bar; decoding says
    which token."""
    from pagekv.app import handlers

    monkeypatch.setattr(handlers, "STEP_QUIET_S", 0.0)  # every step shows, however short
    monkeypatch.setattr(handlers, "STEP_EVERY_S", 0.05)
    monkeypatch.setattr(handlers, "STREAM_EVERY_S", 0.0)
    i_status = handlers.RUN_VIEWS.index("status")
    run = dict(task="needle", context=400, depth=0.5, mode="after", budget_pct=40.0,
               scorer_a="reconstruct", scorer_b="reconstruct")  # fmt: skip

    def statuses(seed):
        outs = list(handlers.run_comparison(**run, seed=seed))
        said = list(dict.fromkeys(o[i_status] for o in outs if isinstance(o[i_status], str)))
        assert said[-1].startswith("**Done:**"), said[-1]
        return said

    statuses(41)  # a first prompt: the steps are measured on this model from here on
    said = statuses(42)
    prefill = [s for s in said if "Prefilling the prompt on" in s]
    rebuild = [s for s in said if s.startswith("**Note:** Reconstruction pass")]
    assert prefill and rebuild, [s[:80] for s in said]
    for step in (prefill[-1], rebuild[-1]):
        assert re.search(r": \d+ s of about \d+ s <progress value=\"[\d.]+\" max=\"[\d.]+\">", step)
    tokens = [s for s in said if re.search(r"A and B: token \d+ of at most \d+ <progress", s)]
    assert tokens, said
    study = handlers.get_study("bundled")  # the app's own, which ran them
    # Both kinds measured, each linear in the tokens (which is faster is the CPU's to say:
    # the pass reads the prompt twice, but short prompts' prefills carry fixed costs).
    for step in ("prefill", "reconstruct"):
        assert study.estimate(step, 800) == pytest.approx(2 * study.estimate(step, 400))
        assert study.estimate(step, 400) > 0
    assert study.estimate("nothing measured", 400) is None


def test_the_page_uses_the_systems_fonts():
    """Item 14: bold capitals ("GQA") rendered in a fallback face: Gradio's default theme
    asks for a web font in two weights. The theme now names system fonts only, so no
    face is fetched and every weight is the system's."""
    import app

    theme = app.launch_assets()["theme"]
    assert all(isinstance(f, str) for f in (*theme._font, *theme._font_mono)), theme._font
    assert theme._stylesheets == [] and "system-ui" in theme.font


def test_the_head_losing_most_with_isolation_is_marked_with_its_sink_mass(bundled_study):
    """Item 12: in lesson 3 the head losing most weight under isolation was not labelled a
    sink (its sink mass under the threshold), so the chart did not say why it lost. It is
    marked now, with its sink mass; and the weights view's caption speaks to both lessons
    that open it (3: sinks, 6: entropy against mean), not to lesson 3 alone."""
    from pagekv.app.figures import head_weights_bars
    from pagekv.app.page_text import CAPTIONS

    runner = bundled_study.runner
    ids = bundled_study.tokenizer.encode("Sinks and heads: a page of plain words. " * 40)[:320]
    pre = runner.prefill(ids, window_max=32)
    plan = runner.plan(pre, EvictionConfig(policy="entropy", budget=0.3))
    loss = plan.weights_nosink - plan.weights_isolated  # [L, H]
    layer = int(loss.max(-1).values.argmax())
    head = int(loss[layer].argmax())
    fig = head_weights_bars(plan, layer)
    marks = [a for a in fig.layout.annotations if "loses most" in (a.text or "")]
    assert len(marks) == 1
    assert marks[0].x.startswith(f"g{head // 3} h{head}")
    assert f"(sink mass {float(plan.sink_mass[layer, head]):.2f})" in marks[0].text
    caption = CAPTIONS["weights"]
    assert "1/r" in caption and "losing most" in caption and "sink heads that gain" not in caption


def test_after_a_preset_the_lesson_box_defers_to_the_presets_verdict(monkeypatch):
    """Item 12: after a preset, the status line said its check "holds" while the lesson
    box said "not checked" (the lesson's settings no longer held): two verdicts at odds.
    The lesson box now says no observation belongs to the run and where the preset's
    verdict is."""
    import gradio as gr

    from pagekv.app import handlers

    i_obs = handlers.RUN_VIEWS.index("observation")

    def stream_run(run, request):
        views = [gr.update() for _ in handlers.RUN_VIEWS]
        views[i_obs] = "**Observation:** something - *not checked: the controls no longer hold*"
        yield tuple(views)

    monkeypatch.setattr(handlers, "stream_run", stream_run)
    from pagekv.app.lesson_checks import LESSON_TITLES

    lesson_of_one = LESSON_TITLES[0]
    preset = handlers.load_presets()[0]
    (out,) = list(handlers.run_preset(preset["title"], "bundled", lesson_of_one))
    said = out[len(handlers.PRESET_CONTROLS) + 2 + i_obs]
    assert "not checked" not in said and preset["title"] in said and "status line" in said
