"""The prefill: the model's forward over the prompt, capturing the observation window's
queries on the way (docs/design.md, "The data path"), and `Prefill`, what one prompt's
prefill keeps for any number of evictions.

`forward(model, ids, pos, cache, ...)` is the model's own forward of `ids` at positions
`pos..` into a transformers cache, keeping the last logits only: the prefill, and the
reconstruction scorer's pass (`pagekv.runtime.reconstruct`), run it.

The capture. Forward pre-hooks on every attention module
(`model.model.layers[i].self_attn`) see the module's input `hidden_states` `[B, n, D]`
and its rotary `position_embeddings` `(cos, sin)`, each `[B, n, d]`. From them the hook
recomputes the queries of the last `w` positions exactly as the module does (Llama /
Qwen2 / Mistral / Qwen3 code):

    q = q_proj(hidden[:, -w:])                  # [B, w, H * d]
    q = q.view(B, w, H, d)  (then q_norm(q) where the module has one, e.g. Qwen3)
    q = apply_rotary_pos_emb(q.transpose(1, 2), cos[:, -w:], sin[:, -w:])   # [B, H, w, d]

Only `w` rows are projected: no `output_attentions`, no `n x n` matrix. The module's
own `scaling` (its softmax scale) is recorded beside the queries, so
`attention_profiles(q_win, keys, scale)` reproduces the model's attention rows.
"""

from __future__ import annotations

