"""Page-EntroKV as an lm-evaluation-harness model: `--model pagekv`.

    python -m pagekv eval --model pagekv \\
        --model_args pretrained=bundled,policy=entropy,budget=0.2,page_size=16,question=after \\
        --tasks niah_single_1 --limit 5 --metadata '{"max_seq_lengths": [2048]}'

(`python -m pagekv eval` is lm-eval's own command line with this model registered and,
for a bundled model, `tokenizer=` set to its local copy: lm-eval's RULER tasks build
their prompts with the tokenizer the model arguments name. Where pagekv is installed,
`lm_eval --model pagekv` itself works too, `tokenizer=` given: `lm_eval_hook`.)

`generate_until` runs the project's prefill, eviction and greedy decode
(`pagekv.runtime.runner.Runner`) on each prompt, raw (no chat template, as lm-eval's
own `hf` model without `--apply_chat_template`), with a progress bar over the requests
as that model shows. The model arguments:

- `pretrained`: `bundled`, `qwen-coder-0.5b`, a hub id or a local folder
  (`pagekv.runtime.models.load_model`);
- the `EvictionConfig` fields: `policy`, `budget`, `page_size`, `n_sink`, `window`,
  `tau`, `scorer`, `allocation`, ...;
- `question`: `inside` (the whole prompt is prefilled and compressed, the question's
  own queries score the cache) or `after` (the context alone is compressed, then the
  question is prefilled into the evicted cache: `split_question`);
- `dtype`: the decode step's linear weights (`auto`, `float32`, `float16`, `bfloat16`);
- `backend`: `auto`, `torch` or `triton`;
- `tokenizer`: read by lm-eval's synthetic tasks only (the model uses its own).

Anything else is refused in one sentence, and so are `loglikelihood` requests: the
harness's multiple-choice tasks would need each continuation scored on the evicted
cache, which this model does not do.
"""

from __future__ import annotations

import dataclasses
import logging
import sys

import lm_eval.models  # noqa: F401  (lm-eval's own models first: see below)
import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from pagekv.maths.config import EvictionConfig
from pagekv.runtime.decode import DECODE_DTYPES
from pagekv.runtime.models import bundled_cache_dir, bundled_model, load_model
from pagekv.runtime.runner import Runner

log = logging.getLogger(__name__)

__all__ = [
    "RULER_OFFLINE_TASKS",
    "PageKVLM",
    "cli",
    "prefill",
    "prompt_ids",
    "split_question",
    "tokenizer_name",
]

#: lm-eval's RULER tasks that build their data offline (the others download essays or
#: SQuAD/HotpotQA).
RULER_OFFLINE_TASKS = ("niah_single_1", "niah_multikey_2", "niah_multikey_3", "ruler_vt",
                       "ruler_cwe", "ruler_fwe")  # fmt: skip
#: The question modes (`pagekv.engine.study.MODES`' names).
QUESTION_MODES = ("inside", "after")
#: What lm-eval itself adds to the model arguments (`--batch_size`, `--device`, ...).
HARNESS_ARGS = ("batch_size", "max_batch_size", "device")
_CONFIG_FIELDS = {f.name: f for f in dataclasses.fields(EvictionConfig)}


def split_question(prompt: str) -> tuple[str, str]:
    """`(context, question)` of a RULER prompt: the question is its last paragraph,
    from the last line that starts with "Question:" (vt, cwe, fwe: their answer prefix
    follows it) or else its last line (the needle tasks: the question and the answer
    prefix on one line). The context keeps its final newline; the two join back into
    the prompt."""
    cut = prompt.rfind("\nQuestion:")
    if cut < 0:
        cut = prompt.rstrip("\n").rfind("\n")
    if cut < 0:
        raise ValueError("the prompt has one line: no question to put after the context")
    return prompt[: cut + 1], prompt[cut + 1 :]


def prompt_ids(tokenizer, prompt: str) -> tuple[list[int], list[int]]:
    """The ids of `prompt`'s context and of its question (`split_question`), each
    tokenized on its own, no special tokens: what either question mode prefills, so the
    two see the same tokens."""
    context, question = split_question(prompt)
    return tuple(tokenizer(x, add_special_tokens=False)["input_ids"] for x in (context, question))


def prefill(runner: Runner, c_ids: list[int], q_ids: list[int], mode: str, window: int):
    """The runner's prefill of a prompt in question mode `mode`: `inside`, the context
    and the question at once; `after`, the context, the question kept for after the
    eviction."""
    if mode == "after":
        return runner.prefill(c_ids, window_max=window, question_ids=q_ids)
    return runner.prefill(c_ids + q_ids, window_max=window)


def _field(name: str, value):
    """`value` as `EvictionConfig.name`'s type (lm-eval hands numbers and strings)."""
    kind = _CONFIG_FIELDS[name].type
    if kind in ("int", int):
        return int(value)
    if kind in ("float", float):
        return float(value)
    return str(value) if not isinstance(value, bool) else value


