"""Capture the observation window's queries during prefill (docs/design.md, "The data path").

Forward pre-hooks on every attention module (`model.model.layers[i].self_attn`) see
the module's input `hidden_states` `[B, n, D]` and its rotary `position_embeddings`
`(cos, sin)`, each `[B, n, d]`. From them the hook recomputes the queries of the last
`w` positions exactly as the module does (Llama / Qwen2 / Mistral / Qwen3 code):

    q = q_proj(hidden[:, -w:])                  # [B, w, H * d]
    q = q.view(B, w, H, d)  (then q_norm(q) where the module has one, e.g. Qwen3)
    q = apply_rotary_pos_emb(q.transpose(1, 2), cos[:, -w:], sin[:, -w:])   # [B, H, w, d]

Only `w` rows are projected: no `output_attentions`, no `n x n` matrix. The module's
own `scaling` (its softmax scale) is recorded beside the queries, so
`attention_profiles(q_win, keys, scale)` reproduces the model's attention rows.
"""

from __future__ import annotations

import sys

import torch
from torch import nn


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
