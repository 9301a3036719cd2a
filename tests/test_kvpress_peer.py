"""The kvpress peer: budget conversion, requests and error paths with fake workers (no kvpress); one
real run of every press on the bundled model, opt-in (``PAGEKV_TEST_KVPRESS=1``)."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

from experiments.peer import kvpress_peer as kp
from experiments.peer import kvpress_worker as kw
from pagekv.maths.config import EvictionConfig


@pytest.mark.parametrize("beta", [0.05, 0.1, 0.2, 0.25, 0.3, 0.5, 0.7, 0.9, 1.0])
@pytest.mark.parametrize("n", [1, 7, 63, 64, 100, 129, 1000, 4097])
def test_ratio_for_budget_keeps_our_k(beta, n):
    k = EvictionConfig(policy="entropy", budget=beta).budget_tokens(n)
    assert kp.budget_tokens(beta, n) == k
    if k < 1:
        with pytest.raises(ValueError, match="keeps no token"):
            kp.ratio_for_budget(beta, n)
        return
    ratio = kp.ratio_for_budget(beta, n)
    assert 0.0 <= ratio < 1.0
    assert kp.kvpress_kept(n, ratio) == k
    assert ratio == pytest.approx(1 - beta, abs=1.0 / n + 1e-12)


def test_naive_ratio_can_lose_a_token():
    # The reason ratio_for_budget exists: 1 - (1 - 0.1) = 0.0999..., int(9.999...) = 9.
    assert kp.compression_ratio(0.1) == 1 - 0.1
    assert kp.kvpress_kept(100, kp.compression_ratio(0.1)) == 9
    assert kp.kvpress_kept(100, kp.ratio_for_budget(0.1, 100)) == 10


def test_kvpress_kept_matches_kvpress_rule():
    assert kp.kvpress_kept(10, 0.0) == 10
    assert kp.kvpress_kept(10, 0.95) == 1  # clamped to at least one token
    assert kp.kvpress_kept(10, 1.0) == 0
    assert kp.kvpress_kept(200, 0.75) == 50
    assert kp.kvpress_kept(200, 0.8) == 39  # int(200 * 0.19999...): float rounding


@pytest.mark.parametrize("beta", [0, -0.1, 1.5, True, "0.2", None])
def test_bad_budget(beta):
    with pytest.raises(ValueError, match="beta"):
        kp.compression_ratio(beta)


def test_make_request_inside():
    req = kp.make_request("a", "snapkv", input_ids=list(range(100)), budget=0.2)
    assert req["mode"] == "inside" and req["input_ids"] == list(range(100))
    assert req["expected_kept"] == 20 and req["budget"] == 0.2
    assert kp.kvpress_kept(100, req["compression_ratio"]) == 20
    assert req["max_new_tokens"] == 24 and "press_kwargs" not in req
    json.dumps(req)  # must travel as JSON


def test_make_request_after_budget_counts_the_context_only():
    req = kp.make_request(
        "b", "knorm", context_ids=[5] * 90, question_ids=[6] * 10, budget=0.5, max_new_tokens=8
    )
    assert req["mode"] == "after" and len(req["context_ids"]) == 90
    assert req["expected_kept"] == 45
    assert req["max_new_tokens"] == 8


def test_make_request_ratio_tensor_and_kwargs():
    torch = pytest.importorskip("torch")
    ids = torch.arange(50)[None]  # a batch of one
    req = kp.make_request(
        3, "snapkv", input_ids=ids, compression_ratio=0.6, press_kwargs={"window_size": 16}
    )
    assert req["input_ids"] == list(range(50))
    assert req["compression_ratio"] == 0.6 and req["expected_kept"] == 20
    assert req["press_kwargs"] == {"window_size": 16} and "budget" not in req


def test_make_request_none_press():
    req = kp.make_request("full", "none", input_ids=[1, 2, 3])
    assert req["compression_ratio"] == 0.0 and req["expected_kept"] == 3


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"press": "h2o", "input_ids": [1], "budget": 0.5}, "unknown press"),
        ({"press": "knorm", "budget": 0.5}, "input_ids"),
        ({"press": "knorm", "input_ids": [1], "context_ids": [1], "budget": 0.5}, "input_ids"),
        ({"press": "knorm", "context_ids": [1, 2], "budget": 0.5}, "question_ids"),
        ({"press": "knorm", "input_ids": [1], "question_ids": [1], "budget": 0.5}, "context_ids"),
        ({"press": "knorm", "input_ids": [1, 2]}, "exactly one"),
        ({"press": "knorm", "input_ids": [1], "budget": 0.5, "compression_ratio": 0.5}, "exactly"),
        ({"press": "knorm", "input_ids": [1], "compression_ratio": 1.0}, r"\[0, 1\)"),
        ({"press": "knorm", "input_ids": [], "budget": 0.5}, "empty"),
        ({"press": "knorm", "input_ids": [-1, 2], "budget": 0.5}, "negative"),
        ({"press": "knorm", "input_ids": [1, 2], "budget": 0.5, "max_new_tokens": 0}, ">= 1"),
        ({"press": "none", "input_ids": [1, 2], "budget": 0.5}, "no budget"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_make_request_rejects(kwargs, match):
    press = kwargs.pop("press")
    with pytest.raises(ValueError, match=match):
        kp.make_request("x", press, **kwargs)


def test_presses_match_the_worker():
    assert set(kp.PRESSES) == set(kw.PRESS_CLASSES)
    assert kp.MODES == kw.MODES


def test_worker_make_press_rejects_without_kvpress():
    assert kw.make_press("none", 0.5, None) is None
    with pytest.raises(ValueError, match="unknown press"):
        kw.make_press("h2o", 0.5, None)


def _fake_worker(tmp_path: Path, body: str) -> Path:
    """A stand-in worker: `body` runs with `req` (the request) and `out` (output path)."""
    script = tmp_path / "fake_worker.py"
    script.write_text(
        "import json, sys, time\n"
        "args = sys.argv[1:]\n"
        "req = json.load(open(args[args.index('--input') + 1]))\n"
        "out = args[args.index('--output') + 1]\n" + textwrap.dedent(body)
    )
    return script


def _run(tmp_path, worker, requests=None, **kw):
    requests = requests or [kp.make_request("a", "knorm", input_ids=[1, 2, 3, 4], budget=0.5)]
    return kp.run_kvpress(
        tmp_path, requests, python=sys.executable, worker=worker, progress=None, **kw
    )


def test_run_with_a_fake_worker_returns_results(tmp_path):
    worker = _fake_worker(
        tmp_path,
        """
        res = [{"id": r["id"], "answer": "x", "tokens": [1], "kept_tokens": [2, 2],
                "error": None} for r in req["requests"]]
        json.dump({"ok": True, "results": res, "versions": {"kvpress": "fake"},
                   "load_seconds": 0.1, "model_dir": req["model_dir"]}, open(out, "w"))
        """,
    )
    [res] = _run(tmp_path, worker)
    assert res["id"] == "a" and res["answer"] == "x" and res["kept_tokens"] == [2, 2]
    assert res["expected_kept"] == 2 and res["budget"] == 0.5
    assert res["peer"] == "kvpress" and res["versions"] == {"kvpress": "fake"}


def test_missing_worker(tmp_path):
    with pytest.raises(kp.PeerUnavailable, match="worker script missing"):
        _run(tmp_path, tmp_path / "nope.py")


def test_missing_model_dir(tmp_path):
    with pytest.raises(kp.PeerUnavailable, match="model folder"):
        kp.run_kvpress(tmp_path / "nope", [{}], python=sys.executable)


def test_no_requests_runs_nothing(tmp_path):
    assert kp.run_kvpress(tmp_path, [], python="/nonexistent/python") == []


def test_missing_interpreter(tmp_path):
    with pytest.raises(kp.PeerUnavailable, match="cannot run the kvpress worker"):
        kp.run_kvpress(tmp_path, [{"id": 1}], python=tmp_path / "no-python", worker=kp.WORKER_FILE)


@pytest.mark.parametrize(
    "body, match, kw",
    [
        ("open(out, 'w').write('not json {')\n", "no valid JSON", {}),
        (
            "sys.stderr.write('boom: segfault-ish'); sys.exit(3)\n",
            r"exit 3.*boom: segfault-ish",
            {},
        ),
        (
            "json.dump({'ok': False, 'error': 'OSError: no weights', 'results': []}, "
            "open(out, 'w'))\nsys.exit(1)\n",
            "OSError: no weights",
            {},
        ),
        (
            "json.dump({'ok': True, 'results': []}, open(out, 'w'))\n",
            "returned 0 results for 1",
            {},
        ),
        ("time.sleep(30)\n", "timed out", {"timeout": 1}),
    ],
    ids=["bad-json", "crash-quotes-stderr", "worker-reported", "wrong-count", "timeout"],
)
def test_a_failing_worker_is_peer_unavailable(tmp_path, body, match, kw):
    with pytest.raises(kp.PeerUnavailable, match=match):
        _run(tmp_path, _fake_worker(tmp_path, body), **kw)


def test_real_worker_reports_bad_request_as_json(tmp_path):
    """The real worker fails before importing kvpress and still answers in JSON."""
    with pytest.raises(kp.PeerUnavailable, match="requests must be a list"):
        kp.run_kvpress(tmp_path, [{"id": 1}], python=sys.executable, worker=_bad_requests(tmp_path))


def _bad_requests(tmp_path: Path) -> Path:
    """A wrapper that feeds the real worker a request whose `requests` is not a list."""
    script = tmp_path / "wrap.py"
    script.write_text(
        "import json, runpy, sys\n"
        "args = sys.argv[1:]\n"
        "src = args[args.index('--input') + 1]\n"
        "req = json.load(open(src)); req['requests'] = 'oops'; json.dump(req, open(src, 'w'))\n"
        f"sys.path.insert(0, {str(kp.WORKER_FILE.parent)!r})\n"
        f"sys.argv = [{str(kp.WORKER_FILE)!r}] + args\n"
        f"runpy.run_path({str(kp.WORKER_FILE)!r}, run_name='__main__')\n"
    )
    return script


def test_worker_main_bad_json_stdin(tmp_path, monkeypatch, capsys):
    import io

    monkeypatch.setattr(sys, "stdin", io.StringIO("{not json"))
    assert kw.main([]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is False and "JSONDecodeError" in out["error"]


def test_worker_main_missing_model_dir(tmp_path):
    src, dst = tmp_path / "in.json", tmp_path / "out.json"
    src.write_text(json.dumps({"model_dir": str(tmp_path / "nope"), "requests": []}))
    assert kw.main(["--input", str(src), "--output", str(dst)]) == 1
    assert "model_dir is not a folder" in json.loads(dst.read_text())["error"]


def _fake_venv(tmp_path: Path, python_body: str) -> Path:
    """A venv whose `python` is a shell script (so nothing real gets installed)."""
    venv = tmp_path / "venv"
    py = kp.venv_python(venv)
    py.parent.mkdir(parents=True)
    py.write_text("#!/bin/sh\n" + python_body)
    py.chmod(0o755)
    return venv


@pytest.mark.skipif(os.name == "nt", reason="shell-script interpreters")
def test_pip_failure_is_reported(tmp_path):
    venv = _fake_venv(
        tmp_path,
        'echo "ERROR: No matching distribution found for kvpress==0.5.5" >&2\nexit 1\n',
    )
    with pytest.raises(kp.PeerUnavailable, match="No matching distribution found"):
        kp.ensure_kvpress_env(progress=None, venv=venv)
    assert not (venv / kp.MARKER_NAME).exists()
    ok, why = kp.env_ready(venv)
    assert not ok and "incomplete" in why


@pytest.mark.skipif(os.name == "nt", reason="shell-script interpreters")
def test_ensure_installs_torch_first_then_writes_marker(tmp_path):
    log = tmp_path / "calls.log"
    venv = _fake_venv(
        tmp_path,
        f'echo "$@" >> {log}\n'
        'case "$*" in *"import json"*) echo \'{"torch": "t", "transformers": "x", '
        '"kvpress": "0.5.5"}\';; esac\n',
    )
    msgs: list[str] = []
    assert kp.ensure_kvpress_env(progress=msgs.append, venv=venv) == venv
    calls = log.read_text().splitlines()
    assert calls[0].endswith("torch==2.13.0")  # alone, before kvpress
    assert calls[1].endswith(f"-r {kp.REQUIREMENTS_FILE}")
    assert kp.env_ready(venv) == (True, "")
    assert any("ready" in m for m in msgs)
    # Idempotent: a second call runs nothing.
    kp.ensure_kvpress_env(progress=None, venv=venv)
    assert len(log.read_text().splitlines()) == len(calls)


def test_changed_requirements_are_detected(tmp_path):
    venv = _fake_venv(tmp_path, "exit 0\n")
    (venv / kp.MARKER_NAME).write_text("0" * 64)
    ok, why = kp.env_ready(venv)
    assert not ok and "other requirements" in why


def test_missing_creator_python(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEKV_KVPRESS_PYTHON", str(tmp_path / "no-python"))
    with pytest.raises(kp.PeerUnavailable, match="creating a venv"):
        kp.ensure_kvpress_env(progress=None, venv=tmp_path / "venv")


def test_missing_requirements(tmp_path):
    with pytest.raises(kp.PeerUnavailable, match="requirements file missing"):
        kp.ensure_kvpress_env(progress=None, venv=tmp_path, requirements=tmp_path / "r.txt")


def test_venv_dir_override(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEKV_KVPRESS_VENV", str(tmp_path / "v"))
    assert kp.kvpress_venv_dir() == tmp_path / "v"
    ok, why = kp.kvpress_available()
    assert not ok and "no kvpress environment" in why and "ensure_kvpress_env" in why


def test_requirements_pin_what_was_tested():
    pins = dict(
        line.split("==")
        for line in kp.REQUIREMENTS_FILE.read_text().splitlines()
        if "==" in line and not line.startswith("#")
    )
    assert pins["torch"] == "2.13.0" and pins["kvpress"] == "0.5.5"
    major, minor = (int(x) for x in pins["transformers"].split(".")[:2])
    assert (4, 56) <= (major, minor) < (5, 3)  # what kvpress 0.5.5 accepts


HAYSTACK = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
) * 6
NEEDLE = "The secret passcode is 7351. "


def OPT_IN(test):  # noqa: N802 (a decorator, read as the marks it stands for)
    """The marks of a test that runs kvpress itself: slow and kvpress (which runs only
    where `PAGEKV_TEST_KVPRESS=1` asks for it: tests/conftest.py)."""
    return pytest.mark.slow(pytest.mark.kvpress(test))


QUESTION = "What is the secret passcode?"


@OPT_IN
def test_kvpress_runs_every_press_on_the_bundled_model():
    from transformers import AutoTokenizer

    model_dir = kp.bundled_model_dir()
    kp.ensure_kvpress_env()
    tok = AutoTokenizer.from_pretrained(model_dir)
    half = len(HAYSTACK) // 2
    context = HAYSTACK[:half] + NEEDLE + HAYSTACK[half:]
    text = tok.apply_chat_template(
        [{"role": "user", "content": context + "\n" + QUESTION}],
        add_generation_prompt=True,
        tokenize=False,
    )
    ids = tok.encode(text, add_special_tokens=False)
    # question-after split: everything from the question on is fed after compression
    cut = text.index(QUESTION)
    ctx_ids = tok.encode(text[:cut], add_special_tokens=False)
    q_ids = tok.encode(text[cut:], add_special_tokens=False)
    n, beta = len(ids), 0.5
    pages = dict(page_sizes=(1, 16))
    reqs = [kp.make_request("full", "none", input_ids=ids, max_new_tokens=12, **pages)]
    reqs += [
        kp.make_request(p, p, input_ids=ids, budget=beta, max_new_tokens=12, **pages)
        for p in kp.PRESSES
    ]
    reqs.append(
        kp.make_request(
            "snapkv-after",
            "snapkv",
            context_ids=ctx_ids,
            question_ids=q_ids,
            budget=beta,
            max_new_tokens=12,
        )
    )
    results = kp.run_kvpress(model_dir, reqs)
    for r in results:
        print(
            f"\n{r['id']:>20} kept {r['kept_tokens'][0]:>4}/{r['compressed_tokens']} "
            f"({r['seconds']:.2f} s) {r['answer']!r} {r['error'] or ''}"
        )
    by_id = {r["id"]: r for r in results}
    for r in results:
        assert r["error"] is None, (r["id"], r["error"], r.get("traceback"))
        assert isinstance(r["answer"], str) and r["tokens"]
        assert len(r["kept_tokens"]) == 30  # SmolLM2-135M's layers
        if r["id"] == "kvzip":  # it keeps the cache whole and masks what it evicts
            assert set(r["kept_tokens"]) == {n}
            attended = sum(map(sum, r["attended_tokens"]))  # one budget for every head
            assert abs(attended / (30 * 3) - r["expected_kept"]) <= 1, attended
        elif r["id"] == "chunkkv":  # whole chunks of 20 (its default), the last one short
            chunks = -(-n // 20)
            kept = max(1, int(chunks * (1 - r["compression_ratio"])))
            assert max(r["kept_tokens"]) <= 20 * kept and min(r["kept_tokens"]) > 20 * (kept - 1)
        else:
            assert set(r["kept_tokens"]) == {r["expected_kept"]}, r["id"]
        # the worker's decode agrees with ours (tokenizer loaded by another transformers)
        assert tok.decode(r["tokens"], skip_special_tokens=True).strip() == r["answer"]
    assert by_id["full"]["kept_tokens"][0] == n
    for p in set(kp.PRESSES) - {"kvzip", "chunkkv"}:
        assert by_id[p]["kept_tokens"][0] == int(beta * n) < n
    assert by_id["snapkv-after"]["kept_tokens"][0] == int(beta * len(ctx_ids))
    assert "7351" in by_id["full"]["answer"]
    # What a paged cache holds: at pages of 1 the pages touched are the tokens each KV
    # head attends to; pages of 16 hold them in at least ceil(kept / 16) pages, and in
    # one page per token at the most.
    for r in results:
        if r["id"] == "snapkv-after":
            continue
        touched = r["touched_pages"]
        assert touched is not None and touched["1"] == r["attended_tokens"], r["id"]
        for t1, t16 in zip(sum(touched["1"], []), sum(touched["16"], []), strict=True):
            assert -(-t1 // 16) <= t16 <= t1, (r["id"], t1, t16)
    assert sum(touched["16"], []) != sum(touched["1"], [])  # not a copy of the other
    assert set(sum(by_id["full"]["touched_pages"]["16"], [])) == {-(-n // 16)}

    # Without compression the peer must decode what our transformers decodes greedily.
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), do_sample=False, max_new_tokens=12, pad_token_id=tok.eos_token_id
        )
    ours = out[0, n:].tolist()
    assert by_id["full"]["tokens"] == ours[: len(by_id["full"]["tokens"])]


@OPT_IN
def test_kvzip_scored_once_keeps_what_its_pipeline_keeps_at_every_ratio():
    """KVzip scored once (`reuse_scores`) keeps at each ratio what kvpress's own pipeline keeps;
    ChunkKV's kept sets are chunk-aligned."""
    from transformers import AutoTokenizer

    model_dir = kp.bundled_model_dir()
    tok = AutoTokenizer.from_pretrained(model_dir)
    half = len(HAYSTACK) // 2
    ctx = tok.encode(HAYSTACK[:half] + NEEDLE + HAYSTACK[half:], add_special_tokens=False)
    q = tok.encode("\n" + QUESTION, add_special_tokens=False)
    ratios = (0.5, 0.8, 0.95)
    alone = [
        kp.make_request(
            f"alone {b}", "kvzip", context_ids=ctx, question_ids=q, budget=b, max_new_tokens=8
        )  # fmt: skip
        for b in ratios
    ]
    once = [
        kp.make_request(
            f"once {b}",
            "kvzip",
            context_ids=ctx,
            question_ids=q,
            budget=b,
            max_new_tokens=8,
            reuse_scores=True,
        )  # fmt: skip
        for b in ratios
    ]
    # A whole number of chunks, and one more partial chunk: kvpress 0.5.5's ChunkKV keeps
    # a different count in a layer that picks the partial chunk, and the worker then
    # feeds the question a token a step (one mask for every layer would not fit).
    whole = ctx[: len(ctx) // 16 * 16]
    ragged = kp.make_request("ragged", "chunkkv", context_ids=whole + ctx[-5:], question_ids=q,
                             budget=0.25, max_new_tokens=8,
                             press_kwargs={"scorer": "keydiff", "chunk_length": 16})  # fmt: skip
    chunk = kp.make_request("chunkkv", "chunkkv", context_ids=whole, question_ids=q, budget=0.25,
                            max_new_tokens=8, press_kwargs={"scorer": "keydiff",
                            "chunk_length": 16}, page_sizes=(1, 16))  # fmt: skip
    results = {r["id"]: r for r in kp.run_kvpress(model_dir, alone + once + [chunk, ragged])}
    for r in results.values():
        assert r["error"] is None, (r["id"], r["error"], r.get("traceback"))
    assert [results[f"once {b}"]["reused_scores"] for b in ratios] == [False, True, True]
    digests = set()
    for b in ratios:
        a, o = results[f"alone {b}"], results[f"once {b}"]
        assert a["kept_digest"] == o["kept_digest"] is not None, b
        assert a["touched_pages"] == o["touched_pages"] and a["answer"] == o["answer"], b
        digests.add(a["kept_digest"])
    assert len(digests) == len(ratios)  # the ratios keep different sets
    # Reusing the scores skips the reconstruction: the later ratios cost less.
    assert results[f"once {ratios[1]}"]["seconds"] < results[f"alone {ratios[1]}"]["seconds"]
    c = results["chunkkv"]
    kept_chunks = max(1, int(len(whole) // 16 * (1 - c["compression_ratio"])))
    assert 0 < kept_chunks < len(whole) // 16
    for per_layer in c["touched_pages"]["16"]:
        assert per_layer == [kept_chunks] * 3  # every KV head keeps the same whole chunks
    assert {t for row in c["touched_pages"]["1"] for t in row} == {16 * kept_chunks}
    lengths = set(results["ragged"]["kept_tokens"])
    assert len(lengths) == 2 and max(lengths) - min(lengths) == 16 - 5, lengths