# lm-eval imports its own models (`lm_eval.models`) only while its registry is empty
# (`get_model`): registering `pagekv` before they are would hide them, `hf` and the rest.
# Hence the import above.
@register_model("pagekv")
class PageKVLM(LM):
    """lm-eval's `LM` over pagekv's runner (see the module docstring)."""

    def __init__(
        self,
        pretrained: str = "bundled",
        question: str = "inside",
        dtype: str = "auto",
        backend: str = "auto",
        tokenizer: str | None = None,
        **kwargs,
    ):
        super().__init__()
        harness = {k: kwargs.pop(k) for k in HARNESS_ARGS if k in kwargs}
        unknown = sorted(k for k in kwargs if k not in _CONFIG_FIELDS)
        if unknown:
            raise ValueError(
                f"pagekv's lm-eval model does not take {', '.join(unknown)}: it takes "
                f"pretrained, question, dtype, backend, tokenizer and the EvictionConfig "
                f"fields ({', '.join(_CONFIG_FIELDS)})"
            )
        if question not in QUESTION_MODES:
            raise ValueError(f"question must be 'inside' or 'after', not {question!r}")
        if str(dtype) not in DECODE_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DECODE_DTYPES)}, not {dtype!r}")
        self.config = EvictionConfig(**{k: _field(k, v) for k, v in kwargs.items()})
        self.question = question
        device = harness.get("device")
        if device and str(device).startswith("cuda") and not torch.cuda.is_available():
            log.info("lm-eval asked for %s; no CUDA here: the CPU", device)  # its default
            device = None
        self.loaded = load_model(str(pretrained), device=device)
        self.tokenizer = self.loaded.tokenizer
        self.runner = Runner(self.loaded.model, self.tokenizer, backend, decode_dtype=dtype)
        log.info("pagekv lm-eval model: %s, %s, question %s", pretrained, self.config, question)
        spec = bundled_model(str(pretrained))
        if tokenizer is None and spec is not None:
            # What to name: the copy just loaded (no second load: not `tokenizer_name`).
            name = spec.hub_id if self.loaded.source == "hub" else bundled_cache_dir(spec.key)
            log.warning(
                "lm-eval's RULER tasks load the tokenizer that tokenizer= (else pretrained=) "
                "names, and %r is pagekv's name, not a hub id: add tokenizer=%s "
                "(python -m pagekv eval adds it)", pretrained, name
            )  # fmt: skip

    def answer(self, prompt: str, max_new_tokens: int, until=()) -> str:
        """The greedy answer to `prompt` under this model's eviction and question mode
        (`prompt_ids`, `prefill`), cut at the first of `until`."""
        c_ids, q_ids = prompt_ids(self.tokenizer, prompt)
        pre = prefill(self.runner, c_ids, q_ids, self.question, self.config.window)
        res = self.runner.evaluate(pre, self.config, max_new_tokens=max_new_tokens)
        text = self.tokenizer.decode(res.tokens, skip_special_tokens=True)
        for stop in until or ():
            if stop and stop in text:
                text = text[: text.index(stop)]
        return text

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """The answer to each request, with a progress bar over them on stderr, one step
        a request, as lm-eval's own `hf` model shows (off with `disable_tqdm`, and on
        every process but the first)."""
        out = []
        bar = tqdm(
            total=len(requests),
            disable=disable_tqdm or self.rank != 0,
            desc="Running generate_until requests",
        )
        with bar:
            for request in requests:
                prompt, kwargs = request.args
                kwargs = dict(kwargs or {})
                if kwargs.get("do_sample"):
                    raise ValueError("pagekv's lm-eval model decodes greedily: do_sample=True")
                until = kwargs.get("until") or []
                until = [until] if isinstance(until, str) else list(until)
                out.append(self.answer(prompt, int(kwargs.get("max_gen_toks", 256)), until))
                bar.update(1)
        return out

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError(
            "pagekv's lm-eval model only generates (generate_until tasks such as RULER): "
            "it does not score continuations on an evicted cache"
        )

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        self.loglikelihood(requests)


def tokenizer_name(pretrained: str) -> str:
    """What lm-eval's synthetic tasks load the tokenizer of `pretrained` by: a bundled
    model's local copy (converted on its first load), else the name itself."""
    spec = bundled_model(pretrained)
    if spec is None:
        return pretrained
    folder = bundled_cache_dir(spec.key)
    if not folder.is_dir():
        load_model(pretrained, device="cpu")
    return str(folder)


def with_tokenizer(model_args: str) -> str:
    """`model_args` with `tokenizer=` the local copy of a bundled `pretrained` model when
    it names none (`tokenizer_name`)."""
    pairs = dict(kv.split("=", 1) for kv in model_args.split(",") if "=" in kv)
    name = pairs.get("pretrained", "bundled")
    if "tokenizer" in pairs or bundled_model(name) is None:
        return model_args
    folder = tokenizer_name(name)
    return f"{model_args},tokenizer={folder}" if model_args else f"tokenizer={folder}"


def cli(argv: list[str]) -> int:
    """`python -m pagekv eval ...`: lm-eval's own command line (`lm_eval run`), with the
    `pagekv` model registered (importing this module does it) and `with_tokenizer`
    applied to `--model_args`."""
    from lm_eval.__main__ import cli_evaluate

    argv = list(argv)
    for i, arg in enumerate(argv):
        if arg == "--model_args" and i + 1 < len(argv):
            argv[i + 1] = with_tokenizer(argv[i + 1])
        elif arg.startswith("--model_args="):
            argv[i] = "--model_args=" + with_tokenizer(arg.split("=", 1)[1])
    sys.argv = ["lm-eval", *argv]
    cli_evaluate()
    return 0
