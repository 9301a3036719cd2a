"""Run kvpress presses on given token ids; one JSON request in, one JSON response out.

This script runs INSIDE the kvpress virtual environment (see ``requirements-kvpress.txt``
and ``kvpress_peer.ensure_kvpress_env``). It imports the standard library, torch,
transformers and kvpress; ``pagekv`` only for the ``pagekv_*`` presses, and then only
its torch-only core and ``pagekv.integrations.kvpress_press`` (the
repository root that holds this file is put on ``sys.path``), never the runtime that
needs transformers 5.24.

Usage::

    python kvpress_worker.py [--input REQUEST.json] [--output RESPONSE.json]

Without ``--input`` the request is read from stdin; without ``--output`` the response goes
to stdout. While the work runs, anything a library prints to stdout is sent to stderr, so
stdout holds exactly one JSON document.

Request::

    {"model_dir": "/path/to/converted/model",      # save_pretrained of model + tokenizer
     "dtype": "float32",                            # optional
     "attn_implementation": "sdpa",                 # optional
     "threads": null,                               # optional: torch.set_num_threads
     "requests": [
        {"id": "a", "press": "snapkv", "compression_ratio": 0.8,
         "mode": "inside", "input_ids": [...],
         "max_new_tokens": 24, "press_kwargs": {"window_size": 32}},
        {"id": "b", "press": "knorm", "compression_ratio": 0.8,
         "mode": "after", "context_ids": [...], "question_ids": [...]}]}

``compression_ratio`` is kvpress's: the fraction of the cache REMOVED (our budget
``beta`` is the fraction kept, so ``compression_ratio = 1 - beta``). ``press`` is one of
``snapkv``, ``expected_attention``, ``knorm``, ``streaming_llm``, ``kvzip``
(``KVzipPress``; ``press_kwargs`` ``{"layerwise": true}`` for its uniform budget per
layer), ``keydiff`` or ``none``, or one of
pagekv's presses run through kvpress, ``pagekv_entropy`` (``PageEntroKVPress``) and
``pagekv_mean`` (``MeanPoolPagePress``); their ``press_kwargs`` are the press's fields
(``page_size``, ``window``, ``n_sink``, ``tau``, ``backend``, or ``budget`` instead of the
request's ratio), and their results add ``pagekv``: ``{"budget_tokens": [k per layer],
"kept_pages": [[kept page indices per KV head] per layer], "n_pages": ...,
"kvpress_base": true when the press is a kvpress BasePress, "backend": ...}``.

Response::

    {"ok": true, "error": null, "versions": {...}, "load_seconds": 1.2,
     "results": [{"id": "a", "press": "snapkv", "mode": "inside",
                  "compression_ratio": 0.8, "prompt_tokens": 120,
                  "compressed_tokens": 120, "kept_tokens": [24, 24, ...],
                  "attended_tokens": [[24, 24, 24], ...],
                  "touched_pages": {"16": [[2, 2, 2], ...]},
                  "answer": "...", "tokens": [...], "stop_reason": "eos",
                  "prefill_seconds": 0.1, "seconds": 0.4, "error": null}, ...]}

A failing request gets ``error`` set (one line) and the others still run; a failure that
stops everything (bad JSON, model that does not load) gives ``"ok": false`` and exit 1.

Modes (both greedy; both use exactly the token ids given, no re-tokenizing):

- ``inside``: the whole prompt (question included) is prefilled under ``with press(model)``,
  so the press compresses a cache that already saw the question. The first answer token
  is the argmax of the prefill's last logits (that prefill attended to the full prompt,
  before compression), then decoding continues on the compressed cache with explicit
  ``position_ids`` starting at ``n = len(input_ids)``.
- ``after``: kvpress's own question-after protocol, as in
  ``KVPressTextGenerationPipeline._forward``/``generate_answer`` (kvpress 0.5.5): the
  context alone is prefilled through ``model.model`` under the press, then the question
  is fed on the compressed cache at positions ``len(context_ids)..``, then greedy decoding.
  Here the pipeline's own tokenization is skipped, so the ids must already include any
  chat template pieces (the pipeline puts everything after the user message, e.g.
  ``<|im_end|>\\n<|im_start|>assistant\\n``, into the question part).

``kept_tokens`` is each layer's cache length right after the compressed prefill (before
any question or answer token is appended); ``attended_tokens`` is, per layer and KV head,
that length less the keys the press masked (KVzip keeps every token and masks the
evicted ones, so its ``kept_tokens`` is the whole context). kvpress keeps ``max(1, int(k_len * (1 -
compression_ratio)))`` tokens per layer and KV head (``kvpress.utils.compute_n_kept``).
``touched_pages`` is, for each page size of the request's ``page_sizes`` (default
``[16]``), per layer and KV head, how many pages of that size the kept context tokens
touch: what a paged cache would hold (None for a press that drops tokens without saying
which).

Decoding stops after ``max_new_tokens`` tokens or after an EOS token (the tokenizer's or
the generation config's), which is included in ``tokens``; ``answer`` is the decode with
special tokens skipped, stripped, like ``pagekv.runtime.runner``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import sys
import time
import traceback
from importlib.metadata import version

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PRESS_CLASSES = {
    "snapkv": "SnapKVPress",
    "expected_attention": "ExpectedAttentionPress",
    "knorm": "KnormPress",
    "streaming_llm": "StreamingLLMPress",
    "kvzip": "KVzipPress",
    "keydiff": "KeyDiffPress",
    "chunkkv": "ChunkKVPress",
}
#: ChunkKV wraps a scoring press: ``press_kwargs`` ``{"scorer": <one of these>,
#: "chunk_length": 16, ...}`` (the other keys go to the scorer).
CHUNK_SCORERS = ("keydiff", "knorm", "snapkv", "expected_attention")
#: pagekv's presses run inside kvpress (pagekv.integrations.kvpress_press).
PAGEKV_PRESS_CLASSES = {
    "pagekv_entropy": "PageEntroKVPress",
    "pagekv_mean": "MeanPoolPagePress",
}
MODES = ("inside", "after")


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _ids(value, name: str) -> list[int]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{name} must be a non-empty list of token ids")
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        raise ValueError(f"{name} must hold non-negative integers")
    return value


def make_press(name: str, compression_ratio: float, press_kwargs: dict | None):
    """The kvpress press called ``name``, or ``None`` for no compression."""
    if name == "none":
        return None
    if name not in PRESS_CLASSES and name not in PAGEKV_PRESS_CLASSES:
        known = sorted(PRESS_CLASSES) + sorted(PAGEKV_PRESS_CLASSES)
        raise ValueError(f"unknown press {name!r}; expected one of {known} or none")
    ratio = float(compression_ratio)
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"compression_ratio must be in [0, 1); got {ratio}")
    if name in PAGEKV_PRESS_CLASSES:
        return make_pagekv_press(name, ratio, press_kwargs)
    import kvpress

    kwargs = dict(press_kwargs or {})
    if name == "chunkkv":
        scorer = kwargs.pop("scorer", "keydiff")
        if scorer not in CHUNK_SCORERS:
            raise ValueError(f"chunkkv scorer {scorer!r}; expected one of {CHUNK_SCORERS}")
        chunk = kwargs.pop("chunk_length", 20)
        inner = getattr(kvpress, PRESS_CLASSES[scorer])(compression_ratio=ratio, **kwargs)
        return kvpress.ChunkKVPress(press=inner, chunk_length=int(chunk))
    return getattr(kvpress, PRESS_CLASSES[name])(compression_ratio=ratio, **kwargs)


def _pagekv_importable() -> None:
    """Put this checkout on ``sys.path``: the kvpress environment does not install
    pagekv, and its presses and page counts are imported from here."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if root not in sys.path:
        sys.path.insert(0, root)


