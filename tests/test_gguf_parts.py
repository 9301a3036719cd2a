"""The second model's GGUF in registry parts (pagekv/runtime/gguf_parts.py): found without import,
joined only when size and SHA-256 match, every bad part named with what to run. Small made-up
parts stand in for the real ones (tests/test_qwen_coder.py, opt-in)."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools

import pytest

from pagekv.app.model_registry import ModelRegistry, model_key
from pagekv.cli import main as cli_main
from pagekv.runtime import models
from pagekv.runtime.gguf_parts import QWEN_CODER_PARTS, GGUFParts, join_parts
from pagekv.runtime.models import (
    KNOWN_MODELS,
    QWEN_CODER,
    QWEN_CODER_MISSING,
    GGUFMissing,
    ModelLoadError,
    bundled_model,
    load_model,
)

_NAMES = itertools.count()
INSTALL = "bash scripts/setup.sh --models"


def fake_parts(tmp_path, monkeypatch, chunks: list[bytes], sha: str | None = None) -> GGUFParts:
    """Packages `pagekvfake<i>_<j>` on sys.path, package j holding data/part{j:02d}.bin
    with `chunks[j-1]`; the spec says the join is their concatenation (or `sha`)."""
    tag = next(_NAMES)
    root = tmp_path / f"site{tag}"
    packages = []
    for j, chunk in enumerate(chunks, start=1):
        name = f"pagekvfake{tag}_{j}"
        (root / name / "data").mkdir(parents=True)
        (root / name / "__init__.py").write_text("")
        (root / name / "data" / f"part{j:02d}.bin").write_bytes(chunk)
        packages.append(name)
    monkeypatch.syspath_prepend(str(root))
    joined = b"".join(chunks)
    return GGUFParts(
        filename=f"fake{tag}.gguf",
        packages=tuple(packages),
        size=len(joined),
        sha256=sha or hashlib.sha256(joined).hexdigest(),
        install=INSTALL,
    )


CHUNKS = [b"GGUF" + bytes(range(200)), bytes(range(255, 0, -1)) * 3, b"tail"]


def test_join_is_the_concatenation_in_order(tmp_path, monkeypatch):
    parts = fake_parts(tmp_path, monkeypatch, CHUNKS)
    assert parts.source() == (parts.filename, sum(map(len, CHUNKS)))
    out = join_parts(parts, tmp_path / "out")
    assert out == tmp_path / "out" / parts.filename
    assert out.read_bytes() == b"".join(CHUNKS)
    assert sorted(p.name for p in out.parent.iterdir()) == [parts.filename]  # no temp left


def test_a_wrong_digest_joins_nothing(tmp_path, monkeypatch):
    parts = fake_parts(tmp_path, monkeypatch, CHUNKS, sha="0" * 64)
    with pytest.raises(ModelLoadError, match="SHA-256") as e:
        join_parts(parts, tmp_path / "out")
    assert INSTALL in str(e.value) and not isinstance(e.value, GGUFMissing)
    assert list((tmp_path / "out").iterdir()) == []


def test_a_wrong_size_is_said_before_anything_is_read(tmp_path, monkeypatch):
    parts = dataclasses.replace(fake_parts(tmp_path, monkeypatch, CHUNKS), size=10)
    with pytest.raises(ModelLoadError, match="not 10") as e:
        parts.source()
    assert not isinstance(e.value, GGUFMissing)
    with pytest.raises(ModelLoadError, match="not 10"):
        join_parts(parts, tmp_path / "out")


def test_a_missing_part_is_named(tmp_path, monkeypatch):
    parts = fake_parts(tmp_path, monkeypatch, CHUNKS)
    parts = dataclasses.replace(parts, packages=(parts.packages[0], "pagekv_no_such_part", "x"))
    with pytest.raises(GGUFMissing) as e:
        parts.source()
    assert "part 2 of 3" in str(e.value) and "pagekv_no_such_part" in str(e.value)
    assert str(e.value).endswith(f"run `{INSTALL}`.")


def test_the_model_is_in_the_list_under_its_aliases():
    assert QWEN_CODER in KNOWN_MODELS and "r=7" in KNOWN_MODELS[QWEN_CODER]
    for alias in ("qwen-coder-0.5b", " Qwen2.5-Coder-0.5B ", "qwen2.5-coder-0.5b-instruct"):
        assert bundled_model(alias).key == QWEN_CODER
        assert model_key(alias) == QWEN_CODER
    assert bundled_model("Qwen/Qwen2.5-Coder-0.5B-Instruct") is None  # the hub name
    assert model_key("bundled") == model_key("smollm2") == model_key("") == "bundled"
    assert ModelRegistry(factory=lambda name: None).offered("Qwen2.5-Coder-0.5B")


def _qwen_with(monkeypatch, tmp_path, parts: GGUFParts) -> None:
    """The qwen spec with these parts, and an empty cache root."""
    spec = dataclasses.replace(models.BUNDLED_MODELS[QWEN_CODER], parts=parts)
    monkeypatch.setitem(models.BUNDLED_MODELS, QWEN_CODER, spec)
    monkeypatch.setenv("PAGEKV_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_missing_parts_say_what_to_run(tmp_path, monkeypatch):
    absent = dataclasses.replace(QWEN_CODER_PARTS, packages=("pagekv_no_such_part_1",))
    _qwen_with(monkeypatch, tmp_path, absent)
    with pytest.raises(GGUFMissing) as e:
        load_model("qwen-coder-0.5b", device="cpu")
    assert str(e.value) == QWEN_CODER_MISSING
    assert QWEN_CODER_MISSING.count(". ") == 0 and "bash scripts/setup.sh --models" in str(e.value)


def test_models_command_says_what_to_run(tmp_path, monkeypatch, capsys):
    absent = dataclasses.replace(QWEN_CODER_PARTS, packages=("pagekv_no_such_part_1",))
    _qwen_with(monkeypatch, tmp_path, absent)
    assert cli_main(["models"]) == 0
    out = capsys.readouterr().out
    assert f"{QWEN_CODER}   " in out and "not installed" in out and QWEN_CODER_MISSING in out
    assert cli_main(["models", "--prepare", "qwen-coder-0.5b"]) == 2  # one line on stderr
    err = capsys.readouterr().err  # the part that is missing, and what to run
    assert err.count("\n") == 1 and "part 1 of 1" in err and f"run `{INSTALL}`." in err
    assert cli_main(["models", "--prepare", "gpt2"]) == 2


def test_corrupt_parts_are_refused_not_replaced_by_the_hub(tmp_path, monkeypatch):
    """Parts that are there but wrong: their own message, not 'not installed'."""
    _qwen_with(monkeypatch, tmp_path, fake_parts(tmp_path, monkeypatch, CHUNKS, sha="f" * 64))
    with pytest.raises(ModelLoadError, match="SHA-256") as e:
        load_model("qwen-coder-0.5b", device="cpu")
    assert not isinstance(e.value, GGUFMissing)
    leftovers = [p.name for p in (tmp_path / "cache" / "models").iterdir()]
    assert leftovers == []  # no half-built cache, no joined file


def test_the_app_falls_back_and_says_what_to_run(monkeypatch, bundled_study):
    """Without the parts the app serves the bundled model and names what to run."""
    absent = dataclasses.replace(QWEN_CODER_PARTS, packages=("pagekv_no_such_part_1",))
    spec = dataclasses.replace(
        models.BUNDLED_MODELS[QWEN_CODER], parts=absent, cache_name="pagekv-test-not-converted"
    )
    monkeypatch.setitem(models.BUNDLED_MODELS, QWEN_CODER, spec)
    registry = ModelRegistry(
        factory=lambda name: bundled_study if name == "bundled" else _load(name)
    )
    study = registry.get("Qwen2.5-Coder-0.5B")
    assert study.loaded.fell_back and study.loaded.name == "bundled"
    assert study.loaded.note.startswith(QWEN_CODER_MISSING + " -> fell back to the bundled")
    assert registry.loaded_names() == ["bundled"]  # nothing else loaded or evicted


def _load(name):
    from pagekv.engine.study import Study

    return Study(load_model(name, device="cpu"))
