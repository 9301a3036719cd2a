"""The decode: the step, its CUDA graph and the greedy loop. Every answer token of
every run, for Llama, Mistral, Qwen2 and Qwen3 decoders, on the CPU and on a GPU: few
ops per layer, linear weights in one dtype, the kept pages in a paged cache.

**The step** (`LeanDecoder`).

Why: docs/design.md, "What runs where" (the decode), and docs/performance.md: on the CPU
reading the weights is the cost, and a `DynamicCache` copies the whole cache per token.

What. `LeanDecoder(model, weight_dtype)` keeps a copy of the model's linear weights
in `weight_dtype` (`resolve_decode`: float16 for a float32 model on the CPU, 10
mantissa bits where bfloat16 has 7; the model's own dtype elsewhere; float32 on
request, the prefill's numerics), with q/k/v fused into one matrix, gate/up into
another, and each RMSNorm's weight folded into the columns of the linear that reads
it (in float32, before the cast). Everything else stays float32: the residual stream,
the norms (Qwen3's per-head q/k norms included) and RoPE; the attention reads the
cache in the prefill's dtype.
Each linear casts its input to `weight_dtype`. A forward of several tokens per row
(the question, asked after compression) runs its linears in the model's own weights
instead: a product of many rows reads the weights once either way, and on a CPU
without native half-precision arithmetic float32 is the faster one. The cache is a
`PagedCache` (`pagekv.runtime.paged_cache`): each (layer, group)'s kept pages in
blocks of a pool, with room for the new tokens, written in place.

The step is the model's own computation (`LlamaDecoderLayer`: pre-norm attention and
MLP with residuals; RoPE from the model's own `rotary_emb`, so scaled variants stay
right, applied elementwise with a roll for `rotate_half`; the attention's own
`scaling`; the MLP's own `act_fn`), checked against the transformers forward in
`tests/test_lean_decode.py`: float32 weights match it to 1e-5, half weights to the
tolerance of their rounding. Which models: `unsupported_reason(model)` accepts Llama,
Mistral, Qwen2 and Qwen3 decoders (biases included) whose layers have exactly these
parts, the architectures the window capture (`pagekv.runtime.prefill`) knows; the
runner refuses anything else in one sentence.

Attention. Each (layer, group) attends its own kept tokens (layers and groups may
differ: padded and global plans, whose pages were allocated per group), through
`PagedCache.attend`: the paged-decode kernel for one new token on the Triton backend,
torch's SDPA otherwise; new tokens are causal among themselves. Several new tokens
(the question, in "after" mode) are one forward, not one per token.

**Its CUDA graph** (`GraphedStep`, `GraphBuckets`). A decode step of a 1.5B model on a
GPU is some 28 x 20 kernel launches of a few microseconds each, so launching them from
Python costs more than running them. A CUDA graph records the launches once and replays
them with one call. What a replay needs: inputs and outputs at fixed addresses, and no
value read from the host that changes from step to step. The decode step provides that
with a `static` `PagedCache` (`pagekv.runtime.paged_cache`: writes and attention through
the block tables and the device lengths, the paged-decode kernel for attention) and its
position as a 0-dim device tensor (`LeanDecoder.step`).

`GraphedStep(decoder, cache)` is a `forward(ids, pos) -> logits` for one decode:

1. several tokens (the question) run eagerly;
2. the first one-token step runs eagerly on a side stream (what PyTorch asks before a
   capture: the kernels compiled, the allocator warmed);
3. the second is captured (recording runs nothing; the host's count of the cache's
   tokens grows once, as in an eager step) and replayed once, which runs it;
4. every later one copies its token and position into the graph's inputs, grows the
   host's count (the replay adds on the device) and replays.

If the capture fails, the step says why in the log and runs eagerly from then on
(`GraphedStep.failed`); each result names the decode that ran (`backends["decode"]`).

A capture costs as much as some tens of replays, so a graph serves every decode of its
capacity bucket (`GraphBuckets`); docs/design.md, "What runs where", says how buckets
are kept and what tests/test_decode_graph.py checks on the CPU.

**The greedy loop** (`greedy`): the next tokens stay on the device, fed back as the
next step's input, and the host reads them once per chunk of steps.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import torch
import torch.nn.functional as F

from pagekv.runtime.messages import one_line
from pagekv.runtime.paged_cache import PagedCache

__all__ = [
    "DECODE_DTYPES",
    "GraphBuckets",
    "GraphedStep",
    "LeanDecoder",
    "greedy",
    "resolve_decode",
    "unsupported_reason",
]

log = logging.getLogger(__name__)


#: Model types whose decoder layers `LeanDecoder` reproduces (checked part by part).
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
#: What `resolve_decode` (and `--dtype`) accept.
DECODE_DTYPES = ("auto", "float32", "float16", "bfloat16")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_decode(decode_dtype, model) -> tuple[torch.dtype, str]:
    """The lean step's weight dtype for `decode_dtype` on `model`, and a label that says
    which decode runs (`RunResult.backends["decode"]`).

    "auto" is float16 for a float32 model on the CPU (half the bytes to read per token),
    else the model's own dtype (on a GPU the step reads the paged cache through the
    paged-decode kernel); "float32", "float16" and "bfloat16" ask for those weights
    ("float32" is the prefill's numerics on a float32 model). Raises ValueError, in one
    sentence, for a decode dtype it does not know or a model the step cannot run.
    """
    key = str(decode_dtype).lower().removeprefix("torch.")
    if key not in DECODE_DTYPES:
        raise ValueError(
            f"unknown decode dtype {decode_dtype!r}: use one of {', '.join(DECODE_DTYPES)}"
        )
    if (reason := unsupported_reason(model)) is not None:
        raise ValueError(f"pagekv's decode step cannot run this model: {reason}")
    param = next(model.parameters())
    if key == "auto":
        cpu32 = param.device.type == "cpu" and param.dtype == torch.float32
        key = "float16" if cpu32 else str(param.dtype).removeprefix("torch.")
    return _DTYPES[key], f"lean step, {key} linear weights"


def unsupported_reason(model) -> str | None:
    """Why `LeanDecoder` cannot run `model` (a one-line reason), or None if it can."""
    cfg = getattr(model, "config", None)
    kind = getattr(cfg, "model_type", None)
    if kind not in FAMILIES:
        return f"model type {kind!r} is not one of {', '.join(FAMILIES)}"
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "rotary_emb"):
        return "no model.layers / model.rotary_emb"
    if not isinstance(getattr(model, "lm_head", None), torch.nn.Linear):
        return "no linear lm_head"
    for i, layer in enumerate(inner.layers):
        att, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        names = ("q_proj", "k_proj", "v_proj", "o_proj")
        if att is None or not all(type(getattr(att, n, None)) is torch.nn.Linear for n in names):
            return f"layer {i}: attention is not q/k/v/o linear projections"
        if hasattr(att, "sinks"):
            return f"layer {i}: attention has sinks"
        norms = [getattr(att, n, None) for n in ("q_norm", "k_norm")]
        if any(n is not None for n in norms) and any(_norm_eps(n) is None for n in norms):
            return f"layer {i}: the per-head q/k norms are not a pair of RMSNorms"
        names = ("gate_proj", "up_proj", "down_proj")
        if mlp is None or not all(type(getattr(mlp, n, None)) is torch.nn.Linear for n in names):
            return f"layer {i}: the MLP is not a gated gate/up/down MLP"
        for n in ("input_layernorm", "post_attention_layernorm"):
            if _norm_eps(getattr(layer, n, None)) is None:
                return f"layer {i}: {n} is not an RMSNorm"
        if getattr(att, "sliding_window", None):
            return f"layer {i}: sliding-window attention"
    if _norm_eps(getattr(inner, "norm", None)) is None:
        return "the final norm is not an RMSNorm"
    return None


def _head_norms(att):
    """Qwen3's per-head RMSNorms of q and k as `(eps, weight)`: `eps` a 0-dim float32
    tensor, `weight` `[H + G, d]` float32 (q's weight for the query heads, k's for the
    KV heads, in qkv's order); None for attention without them."""
    if getattr(att, "q_norm", None) is None:
        return None
    H = att.q_proj.out_features // att.head_dim
    G = att.k_proj.out_features // att.head_dim
    w = torch.cat([att.q_norm.weight.detach().float().expand(H, -1),
                   att.k_norm.weight.detach().float().expand(G, -1)])  # fmt: skip
    eps = torch.tensor(_norm_eps(att.q_norm), device=w.device)
    if _norm_eps(att.k_norm) != _norm_eps(att.q_norm):
        raise ValueError("LeanDecoder: q_norm and k_norm have different epsilons")
    return eps, w


_RMS_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")


def _norm_eps(norm) -> float | None:
    """The epsilon of a Llama-style RMSNorm (`weight * x / rms(x)`), else None."""
    if type(norm).__name__ not in _RMS_NORMS:
        return None
    eps = getattr(norm, "variance_epsilon", None)
    return float(eps) if eps is not None else None


class _Linear:
    """Linears applied to the same input, fused: the weight `[sum(out), in]` in `dtype`
    with `scale` `[in]` (an RMSNorm's weight) folded into its columns in float32
    (`W (s * x) = (W diag(s)) x`), and the model's own float32 modules for inputs of
    many rows (`LeanDecoder.step`)."""

    def __init__(self, linears, dtype, scale=None):
        w = torch.cat([m.weight.detach().float() for m in linears])
        if scale is not None:
            w = w * scale.detach().float()[None, :]
        self.weight = w.to(dtype).contiguous()
        self.weight_t = self.weight.t()  # the view `mm` reads, made once
        self.modules = list(linears)
        self.scale = None if scale is None else scale.detach().float()
        self.bias = None
        if any(m.bias is not None for m in linears):
            b = [m.bias if m.bias is not None else m.weight.new_zeros(m.out_features)
                 for m in linears]  # fmt: skip
            self.bias = torch.cat([x.detach() for x in b]).float()

    def __call__(self, x: torch.Tensor, own: bool = False) -> torch.Tensor:
        """`x` `[rows, in]` -> `[rows, out]`: in the fused half-precision weight (`x` cast
        to it unless it is in it already; the product in the weight's dtype, float32 with
        a bias added), or (`own`, `x` float32) in the model's own float32 weights.

        The half-precision product is not cast back here: its values are what the
        float32 copy would hold, and the op that reads them (an add into the float32
        residual, a product with float32 RoPE tables, a copy into the float32 cache)
        promotes them itself, one op fewer per linear."""
        if own:
            h = x if self.scale is None else x * self.scale
            h = h.to(self.modules[0].weight.dtype)  # a half-precision model's own weights
            ys = [F.linear(h, m.weight, m.bias) for m in self.modules]
            return ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)
        y = torch.mm(x if x.dtype == self.weight.dtype else x.to(self.weight.dtype), self.weight_t)
        return y if self.bias is None else y + self.bias


class LeanDecoder:
    """The decode step of a Llama-family model, with linear weights in `weight_dtype`
    (see the module docstring). Build once per model; `step` is thread-compatible but
    one `PagedCache` is one decode's."""

    def __init__(self, model, weight_dtype: torch.dtype = torch.float16):
        if (reason := unsupported_reason(model)) is not None:
            raise ValueError(f"LeanDecoder: {reason}")
        inner = model.model
        self.weight_dtype = weight_dtype
        self.embed = inner.embed_tokens
        self.rotary = inner.rotary_emb
        # Each RMSNorm's weight is folded into the linear that reads it (`_Linear`).
        dev = inner.embed_tokens.weight.device
        self.final_eps = torch.tensor(_norm_eps(inner.norm), device=dev)
        self.head = _Linear([model.lm_head], weight_dtype, inner.norm.weight)
        self.layers = []
        for layer in inner.layers:
            att, mlp = layer.self_attn, layer.mlp
            self.layers.append(
                {
                    "eps1": torch.tensor(_norm_eps(layer.input_layernorm), device=dev),
                    "eps2": torch.tensor(_norm_eps(layer.post_attention_layernorm), device=dev),
                    "qkv": _Linear([att.q_proj, att.k_proj, att.v_proj], weight_dtype,
                                   layer.input_layernorm.weight),
                    "o": _Linear([att.o_proj], weight_dtype),
                    "gate_up": _Linear([mlp.gate_proj, mlp.up_proj], weight_dtype,
                                       layer.post_attention_layernorm.weight),
                    "down": _Linear([mlp.down_proj], weight_dtype),
                    "act": mlp.act_fn,
                    "scaling": float(att.scaling),
                    "split": (att.q_proj.out_features, att.k_proj.out_features),
                    "qk_norm": _head_norms(att),
                    "inter": mlp.gate_proj.out_features,
                }
            )  # fmt: skip
        self.head_dim = int(inner.layers[0].self_attn.head_dim)

    @staticmethod
    def _norm(x: torch.Tensor, eps: torch.Tensor, out: torch.Tensor | None = None):
        """`x / rms(x)`, as LlamaRMSNorm computes it in float32, without its weight (folded
        into the next linear), into `out` when given (a half-precision buffer: the cast
        the next linear needs, in the same op). `eps` is a 0-dim float32 tensor: an op
        given a Python number wraps and converts it at every call, which cost as much as
        the op on these tiny rows (so did `F.rms_norm` and `mean`)."""
        r = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
        r = torch.addcmul(eps, r, r, value=1.0 / x.shape[-1]).rsqrt_()
        return x * r if out is None else torch.mul(x, r, out=out)

    @torch.inference_mode()
    def step(self, ids: torch.Tensor, pos, cache: PagedCache) -> torch.Tensor:
        """Append `ids` `[B, t]` at positions `pos..pos+t-1` to `cache`; float32 logits
        `[B, V]` of the last position. `pos` is an int, a 0-dim long tensor on the
        device (with a `static` cache: then the step reads nothing from the host that
        changes between steps, and `GraphedStep` below can capture it as a CUDA graph),
        or a `[B]` long tensor, each row's own first position (rows of a shared pool,
        `pagekv.runtime.block_pool.PoolBatch`)."""
        B, t = ids.shape
        cache.grow(t)  # every layer's lengths, at once; each layer writes its slots
        d = self.head_dim
        own = t > 1  # several tokens per row: the model's own weights (module docstring)
        x = self.embed(ids).float().view(B * t, -1)  # [rows, D], the residual stream
        cos, signed = self._rope(x, pos, B, t)  # [B, t, 1, d] each
        half = d // 2
        # The inputs of the half-precision linears, written in place (each is read by its
        # product before the next write); None: float32 inputs for the model's weights.
        normed = None if own else x.new_empty(x.shape, dtype=self.weight_dtype)
        mid = None if own else x.new_empty(B * t, self.layers[0]["inter"], dtype=self.weight_dtype)
        for i, lay in enumerate(self.layers):
            qkv = lay["qkv"](self._norm(x, lay["eps1"], normed), own)
            nq, nk = lay["split"]
            H = nq // d
            # RoPE on q and k at once (adjacent in qkv): x cos + rotate_half(x) sin, with
            # rotate_half(x) sin = roll(x, d/2) * signed (`_rope`). Elementwise: a
            # [12, 64] x [64, 64] matrix product here cost more than a linear layer.
            qk = qkv[:, : nq + nk].view(B, t, -1, d)
            if lay["qk_norm"] is not None:  # Qwen3: each head's q and k normalised first
                eps, weight = lay["qk_norm"]
                qk = self._norm(qk.float(), eps) * weight
            qk = torch.addcmul(qk * cos, qk.roll(half, -1), signed)  # [B, t, H + G, d]
            q = qk[:, :, :H].transpose(1, 2)  # [B, H, t, d]
            k = qk[:, :, H:].transpose(1, 2)  # [B, G, t, d]
            v = qkv[:, nq + nk :].view(B, t, -1, d).transpose(1, 2)
            cache.write(i, k, v)
            a = cache.attend(i, q, lay["scaling"])  # [B, H, t, d]
            a = a.transpose(1, 2).reshape(B * t, H * d)
            x.add_(lay["o"](a, own))  # the add promotes a half-precision product
            gu = lay["gate_up"](self._norm(x, lay["eps2"], normed), own)
            m = lay["inter"]
            act = lay["act"](gu[:, :m].float())  # the activation in float32, as before
            h = act * gu[:, m:] if own else torch.mul(act, gu[:, m:], out=mid)
            x.add_(lay["down"](h, own))
        x = self._norm(x.view(B, t, -1)[:, -1], self.final_eps)
        return self.head(x).float()  # one row per batch row: the half-precision head

    def _rope(self, x: torch.Tensor, pos, B: int, t: int):
        """RoPE at positions `pos..pos+t-1`: `(cos, signed)` `[B, t, 1, d]` float32 such
        that a head's `x * cos + x.roll(d/2, -1) * signed` is `apply_rotary_pos_emb`'s
        `x * cos + rotate_half(x) * sin` (`rotate_half(x) = (-x2, x1)` and `roll` gives
        `(x2, x1)`, so `signed = (-sin1, sin2)`); the model's own `rotary_emb` gives cos
        and sin, its scaling included."""
        # `pos` an int, a 0-dim device tensor (a CUDA graph's input), or a `[B]` tensor:
        # each row's own first position (rows of a shared pool, `pagekv.runtime.serve`)
        steps = torch.arange(t, device=x.device)
        if isinstance(pos, torch.Tensor) and pos.dim() == 1:
            positions = pos.to(x.device)[:, None] + steps
        else:
            positions = (steps + pos).expand(B, t)
        cos, sin = self.rotary(x, positions)  # [B, t, d]
        cos, sin = cos.float(), sin.float()
        half = self.head_dim // 2
        signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        return cos[:, :, None, :], signed[:, :, None, :]


# ------------------------------------------------------------------------- the step as a CUDA graph


class GraphedStep:
    """`forward(ids [B, t], pos) -> float32 logits [B, V]` over one static `PagedCache`,
    the one-token steps replayed from a CUDA graph (see the module docstring)."""

    def __init__(self, decoder, cache):
        if not cache.static:
            raise ValueError("GraphedStep needs a static PagedCache")
        self.decoder, self.cache = decoder, cache
        self.graph: torch.cuda.CUDAGraph | None = None
        self.failed: str | None = None  # why the capture failed, if it did
        self._warm = False
        self._ids = self._pos = self._out = None

    @property
    def graphed(self) -> bool:
        """Whether the one-token steps are replayed from a graph."""
        return self.graph is not None

    def __call__(self, ids: torch.Tensor, pos: int) -> torch.Tensor:
        if ids.shape[1] != 1 or self.failed is not None:
            return self.decoder.step(ids, pos, self.cache)
        if self.graph is not None:
            self._ids.copy_(ids)
            self._pos.fill_(pos)
            self.cache.grow(1, device=False)  # the replay adds 1 on the device
            self.graph.replay()
            return self._out.clone()  # the next replay overwrites the graph's output
        position = torch.full((), pos, dtype=torch.long, device=ids.device)
        if not self._warm:
            self._warm = True
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                out = self.decoder.step(ids, position, self.cache)
            torch.cuda.current_stream().wait_stream(side)
            return out
        self._ids, self._pos = ids.clone(), position  # the capture
        added = self.cache.added
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                self._out = self.decoder.step(self._ids, self._pos, self.cache)
        except Exception as e:  # the recording ran nothing: undo the host's count
            self.cache.added = added
            self.failed = one_line(e)
            log.warning("pagekv decode: CUDA graph capture failed, decoding eagerly: %s",
                        self.failed)  # fmt: skip
            return self.decoder.step(ids, pos, self.cache)
        self.graph = graph
        graph.replay()
        return self._out.clone()


class GraphBuckets:
    """One `GraphedStep` per capacity bucket, the `limit` most recently used kept (each
    holds its pools and its graph's memory).

    `step_for(cache)` is the step for one decode of `cache` (a fresh `PagedCache`): the
    bucket's step with `cache`'s tokens adopted into its pools (its graph, once captured,
    replayed from the first one-token step on), or a new step over `cache.bucketed()`.
    """

    def __init__(self, decoder, limit: int = 4):
        self.decoder, self.limit = decoder, int(limit)
        self._steps: OrderedDict[tuple, GraphedStep] = OrderedDict()

    def __len__(self) -> int:
        return len(self._steps)

    def step_for(self, cache) -> GraphedStep:
        key = cache.bucket_key()
        step = self._steps.pop(key, None)
        if step is None:
            step = GraphedStep(self.decoder, cache.bucketed())
        else:
            step.cache.adopt(cache)
        self._steps[key] = step
        while len(self._steps) > self.limit:
            self._steps.popitem(last=False)
        return step


# ------------------------------------------------------------------------- the greedy loop


def greedy(forward, pre, max_new, eos_ids, chunk, keep_logits=False, rows=1, on_token=None):
    """Greedy decode of `rows` batch rows of the prefill `pre` (its question, if any,
    then up to `max_new` tokens, stopping a row at one of `eos_ids`) with
    `forward(ids [rows, t] on the device, pos) -> logits [rows, V]` appending to the
    cache: `(tokens per row, the first row's logits or None, stop reason per row)`.

    The next tokens stay on the device: the argmax is fed back as the next step's
    input with no round trip through the host, and the host reads the tokens once
    per `chunk` steps (one `tolist`), where it cuts each row's answer at its
    first EOS and calls `on_token(tokens_a, ...)` with the tokens so far. Steps
    decoded past a row's EOS are dropped: the tokens before it are the same (each
    depends only on those before it, and rows never mix), and so are the logits kept.
    """
    pos = pre.n
    tokens: list[list[int]] = [[] for _ in range(rows)]
    stops = ["max_new_tokens"] * rows
    if max_new == 0:
        return tokens, (torch.empty(0) if keep_logits else None), stops
    if pre.question_ids:
        ids = torch.tensor(
            [pre.question_ids] * rows, dtype=torch.long, device=pre.first_logits.device
        )
        logits = forward(ids, pos)
        pos += len(pre.question_ids)
    else:
        logits = pre.first_logits.expand(rows, -1)  # the prefill saw the whole prompt
    done = [False] * rows
    kept: list[torch.Tensor] = []
    pending: list[torch.Tensor] = []  # device tokens [rows, 1] the host has not read
    produced = 0
    while True:
        if keep_logits:
            kept.append(logits[0].float())
        tok = torch.argmax(logits, dim=-1).view(rows, 1)
        pending.append(tok)
        produced += 1
        if produced >= max_new or len(pending) >= chunk:
            for step in torch.cat(pending, 1).T.tolist():  # the chunk's one host read
                for row, t in enumerate(step):
                    if not done[row]:
                        tokens[row].append(t)
                        if t in eos_ids:
                            done[row], stops[row] = True, "eos"
            pending = []
            if on_token is not None:
                on_token(*(list(t) for t in tokens))
            if all(done) or produced >= max_new:
                break
        logits = forward(tok, pos)
        pos += 1
    return tokens, (torch.stack(kept[: len(tokens[0])]).cpu() if keep_logits else None), stops