def make_pagekv_press(name: str, compression_ratio: float, press_kwargs: dict | None):
    """pagekv's press ``name``, recording its plans; ``press_kwargs["budget"]`` (fraction
    kept) replaces the request's ``compression_ratio`` when given."""
    _pagekv_importable()
    from pagekv.integrations import kvpress_press

    kwargs = dict(press_kwargs or {})
    if "budget" not in kwargs:
        kwargs["compression_ratio"] = compression_ratio
    cls = getattr(kvpress_press, PAGEKV_PRESS_CLASSES[name])
    return cls(record=True, **kwargs)


def pagekv_report(press) -> dict:
    """The pages a pagekv press kept in each layer (batch of one), for parity checks."""
    layers = sorted(press.plans)
    plans = [press.plans[i] for i in layers]
    return {
        "budget_tokens": [int(p.budget_tokens) for p in plans],
        "kept_pages": [[row.nonzero().flatten().tolist() for row in p.page_keep[0]] for p in plans],
        "n_pages": plans[0].n_pages if plans else None,
        "kvpress_base": bool(getattr(sys.modules[type(press).__module__], "KVPRESS_BASE", False)),
        "config": plans[0].config.to_dict() if plans else None,
    }


def _record_kept(press) -> dict:
    """For a kvpress ``ScorerPress`` (KeyDiff, SnapKV, ...): records, per layer, the
    top-k of its scores that ``ScorerPress.compress`` keeps (the same ``topk`` on the
    same scores), as ``{layer: (indices [G, k], n)}``. Other presses record nothing."""
    recorded: dict = {}
    try:
        from kvpress.presses.scorer_press import ScorerPress
        from kvpress.utils import compute_n_kept
    except ImportError:
        return recorded
    if not isinstance(press, ScorerPress):
        return recorded
    score = press.score

    def recording(module, hidden_states, keys, values, attentions, kwargs):
        scores = score(module, hidden_states, keys, values, attentions, kwargs)
        n = int(keys.shape[2])
        kept = scores.topk(compute_n_kept(n, press.compression_ratio), dim=-1).indices
        recorded[int(module.layer_idx)] = (kept[0], n)
        return scores

    press.score = recording
    return recorded


