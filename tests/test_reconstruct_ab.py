"""`experiments/reconstruct_ab.py`'s `--variant`: a setting with EvictionConfig fields
changed, run on the same prefill as the others, gives what the same fields given as the
script's flags give."""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import pytest

from tests.benchmark_scripts import load


def _script():
    return load("reconstruct_ab")


def test_variant_reads_fields_and_refuses_what_is_not_a_config():
    ab = _script()
    name, changes = ab.variant(" sum, tau 0.5: page_reduction=sum tau=0.5 window=1")
    assert name == "reconstruct/max, global, sum, tau 0.5"
    assert changes == {"page_reduction": "sum", "tau": 0.5, "window": 1}
    assert isinstance(changes["window"], int)
    for bad, says in [
        ("no colon window=1", "LABEL"),
        (": window=1", "LABEL"),
        ("label:", "LABEL"),
        ("x: colour=red", "colour"),
        ("x: window", "window"),
        ("x: page_reduction=median", "page_reduction must be one of"),
        ("x: policy=head_independent", "selects per head"),
    ]:
        with pytest.raises(argparse.ArgumentTypeError, match=says):
            ab.variant(bad)


def _run(ab, tmp_path, name, *argv):
    out = tmp_path / f"{name}.json"
    ab.main(["--contexts", "500", "--budgets", "0.2", "--json", str(out), *argv])
    return json.loads(out.read_text())["rows"]


@pytest.fixture
def one_prompt(bundled_study, monkeypatch):
    """The script on the bundled model's study and one 500-token prompt."""
    ab = _script()
    monkeypatch.setattr(ab, "Study", SimpleNamespace(load=lambda *a, **k: bundled_study))
    first = ab.t4_specs
    monkeypatch.setattr(ab, "t4_specs", lambda *a: first(*a)[:1])
    return ab


def test_a_variant_row_is_the_run_of_its_fields_as_flags(one_prompt, tmp_path):
    ab = one_prompt
    base = "reconstruct/max, global"
    rows = _run(ab, tmp_path, "variant", "--settings", base, "--variant", "p8: page_size=8")
    flags = _run(ab, tmp_path, "flags", "--settings", base, "--page-size", "8")
    mine, theirs = rows[f"{base}, p8, 20%"], flags[f"{base}, 20%"]
    assert mine == theirs
    assert mine["per_prompt"] != rows[f"{base}, 20%"]["per_prompt"]  # pages of 16 differ


def test_an_adaptive_row_is_the_run_of_the_page_it_chose(one_prompt, tmp_path):
    ab = one_prompt
    base = "reconstruct/max, global"
    rows = _run(ab, tmp_path, "adaptive", "--settings", base, "--variant", "p8: page_size=8",
                "--adaptive", "0", "1", "--adaptive-pages", "8", "16")  # fmt: skip
    (label,) = rows[f"{base}, 20%"]["per_prompt"]
    # Threshold 0: the largest page passes at once (the base row); threshold 1: pages of
    # 16 lose some of the token plan's score, so the smallest page (the p8 row).
    never, always = rows[f"{base}, adaptive page 0, 20%"], rows[f"{base}, adaptive page 1, 20%"]
    assert never.pop("page_sizes") == {label: 16} and always.pop("page_sizes") == {label: 8}
    share16 = never.pop("shares")[label]["16"]
    shares = always.pop("shares")[label]
    assert shares.keys() == {"16", "8"} and shares["16"] == share16
    assert 0.0 < share16 < 1.0 and 0.0 < shares["8"] <= 1.0
    assert never == rows[f"{base}, 20%"] and always == rows[f"{base}, p8, 20%"]
    assert never != always
    with pytest.raises(SystemExit):
        ab.main(["--adaptive", "1.5"])
