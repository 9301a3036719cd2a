"""The terminal's progress line (`pagekv.progress`): drawn on a terminal only, redrawn
while a step runs, each finished step kept with its seconds; and the CLI's run on a
terminal says each step."""

from __future__ import annotations

import io
import json
import re
import threading

import pytest

from pagekv import progress
from pagekv.cli import main
from pagekv.progress import Steps


class Terminal(io.StringIO):
    """A stream that says it is a terminal, and tells when it was written to."""

    def __init__(self):
        super().__init__()
        self.written = threading.Event()

    def isatty(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self.written.set()
        return super().write(text)


def finished_lines(text: str) -> list[str]:
    """The lines a terminal shows at the end: each line's text after its last redraw."""
    return [line.split("\r\x1b[K")[-1] for line in text.split("\n") if line]


def test_a_step_is_redrawn_while_it_runs_and_kept_when_done(monkeypatch):
    monkeypatch.setattr(progress, "EVERY_S", 0.01)
    term = Terminal()
    steps = Steps(total=4, stream=term)
    with steps.step("loading"):
        pass
    with steps.step("prefilling"):
        term.written.clear()
        assert term.written.wait(5.0)  # the ticker redrew the line while the body ran
        assert term.getvalue().endswith("[##--------] 2 of 4 prefilling: 0 s")
    lines = finished_lines(term.getvalue())
    assert lines == ["[##--------] 1 of 4 loading: 0 s", "[#####-----] 2 of 4 prefilling: 0 s"]
    assert not [t for t in threading.enumerate() if t.name == "pagekv-progress"]


def test_a_step_that_fails_still_ends_its_line_and_raises():
    term = Terminal()
    steps = Steps(total=2, stream=term)
    with pytest.raises(ValueError), steps.step("decoding"):
        raise ValueError("no")
    assert term.getvalue().endswith("[#####-----] 1 of 2 decoding: 0 s\n")


def test_nothing_is_written_where_the_stream_is_no_terminal():
    out = io.StringIO()
    steps = Steps(total=2, stream=out)
    with steps.step("loading"), steps.step("inner"):
        pass
    assert out.getvalue() == "" and steps.done == 2


@pytest.mark.slow
def test_the_cli_run_says_each_step_on_a_terminal_and_nothing_in_a_pipe(monkeypatch, capsys):
    """`pagekv run --policy all` on a terminal: loading, the prefill, then each policy,
    on a bar of 9 steps; its JSON on stdout is the same as without a terminal."""
    argv = ["run", "--context", "300", "--budget", "0.3", "--policy", "all",
            "--scorer", "reconstruct", "--max-new-tokens", "2", "--json"]  # fmt: skip
    assert main(argv) == 0  # stderr is pytest's capture: no terminal
    piped = capsys.readouterr()
    assert "of 9" not in piped.err
    term = Terminal()
    monkeypatch.setattr("sys.stderr", term)
    assert main(argv) == 0
    lines = finished_lines(term.getvalue())
    assert [re.sub(r": \d+ s$", "", x) for x in lines] == [
        "[#---------] 1 of 9 loading bundled",
        "[##--------] 2 of 9 tokenizing and prefilling the prompt",
        "[###-------] 3 of 9 entropy: reconstruction pass, eviction, decoding",
        "[####------] 4 of 9 entropy_nosink: eviction and decoding",
        "[######----] 5 of 9 mean: eviction and decoding",
        "[#######---] 6 of 9 max: eviction and decoding",
        "[########--] 7 of 9 head_independent: eviction and decoding",
        "[#########-] 8 of 9 streaming: eviction and decoding",
        "[##########] 9 of 9 full: eviction and decoding",
    ]
    runs = json.loads(capsys.readouterr().out)["runs"]
    assert [r["answer"] for r in runs] == [r["answer"] for r in json.loads(piped.out)["runs"]]


def test_the_warm_up_logs_each_step_of_a_lesson_once_as_it_starts(caplog, monkeypatch):
    """The warm-up logs each step once as it starts (seconds and estimate, plain text), again only
    after `every_s`; no done lines."""
    from pagekv.app import lesson_handlers as lh

    clock = iter([0.0, 1.0, 2.0, 3.0, 14.0, 15.0, 16.0, 17.0])
    monkeypatch.setattr(lh.time, "perf_counter", lambda: next(clock))
    said = lh.WarmSteps("lesson 5 of 6", every_s=10.0)
    statuses = [
        "**Note:** Loading the model bundled (once)...",
        '**Note:** Reconstruction pass on bundled: 0 s of about 25 s <progress value="0.0" '
        'max="25.0"></progress>...; 1 job on the model worker now',
        "**Note:** Reconstruction pass on bundled: 1 s of about 25 s <progress></progress>...",
        "**Note:** Reconstruction pass on bundled: 2 s of about 25 s <progress></progress>...",
        "**Note:** Reconstruction pass on bundled: 13 s of about 25 s <progress></progress>...",
        "**Note:** Decoding... **bundled**: 2068 prompt tokens\n\n**Note:** Question inside.",
        "**Note:** Decoding... **bundled**: 2068 prompt tokens\n\n**Note:** Question inside."
        "\n\nA and B: token 3 of at most 24 <progress></progress>",
        "**Done:** bundled, 2068 prompt tokens",
    ]
    with caplog.at_level("INFO", logger="pagekv.app"):
        for status in statuses:
            said.show(status)
    assert [r.getMessage() for r in caplog.records] == [
        "lesson 5 of 6: Loading the model bundled (once)...",
        "lesson 5 of 6: Reconstruction pass on bundled: 0 s of about 25 s ...; 1 job on the "
        "model worker now",
        "lesson 5 of 6: Reconstruction pass on bundled: 13 s of about 25 s ...",
        "lesson 5 of 6: Decoding... bundled: 2068 prompt tokens",
        "lesson 5 of 6: A and B: token 3 of at most 24",
    ]