def _is_scorer(press) -> bool:
    try:
        from kvpress.presses.scorer_press import ScorerPress
    except ImportError:
        return False
    return isinstance(press, ScorerPress)


def _record_gathered(press) -> dict:
    """For a press that drops tokens by gathering the ones it keeps (ChunkKV,
    StreamingLLM: not a ``ScorerPress``, so `_record_kept` sees nothing): records, per
    layer, which input positions each KV head's kept keys are, found by exact equality
    of the gathered rows with the input rows, as ``{layer: (keep bool [G, n], n)}``."""
    recorded: dict = {}
    try:
        from kvpress.presses.scorer_press import ScorerPress
    except ImportError:
        return recorded
    if isinstance(press, ScorerPress) or not hasattr(press, "compress"):
        return recorded
    compress = press.compress

    def recording(module, hidden_states, keys, values, attentions, kwargs):
        out_keys, out_values = compress(module, hidden_states, keys, values, attentions, kwargs)
        n, k = int(keys.shape[2]), int(out_keys.shape[2])
        if k < n:
            same = (keys[0][:, :, None, :] == out_keys[0][:, None, :, :]).all(-1)  # [G, n, k]
            keep = same.any(-1)
            if not bool(same.any(1).all()) or int(keep.sum(-1).max()) != k:
                raise RuntimeError("the kept keys are not a gather of the input keys")
            recorded[int(module.layer_idx)] = (keep, n)
        return out_keys, out_values

    press.compress = recording
    return recorded