import inspect
import sys
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from pagekv.maths.config import EvictionConfig
from pagekv.maths.entropy import HeadMasses
from pagekv.runtime.backend import score_window


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The self-attention module of every decoder layer (`model.model.layers[i].self_attn`).

    Raises ValueError for an architecture this capture does not understand (it needs
    `q_proj`, `head_dim` and the rotary embeddings passed as `position_embeddings`).
    """
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ValueError(
            f"{type(model).__name__} has no `model.layers`; the runner supports decoder-only "
            "Llama / Qwen2 / Mistral / Qwen3 style models"
        )
    mods = []
    for i, layer in enumerate(layers):
        attn = getattr(layer, "self_attn", None)
        if attn is None or not hasattr(attn, "q_proj") or not hasattr(attn, "head_dim"):
            raise ValueError(
                f"layer {i} of {type(model).__name__} has no `self_attn.q_proj`; the runner "
                "supports Llama / Qwen2 / Mistral / Qwen3 style attention"
            )
        mods.append(attn)
    return mods


def attention_scale(module: nn.Module) -> float:
    """The softmax scale the module multiplies its logits by (`module.scaling`)."""
    scale = getattr(module, "scaling", None)
    return float(scale) if scale is not None else float(module.head_dim) ** -0.5


def _rotary_fn(module: nn.Module):
    """The model family's own `apply_rotary_pos_emb` (same module as the attention class)."""
    fn = getattr(sys.modules.get(type(module).__module__), "apply_rotary_pos_emb", None)
    return fn if fn is not None else _apply_rotary


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _apply_rotary(q, k, cos, sin, unsqueeze_dim: int = 1):
    """Llama's rotary embedding, the fallback when the family's module has none."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def window_queries(
    module: nn.Module, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """Queries after RoPE of the given rows, as the attention module computes them.

    Args:
        module: a Llama-style attention module (`q_proj`, `head_dim`, optional `q_norm`).
        hidden: `[B, w, D]` the module's input rows (already layer-normed).
        cos, sin: `[B, w, d]` the rotary tables of those rows' positions.

    Returns:
        `[B, H, w, d]` in the model's dtype.
    """
    B, w, _ = hidden.shape
    q = module.q_proj(hidden).view(B, w, -1, module.head_dim)  # [B, w, H, d]
    q_norm = getattr(module, "q_norm", None)
    if q_norm is not None:
        q = q_norm(q)
    q = q.transpose(1, 2)  # [B, H, w, d]
    return _rotary_fn(module)(q, q, cos, sin)[0]


class WindowQueryCapture:
    """Collects `[H, w, d]` window queries per layer (the model's dtype) during one forward.

    Use as a context manager around the prefill:

        cap = WindowQueryCapture(model, window=128)
        with cap:
            model(input_ids=ids, ...)
        q_win = cap.stacked()  # [L, H, w', d], w' = min(window, n)

    Batch size must be 1 (the runner prefills one prompt at a time).
    """

    def __init__(self, model: nn.Module, window: int):
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be an integer >= 1; got {window!r}")
        self.modules = attention_modules(model)
        self.window = window
        self.queries: list[torch.Tensor | None] = [None] * len(self.modules)
        self._handles = []

    @property
    def scales(self) -> list[float]:
        return [attention_scale(m) for m in self.modules]

    def _hook(self, index: int):
        def hook(module, args, kwargs):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            pe = kwargs.get("position_embeddings", args[1] if len(args) > 1 else None)
            if hidden is None or pe is None:
                raise RuntimeError(
                    f"attention layer {index} was called without hidden_states and "
                    "position_embeddings; cannot capture its window queries"
                )
            if hidden.shape[0] != 1:
                raise ValueError(f"capture needs batch size 1; got {hidden.shape[0]}")
            cos, sin = pe
            w = min(self.window, hidden.shape[1])
            q = window_queries(module, hidden[:, -w:], cos[:, -w:], sin[:, -w:])
            # [H, w, d] in the model's dtype, on its device: the scoring kernel takes fp16 or
            # bf16 queries over a cache of their dtype to its native dot (fp32
            # accumulation); the twin upcasts.
            self.queries[index] = q[0].detach()
            return None

        return hook

    def __enter__(self) -> WindowQueryCapture:
        self.queries = [None] * len(self.modules)
        for i, m in enumerate(self.modules):
            self._handles.append(m.register_forward_pre_hook(self._hook(i), with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def stacked(self) -> torch.Tensor:
        """`[L, H, w', d]` in the model's dtype, on its device."""
        missing = [i for i, q in enumerate(self.queries) if q is None]
        if missing:
            raise RuntimeError(f"no window queries were captured for layers {missing}")
        return torch.stack(self.queries)


# ------------------------------------------------------------------------- the forward


def cache_kwarg(model) -> str:
    """`model.forward`'s cache argument: `cache` in transformers 5.24, `past_key_values`
    before (5.17 on the GPU machines, which silently ignores `cache`)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def as_id_list(ids, name: str) -> list[int]:
    """`ids` (a list, or a `[n]` or `[1, n]` integer tensor) as a list of token ids;
    ValueError naming `name` for an empty list, a negative id or a tensor of another
    shape or dtype."""
    if isinstance(ids, torch.Tensor):
        if ids.dim() == 2 and ids.shape[0] == 1:
            ids = ids[0]
        if ids.dim() != 1 or ids.is_floating_point():
            raise ValueError(f"{name} must be a 1-D integer tensor; got {tuple(ids.shape)}")
        ids = ids.tolist()
    ids = [int(i) for i in ids]
    if not ids:
        raise ValueError(f"{name} is empty")
    if min(ids) < 0:
        raise ValueError(f"{name} holds negative token ids")
    return ids


def synced_now(device: torch.device) -> float:
    """Wall time, after the device's queued work (CUDA runs asynchronously): the clock the
    prefill's timing, the runner's and the pool's (`pagekv.runtime.serve`) read."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def forward(model, ids: list[int], pos: int, cache, cache_kw: str, dev):
    """`model`'s forward of `ids` at positions `pos..` into `cache`: the last logits only."""
    return model(
        input_ids=torch.tensor([ids], dtype=torch.long, device=dev),
        position_ids=torch.arange(pos, pos + len(ids), device=dev)[None],
        **{cache_kw: cache},
        use_cache=True,
        logits_to_keep=1,
    )


# ------------------------------------------------------------------------- the prefill kept


@dataclass
class Prefill:
    """One prompt, prefilled once; reusable for any number of `Runner.evaluate` calls.

    `cache` is never mutated after the prefill: every evaluation works on a copy.
    """

    ids: list[int]  # the prefilled ids (the context only in question-after mode)
    n: int  # len(ids)
    cache: object  # transformers DynamicCache, layers' keys/values [1, G, n, d]
    q_win: torch.Tensor  # [L, H, w', d] in the model's dtype, w' = min(window_max, n), after RoPE
    first_logits: torch.Tensor  # float32 [V], the prefill's last-position logits
    question_ids: list[int] | None  # question-after mode: prefilled after compaction
    timings: dict  # {"prefill_s": ...}
    n_layers: int  # L
    n_heads: int  # H
    n_groups: int  # G (KV heads)
    head_dim: int  # d
    scale: float  # softmax scale of the attention (module.scaling)
    scales: list[float] = field(repr=False, default_factory=list)  # per layer
    backend: str = "torch"  # resolved backend of the runner that made it
    _scores: dict = field(default_factory=dict, repr=False)  # (w, n_sink) -> scores()
    #: The reconstruction pass's scores by aggregation (`Runner.reconstruction`).
    reconstruction: dict | None = field(default=None, repr=False)

    @property
    def window_max(self) -> int:
        """w', the number of window queries captured per layer."""
        return int(self.q_win.shape[2])

    @property
    def mode(self) -> str:
        return "after" if self.question_ids else "inside"

    @property
    def token_bytes(self) -> int:
        """The bytes of one token's key and value in one (layer, KV head) of the cache."""
        return 2 * self.head_dim * self.cache.layers[0].keys.element_size()

    def scores(self, window: int, n_sink: int) -> tuple[torch.Tensor, HeadMasses, str]:
        """Profiles `[L, H, n]` float32 of the last `min(window, n)` queries and their
        per-head masses for `n_sink` sinks, on the cache's device; and the backend that
        scored them.

        Memoised per (effective window, n_sink). On the Triton backend every layer's
        scoring kernel writes the profiles and the mass sums in place on the device;
        on the torch backend the twin computes the profiles once per window and the
        masses from them (`HeadMasses.from_profiles`, what the twin defines). Raises
        ValueError if the window is longer than what the prefill captured.
        """
        w = self._effective_window(window)
        key = (w, int(n_sink))
        if key not in self._scores:
            cached = next((v for (kw, _), v in self._scores.items() if kw == w), None)
            if cached is not None and self.backend == "torch":
                prof = cached[0]
                self._scores[key] = (prof, HeadMasses.from_profiles(prof, n_sink), "torch")
            else:
                # Every layer in one launch pair on Triton, each layer's keys read where
                # the cache holds them; the queries stay in the cache's dtype.
                keys = [layer.keys[0] for layer in self.cache.layers]
                self._scores[key] = score_window(
                    self.q_win[:, :, -w:], keys, n_sink,
                    self.scales or [self.scale] * self.n_layers, backend=self.backend,
                )  # fmt: skip
        return self._scores[key]

    def profiles(self, window: int) -> torch.Tensor:
        """The attention profiles `[L, H, n]` of `scores(window, n_sink)` (profiles do
        not depend on the sinks; an existing entry of any n_sink is reused)."""
        w = self._effective_window(window)
        n_sink = next((ns for kw, ns in self._scores if kw == w), EvictionConfig().n_sink)
        return self.scores(w, n_sink)[0]

    def _effective_window(self, window: int) -> int:
        w = min(int(window), self.n)
        if w < 1:
            raise ValueError(f"window must be >= 1; got {window}")
        if w > self.window_max:
            raise ValueError(
                f"window {w} exceeds the {self.window_max} window queries captured at "
                f"prefill; prefill again with window_max >= {w}"
            )
        return w