def _keep_scores(press) -> dict:
    """Wraps KVzip's `compress_post` (its selection at the press's ratio) to keep a copy
    of the scores it selects from, as ``saved["scores"]``."""
    saved: dict = {}
    select = press.compress_post

    def keeping(model):
        saved["scores"] = press.score_val.clone()
        return select(model)

    press.compress_post = keeping
    return saved


def _digest(keeps: list | None) -> str | None:
    """A SHA-1 of the kept context positions, per layer and KV head (the same kept set
    gives the same digest)."""
    if keeps is None:
        return None
    h = hashlib.sha1()
    for keep in keeps:
        h.update(str(tuple(keep.shape)).encode())
        h.update(keep.to("cpu").numpy().tobytes())
    return h.hexdigest()[:16]


class Worker:
    """Holds the model and tokenizer; runs one request at a time."""

    def __init__(self, model_dir: str, dtype: str = "float32", attn: str = "sdpa"):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=getattr(torch, dtype), attn_implementation=attn
        )
        self.model.eval()
        self.device = self.model.device
        eos: set[int] = set()
        for src in (
            getattr(self.tokenizer, "eos_token_id", None),
            getattr(self.model.generation_config, "eos_token_id", None),
        ):
            if src is not None:
                eos.update(int(x) for x in (src if isinstance(src, (list, tuple)) else [src]))
        self.eos_ids = eos
        #: `(key, per-layer (keys, values), KVzip's scores, the prefill's last logits)`
        #: of the last prompt KVzip scored with `reuse_scores`.
        self._scored = None
        # One tiny forward pays the one-time start-up costs (kernel selection, lazy
        # initialisation) here, in load_seconds, instead of in the first request's time.
        with torch.inference_mode():
            self.model(input_ids=self._tensor([0] * 8))

    def _tensor(self, ids: list[int]):
        return self.torch.tensor([ids], dtype=self.torch.long, device=self.device)

    def _positions(self, start: int, count: int):
        return self.torch.arange(start, start + count, device=self.device)[None]

    def _masks(self, cache, recorded: dict, dropped: bool) -> tuple[list, list | None]:
        """Per layer, the ``attended_tokens`` of the module docstring (KVzip and AdaKV hide
        evicted keys through ``masked_key_indices``, read by kvpress's attention patch), and
        a bool ``[G, n]`` mask of the context positions each KV head keeps: the complement
        of the masked keys, a scoring press's own top-k (``recorded``), the whole cache
        without a press; None where a press drops tokens and did not say which."""
        torch, attended, keeps = self.torch, [], []
        for i, (layer, block) in enumerate(
            zip(cache.layers, self.model.model.layers, strict=False)
        ):
            G, length = int(layer.keys.shape[1]), int(layer.keys.shape[-2])
            masked = getattr(block.self_attn, "masked_key_indices", None)
            keep = torch.ones(G, length, dtype=torch.bool)
            counts = [length] * G
            if masked is not None:
                batch, head, seq = (t.cpu() for t in masked)
                per_head = torch.bincount(head[batch == 0], minlength=G).tolist()
                counts = [length - int(m) for m in per_head]
                keep[head[batch == 0], seq[batch == 0]] = False
            elif i in recorded and recorded[i][0].dtype == torch.bool:  # `_record_gathered`
                keep = recorded[i][0].cpu()
            elif i in recorded:
                keep = torch.zeros(G, int(recorded[i][1]), dtype=torch.bool)
                keep.scatter_(1, recorded[i][0].cpu(), True)
            elif dropped:
                keeps = None
            attended.append(counts)
            if keeps is not None:
                keeps.append(keep)
        return attended, keeps

    def _touched_pages(self, keeps: list | None, page_sizes) -> dict | None:
        """``{P: [[pages touched per KV head] per layer]}``: the pages of ``P`` tokens a
        paged cache holds for what each KV head keeps (``pagekv.maths.paging``)."""
        if keeps is None:
            return None
        _pagekv_importable()
        from pagekv.maths.paging import pages_touched

        return {str(P): [pages_touched(keep, P).tolist() for keep in keeps] for P in page_sizes}

    def run(self, req: dict) -> dict:
        from transformers import DynamicCache

        torch = self.torch
        mode = req.get("mode", "inside")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}; got {mode!r}")
        max_new = req.get("max_new_tokens", 24)
        if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1; got {max_new!r}")
        press = make_press(
            req.get("press", "none"), req.get("compression_ratio", 0.0), req.get("press_kwargs")
        )
        # One of the two records (a scoring press's, or a gathering one's): both fill
        # their dict as the press runs, so pick by the press, not by what is there now.
        recorded = _record_kept(press)
        if not _is_scorer(press):
            recorded = _record_gathered(press)
        page_sizes = req.get("page_sizes", [16])
        if not all(isinstance(P, int) and not isinstance(P, bool) and P >= 1 for P in page_sizes):
            raise ValueError(f"page_sizes must be positive integers; got {page_sizes!r}")
        vocab = self.model.get_input_embeddings().weight.shape[0]
        if mode == "inside":
            prompt = _ids(req.get("input_ids"), "input_ids")
            question: list[int] = []
        else:
            prompt = _ids(req.get("context_ids"), "context_ids")
            question = _ids(req.get("question_ids"), "question_ids")
        if max(prompt + question) >= vocab:
            raise ValueError(f"token id {max(prompt + question)} >= vocabulary size {vocab}")

        t0 = time.perf_counter()
        n = len(prompt)
        # KVzip's scores do not depend on the ratio: `reuse_scores` scores a prompt once
        # and applies each later ratio to the same scores (`_scored`, the last prompt's).
        reuse = bool(req.get("reuse_scores")) and req.get("press") == "kvzip"
        key = (mode, tuple(prompt), json.dumps(req.get("press_kwargs") or {}, sort_keys=True))
        reused = reuse and self._scored is not None and self._scored[0] == key
        with torch.inference_mode():
            if reused:
                _, layers, scores, logits = self._scored
                cache = DynamicCache()
                for i, (k, v) in enumerate(layers):
                    cache.update(k.clone(), v.clone(), i)
                press.score_val = scores.clone()
                press.compress_post(self.model)  # KVzip's own selection at this ratio
            else:
                cache = DynamicCache()
                saved = _keep_scores(press) if reuse else None
                logits = None
                with press(self.model) if press is not None else contextlib.nullcontext():
                    if mode == "inside":
                        logits = self.model(
                            input_ids=self._tensor(prompt), past_key_values=cache,
                            logits_to_keep=1,
                        ).logits[0, -1]  # fmt: skip
                    else:  # kvpress pipeline: prefill the context without the LM head
                        self.model.model(input_ids=self._tensor(prompt), past_key_values=cache)
                if saved is not None and "scores" in saved:
                    layers = [(la.keys.clone(), la.values.clone()) for la in cache.layers]
                    self._scored = (key, layers, saved["scores"], logits)
            kept = [int(layer.keys.shape[-2]) for layer in cache.layers]
            dropped = press is not None and any(k < n for k in kept)
            attended, keeps = self._masks(cache, recorded, dropped)
            touched = self._touched_pages(keeps, page_sizes)
            t_prefill = time.perf_counter() - t0
            # A press that leaves layers of different lengths (ChunkKV, where some layers
            # keep the context's last, partial chunk) gets its question one token a step:
            # transformers builds one mask for every layer, from the first layer's length,
            # for a step of many tokens, and none for a step of one.
            pos = n
            steps = [question] if len(set(kept)) == 1 else [[t] for t in question]
            for part in steps if question else []:
                logits = self.model(
                    input_ids=self._tensor(part),
                    past_key_values=cache,
                    position_ids=self._positions(pos, len(part)),
                    logits_to_keep=1,
                ).logits[0, -1]
                pos += len(part)
            tokens = [int(torch.argmax(logits))]
            for pos in range(n + len(question), n + len(question) + max_new - 1):
                if tokens[-1] in self.eos_ids:
                    break
                logits = self.model(
                    input_ids=self._tensor(tokens[-1:]),
                    past_key_values=cache,
                    position_ids=self._positions(pos, 1),
                ).logits[0, -1]
                tokens.append(int(torch.argmax(logits)))
        seconds = time.perf_counter() - t0
        stop = "eos" if tokens[-1] in self.eos_ids else "max_new_tokens"
        answer = self.tokenizer.decode(tokens, skip_special_tokens=True).strip()
        extra = {"pagekv": pagekv_report(press)} if hasattr(press, "plans") else {}
        return extra | {
            "prompt_tokens": n + len(question),
            "compressed_tokens": n,
            "kept_tokens": kept,
            "attended_tokens": attended,
            "touched_pages": touched,
            "answer": answer,
            "tokens": tokens,
            "stop_reason": stop,
            "kept_digest": _digest(keeps),
            "reused_scores": reused,
            "prefill_seconds": round(t_prefill, 4),
            "seconds": round(seconds, 4),
        }


def versions() -> dict:
    out = {"python": sys.version.split()[0]}
    for name in ("torch", "transformers", "kvpress"):
        try:
            out[name] = version(name)
        except Exception as e:  # report, never fail on this
            out[name] = f"unknown ({_one_line(e)})"
    return out


def handle(payload: dict) -> dict:
    """The response for one decoded request document."""
    if not isinstance(payload, dict):
        raise ValueError("the request must be a JSON object")
    model_dir = payload.get("model_dir")
    if not model_dir or not os.path.isdir(model_dir):
        raise ValueError(f"model_dir is not a folder: {model_dir!r}")
    requests = payload.get("requests")
    if not isinstance(requests, list):
        raise ValueError("requests must be a list")
    import torch

    if payload.get("threads"):
        torch.set_num_threads(int(payload["threads"]))
    t0 = time.perf_counter()
    worker = Worker(
        model_dir,
        dtype=payload.get("dtype", "float32"),
        attn=payload.get("attn_implementation", "sdpa"),
    )
    load_seconds = time.perf_counter() - t0
    results = []
    for i, req in enumerate(requests):
        req = req if isinstance(req, dict) else {}
        base = {
            "id": req.get("id", i),
            "press": req.get("press", "none"),
            "mode": req.get("mode", "inside"),
            "compression_ratio": req.get("compression_ratio", 0.0),
            "answer": None,
            "tokens": [],
            "kept_tokens": None,
            "attended_tokens": None,
            "touched_pages": None,
            "seconds": None,
            "error": None,
        }
        try:
            base.update(worker.run(req))
        except Exception as e:  # one bad request must not sink the rest
            base["error"] = _one_line(e)
            base["traceback"] = traceback.format_exc(limit=4)
        results.append(base)
    return {
        "ok": True,
        "error": None,
        "versions": versions(),
        "load_seconds": round(load_seconds, 3),
        "results": results,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--input", help="request JSON file (default: stdin)")
    parser.add_argument("--output", help="response JSON file (default: stdout)")
    args = parser.parse_args(argv)

    real_stdout = sys.stdout
    sys.stdout = sys.stderr  # keep library prints out of the JSON channel
    try:
        if args.input:
            with open(args.input, encoding="utf-8") as f:
                payload = json.load(f)
        else:
            payload = json.load(sys.stdin)
        response, code = handle(payload), 0
    except Exception as e:  # the caller gets the reason as JSON
        traceback.print_exc(file=sys.stderr)
        response, code = {"ok": False, "error": _one_line(e), "results": []}, 1
    finally:
        sys.stdout = real_stdout
    text = json.dumps(response)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        real_stdout.write(text + "\n")
        real_stdout.flush()
    return code


if __name__ == "__main__":
    sys.exit(main())
