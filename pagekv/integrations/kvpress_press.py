"""Page-EntroKV as an NVIDIA kvpress press: the same decision as `pagekv.maths.plan`, in kvpress.

kvpress (https://github.com/NVIDIA/kvpress) compresses the KV cache during prefill
through a "press": a dataclass whose forward hook, after each attention layer has run,
hands the layer's cache to ``press.compress(module, hidden_states, keys, values,
attentions, kwargs)`` and stores the smaller keys and values it returns. This press
decides with pagekv's own core, layer by layer:

1. the last ``w = min(window, n)`` rows of ``hidden_states`` are projected to queries
   and rotated with the layer's ``position_embeddings`` (``pagekv.runtime.prefill.window_queries``,
   the very function the runner's capture uses), as SnapKV's press recomputes its window;
2. ``pagekv.runtime.backend.score_window`` gives the profiles ``[B, H, n]`` of those queries over
   the layer's keys (after RoPE: exactly the keys the cache holds);
3. ``pagekv.plan(profiles, n_groups=G, config=EvictionConfig(...))`` picks the pages each
   KV head keeps (the batch plays the role of plan's layer axis, so every sequence of a
   batch gets its own pages);
4. ``pagekv.runtime.backend.compact_layers`` gathers them: keys and values
   ``[B, G, k', d]``, with the same ``k'`` in every KV head (the pooled policies are
   dense by construction).

Worked example, one layer of SmolLM2-135M (H = 9 query heads, G = 3 KV heads) on a
context of ``n = 100`` tokens, ``PageEntroKVPress(budget=0.3, page_size=16)``: pages
``[0..6]`` hold tokens ``[0..15], [16..31], ..., [96..99]``; the sinks (tokens 0-3) and
the window (tokens 68-99) protect pages 0, 4, 5 and 6 = 16 + 16 + 16 + 4 = 52 tokens >
``k = floor(0.3 * 100) = 30``, so this budget is infeasible: the press keeps the 52
protected tokens and logs one warning that names the smallest feasible budget, 0.52
(with ``strict=True`` it raises that ``BudgetError`` instead). With ``budget=0.7``
(``k = 70``) one more page fits (52 + 16 = 68 <= 70): each KV head keeps the 5 pages
``{0, j, 4, 5, 6}`` where ``j`` is its best-scoring free page, 68 tokens, and ``keys``
comes back ``[1, 3, 68, 64]``.

Budget. Give ``budget`` (pagekv's fraction KEPT, ``k = floor(budget * n)`` tokens per
(layer, KV head)) or kvpress's ``compression_ratio`` (fraction REMOVED; ``k`` is then what
kvpress's own presses keep, ``max(1, int(n * (1 - compression_ratio)))``), never both;
neither means no compression, kvpress's default. Whole pages are kept, so the stored count
``k'`` is at most ``k`` (protected pages first, then the best pages that still fit).

kvpress's evaluation scripts set ``press.compression_ratio`` on a registered press, so
the fields are mutable (like kvpress's presses) and checked again at every ``compress``.

Scorer. ``scorer="window"`` (the default) is the per-layer hook above. With
``scorer="reconstruct"`` (pagekv's question-agnostic scorer, `EvictionConfig(scorer=
"reconstruct")`, the idea of KVzip) nothing is pressed during the prefill: ``with
press(model):`` wraps ``model.model.forward`` to capture the ids and the cache of the one
forward run inside the block (the prefill), and when the block exits

1. the model reads ``REPEAT_PROMPT`` and then the whole prefilled sequence again, in
   chunks of ``reconstruct_chunk`` tokens, on a copy of that cache
   (``pagekv.runtime.reconstruct.reconstruction_scores``, the runner's pass: the
   prefill's cache is read, never changed); each head's score of token ``t`` is the
   largest attention a reconstruction query gives it, normalised to a profile
   (``as_profiles``);
2. each layer is planned with the same `EvictionConfig` as the window path (plus
   ``scorer="reconstruct"``: the sinks and the window's pages stay protected) and its
   keys and values are compacted in place to the planned pages.

The context is everything that one forward prefilled: in kvpress's pipeline the
chat-templated context (the question comes after the block, on the compressed cache),
in ``with press(model): model.model(input_ids=ids, ...)`` the ids. The instruction's
ids are ``reconstruct_prompt_ids`` when given (``[]``: no instruction, what the runner
reads without a tokenizer); otherwise ``REPEAT_PROMPT`` is tokenised (no special tokens)
with ``AutoTokenizer.from_pretrained(model.config.name_or_path)``, as kvpress's
``KVzipPress`` loads its tokenizer, and a ``ValueError`` says to pass
``reconstruct_prompt_ids`` where that tokenizer does not load. Batch size 1 only (a
``ValueError`` otherwise); one forward per block (a second, e.g. ``model.generate``'s
decoding steps inside the block, is refused: ask the question after the block).

Where kvpress imports, ``PageEntroKVPress`` subclasses ``kvpress.BasePress`` and uses its
forward hook and (for the window scorer) its context manager unchanged, so
``isinstance(press, BasePress)`` holds and kvpress's wrappers that take any BasePress
(``ComposedPress``) accept it. Where kvpress is missing (pagekv's own environment), the
same class rests on ``HookProtocol``, pagekv's rendering of that hook protocol for
transformers 5 (the cache arrives as ``cache`` or ``past_key_values``), so the logic,
``compress`` and ``with press(model):`` still run. ``KVPRESS_BASE`` says which one this
process got. kvpress is imported when this module is, never by ``import pagekv``.
"""

from __future__ import annotations

import logging
import math
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from pagekv.maths.config import SCORERS, EvictionConfig
from pagekv.maths.paging import BudgetError
from pagekv.maths.plan import Plan, plan
from pagekv.maths.policies import POOLED_POLICIES, get_policy
from pagekv.runtime.backend import BACKENDS, compact_layers, pooler, score_window
from pagekv.runtime.prefill import attention_modules, attention_scale, window_queries
from pagekv.runtime.reconstruct import CHUNK as RECONSTRUCT_CHUNK
from pagekv.runtime.reconstruct import (
    REPEAT_PROMPT,
    as_profiles,
    reconstruction_masses,
    reconstruction_scores,
)

log = logging.getLogger(__name__)


def kvpress_kept(n: int, compression_ratio: float) -> int:
    """Tokens kvpress keeps per layer and KV head out of ``n``
    (``kvpress.utils.compute_n_kept``, 0.5.5): ``max(1, int(n * (1 - ratio)))``."""
    if compression_ratio >= 1.0:
        return 0
    return max(1, int(n * (1 - compression_ratio)))


class HookProtocol:
    """kvpress's press protocol, for a process where kvpress does not import.

    A forward hook on every attention module (``model.model.layers[i].self_attn``) runs
    after the layer's attention; during the prefill (the layer's cache holds exactly the
    tokens of this forward) it replaces the layer's cached keys and values with what
    ``compress`` returns. ``with press(model):`` registers the hooks and removes them on
    exit, like ``kvpress.BasePress.__call__``.
    """

    def post_init_from_model(self, model) -> None:
        """Called once per ``with press(model):`` before the hooks are registered."""

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        raise NotImplementedError

    def forward_hook(self, module, args, kwargs, output):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        cache = kwargs.get("past_key_values", kwargs.get("cache"))
        if hidden is None or cache is None:
            return output
        layer = cache.layers[module.layer_idx]
        if layer.keys is None or layer.keys.shape[-2] != hidden.shape[1]:
            return output  # a decoding step, or a later chunk: only the prefill is pressed
        if "position_embeddings" not in kwargs and len(args) > 1:
            kwargs = dict(kwargs, position_embeddings=args[1])
        attn = output[1] if isinstance(output, (tuple, list)) and len(output) > 1 else None
        keys, values = self.compress(module, hidden, layer.keys, layer.values, attn, kwargs)
        layer.keys, layer.values = keys, values
        return output

    @contextmanager
    def __call__(self, model):
        self.post_init_from_model(model)
        handles = [
            m.register_forward_hook(self.forward_hook, with_kwargs=True)
            for m in attention_modules(model)
        ]
        try:
            yield
        finally:
            for h in handles:
                h.remove()


def _press_base() -> type:
    """``kvpress.BasePress`` when kvpress imports, else ``HookProtocol``."""
    try:
        from kvpress import BasePress
    except ImportError:
        return HookProtocol
    except Exception as e:  # installed but broken (e.g. a transformers it does not support)
        log.warning("kvpress is installed but does not import (%s); using HookProtocol", e)
        return HookProtocol
    return BasePress


_Base = _press_base()
#: True when `PageEntroKVPress` is a `kvpress.BasePress` in this process.
KVPRESS_BASE = _Base is not HookProtocol


@dataclass
class PageEntroKVPress(_Base):
    """Entropy-weighted, page-level eviction per (layer, KV head), as a kvpress press.

    Use it like any kvpress press::

        press = PageEntroKVPress(budget=0.2, page_size=16)
        with press(model):
            model.model(input_ids=context_ids, past_key_values=cache)
        pipe(context, question=question, press=press)   # or kvpress's pipeline

    Fields (pagekv's `EvictionConfig` names, see docs/kvpress.md):
        budget: fraction of the context KEPT per (layer, KV head), in (0, 1].
        compression_ratio: kvpress's fraction REMOVED, in [0, 1). Give one of the two.
        policy: a pooled policy of `pagekv.maths.policies`: "entropy" (Page-EntroKV),
            "entropy_nosink", "mean", "max"; or "streaming" (sinks + recent pages) and
            "full" (no eviction). "head_independent" is refused: its KV heads keep
            different counts, which a dense kvpress cache cannot hold.
        page_size: tokens per page (1 = token-level eviction).
        n_sink: the first tokens, always kept and left out of the head weights.
        window: the last `window` context tokens score the rest and are always kept.
        tau: temperature of the head-weight softmax.
        backend: "auto" (Triton kernels on CUDA when they import), "torch" or "triton".
        record: keep each layer's `Plan` in `plans` (for tests and inspection).
        strict: raise `pagekv.BudgetError` when the protected pages (sinks and window)
            alone exceed the budget. Off by default, so that a kvpress pipeline never
            aborts (kvpress's own press tests run every press at ratio 0.8 on short
            prompts): such a layer keeps exactly its protected pages, and the press logs
            one warning naming the smallest feasible budget. `pagekv.plan` and the runner
            always raise.
        scorer: "window" (the last `window` tokens' queries, in a hook per layer during
            the prefill) or "reconstruct" (the model's attention while it repeats the
            prefilled sequence, after the prefill, when the `with press(model):` block
            exits; batch size 1). See the module docstring.
        reconstruct_prompt_ids: the ids of the instruction read before the
            reconstruction (`pagekv.runtime.reconstruct.REPEAT_PROMPT` tokenised without
            special tokens); None: tokenised with the model's own tokenizer
            (`AutoTokenizer.from_pretrained(model.config.name_or_path)`). "reconstruct" only.
        reconstruct_chunk: reconstruction queries per forward of the reconstruction pass.
    """

    budget: float | None = None
    compression_ratio: float | None = None
    policy: str = "entropy"
    page_size: int = 16
    n_sink: int = 4
    window: int = 32
    tau: float = 1.0
    backend: str = "auto"
    record: bool = False
    strict: bool = False
    scorer: str = "window"
    reconstruct_prompt_ids: list[int] | tuple[int, ...] | None = None
    reconstruct_chunk: int = RECONSTRUCT_CHUNK
    plans: dict[int, Plan] = field(default_factory=dict, init=False, repr=False, compare=False)
    _warned: bool = field(default=False, init=False, repr=False, compare=False)
    #: `REPEAT_PROMPT`'s ids per `model.config.name_or_path` (tokenised once).
    _prompt_ids_of: dict[str, list[int]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        self.check()

    # ---------------------------------------------------------------- settings

    def check(self) -> None:
        """Raise ValueError, naming the field, for any setting pagekv cannot run."""
        if self.budget is not None and self.compression_ratio is not None:
            raise ValueError(
                "give budget (fraction kept) or compression_ratio (fraction removed), not "
                f"both; got budget={self.budget!r}, compression_ratio={self.compression_ratio!r}"
            )
        if self.budget is not None and not (_number(self.budget) and 0 < self.budget <= 1):
            raise ValueError(f"budget must be a number in (0, 1]; got {self.budget!r}")
        ratio = self.compression_ratio
        if ratio is not None and not (_number(ratio) and 0 <= ratio < 1):
            raise ValueError(f"compression_ratio must be a number in [0, 1); got {ratio!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {self.backend!r}")
        if self.scorer not in SCORERS:
            raise ValueError(f"scorer must be one of {', '.join(SCORERS)}; got {self.scorer!r}")
        chunk = self.reconstruct_chunk
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"reconstruct_chunk must be an integer >= 1; got {chunk!r}")
        ids = self.reconstruct_prompt_ids
        if ids is not None and (
            not isinstance(ids, (list, tuple))
            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)
        ):
            raise ValueError(
                "reconstruct_prompt_ids must be None or a list of token ids (integers >= 0); "
                f"got {ids!r}"
            )
        cfg = self._config(1.0)  # validates policy, page_size, n_sink, window, tau
        if not cfg.pooled:
            raise ValueError(
                f"policy {self.policy!r} keeps a different number of tokens per KV head, which "
                f"a dense kvpress cache cannot hold; use one of {', '.join(POOLED_POLICIES)}"
            )

    def _config(self, budget: float) -> EvictionConfig:
        shared = ("policy", "page_size", "n_sink", "window", "tau", "scorer")
        return EvictionConfig(budget=budget, **{f: getattr(self, f) for f in shared})

    @property
    def compresses(self) -> bool:
        """False when nothing is evicted (no budget given, a ratio of 0, or `full`)."""
        if get_policy(self.policy).keeps_all:
            return False
        return self.budget is not None or bool(self.compression_ratio)

    def budget_tokens(self, n: int) -> int:
        """``k``, the most tokens each (layer, KV head) keeps of ``n``: see the module's Budget
        (for ``compression_ratio``, kvpress's own count: a press at that ratio keeps as many)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be a positive integer; got {n!r}")
        if not self.compresses:
            return n
        if self.budget is not None:
            return self._config(self.budget).budget_tokens(n)
        return kvpress_kept(n, float(self.compression_ratio))

    def eviction_config(self, n: int) -> EvictionConfig:
        """The `EvictionConfig` that makes `plan` keep at most `budget_tokens(n)` tokens.

        With ``compression_ratio`` the fraction is ``k / n``, nudged by an ulp where float
        rounding would make ``floor`` land on ``k - 1``.
        """
        if self.budget is not None:
            return self._config(self.budget)
        k = self.budget_tokens(n)
        beta = k / n
        for _ in range(8):
            cfg = self._config(min(beta, 1.0))
            got = cfg.budget_tokens(n)
            if got == k:
                return cfg
            beta = math.nextafter(beta, 2.0 if got < k else 0.0)
        raise AssertionError(f"no budget fraction keeps exactly {k} of {n}")  # unreachable

    # ---------------------------------------------------------------- kvpress hooks

    def post_init_from_model(self, model) -> None:
        attention_modules(model)  # a clear ValueError for an architecture we cannot read
        self.plans = {}
        self._warned = False  # one warning per use of the press on a model

    @contextmanager
    def __call__(self, model):
        """``with press(model):``: the prefill run inside the block is compressed, layer by
        layer by kvpress's hook protocol unchanged, or (reconstruct) when the block exits."""
        if self.scorer == "reconstruct":
            with self._reconstructing(model):
                yield
        else:
            with super().__call__(model):
                yield

    @torch.no_grad()
    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        """Keep the planned pages of this layer: keys, values ``[B, G, n, d] -> [B, G, k', d]``.

        Runs without autograd (eviction is not differentiated); a budget below the
        protected pages is handled as `strict` says (`_plan`; its BudgetError is a
        ValueError). ``scorer="window"`` only: the reconstruction scorer needs the whole
        prefill first, so a caller that presses layer by layer (``ComposedPress``) gets a
        ValueError.
        """
        self.check()  # kvpress's evaluation sets compression_ratio after construction
        if self.scorer == "reconstruct":
            raise ValueError(
                "scorer='reconstruct' scores after the prefill, when `with press(model):` "
                "exits; it cannot press one layer at a time (compress(), ComposedPress): "
                "use scorer='window' there"
            )
        if not self.compresses:
            return keys, values
        B, G, n, _ = keys.shape  # [B, G, n, d]
        cfg = self.eviction_config(n)
        w = min(cfg.window, n, hidden_states.shape[1])
        pe = kwargs.get("position_embeddings") if isinstance(kwargs, dict) else None
        if pe is None:
            raise ValueError(
                "the attention layer got no position_embeddings; PageEntroKVPress needs the "
                "rotary tables to recompute the window's queries (Llama / Qwen2 / Mistral / "
                "Qwen3 style models)"
            )
        cos, sin = pe
        q_win = window_queries(module, hidden_states[:, -w:], cos[:, -w:], sin[:, -w:])
        # [B, H, n] profiles and their per-head masses, as the runner scores its cache
        # (pagekv.runtime.prefill.Prefill.scores): the batch sits on plan's layer axis.
        profiles, masses, used = score_window(
            q_win, keys, cfg.n_sink, scale=attention_scale(module), backend=self.backend
        )
        p = self._plan(profiles, G, cfg, masses, used)
        kept = p.kept_indices().to(keys.device)  # [B, G, k']
        # Each batch row as a layer of its own: its own kept set, one launch for all.
        rows = list(keys.split(1)), list(values.split(1)), list(kept.unbind(0))
        pairs, _ = compact_layers(*rows, backend=used)
        if self.record:
            self.plans[getattr(module, "layer_idx", len(self.plans))] = p
        return tuple(torch.cat(parts).contiguous() for parts in zip(*pairs, strict=True))

    def _plan(self, profiles, n_groups: int, cfg: EvictionConfig, masses, backend: str) -> Plan:
        """`plan`, or, when the protected pages alone exceed the budget, the plan that
        keeps exactly them (one warning per use of the press) unless `strict`."""
        pool = pooler(backend)
        try:
            return plan(profiles, n_groups=n_groups, config=cfg, masses=masses, pool_pages=pool)
        except BudgetError as e:
            if self.strict:
                raise
            if not self._warned:
                self._warned = True
                log.warning("PageEntroKVPress keeps only the protected pages: %s", e)
            n = int(profiles.shape[-1])
            cfg = cfg.replace(budget=min(1.0, e.protected_tokens / n))
            return plan(profiles, n_groups=n_groups, config=cfg, masses=masses, pool_pages=pool)

    # ---------------------------------------------------------------- scorer="reconstruct"

    @contextmanager
    def _reconstructing(self, model):
        """Capture the block's one prefill (its ids and cache) by wrapping
        ``model.model.forward``; on a normal exit, score it by reconstruction and compact
        the cache in place (`compress_by_reconstruction`)."""
        self.check()
        self.post_init_from_model(model)
        if not self.compresses:  # nothing evicted: no capture, no reconstruction pass
            yield
            return
        prompt_ids = self.instruction_ids(model)  # before the prefill: fail fast
        inner = getattr(model, "model", None)
        if inner is None or not callable(getattr(inner, "forward", None)):
            raise ValueError(
                f"{type(model).__name__} has no `model.model`; scorer='reconstruct' needs a "
                "causal LM (Llama / Qwen2 / Mistral / Qwen3 style)"
            )
        captured: dict = {}
        original = inner.forward
        had_own = "forward" in vars(inner)

        def forward(*args, **kwargs):
            if captured:
                raise ValueError(
                    "scorer='reconstruct' compresses the one prefill run inside `with "
                    "press(model):` when the block exits; run only the context's prefill in "
                    "the block (one forward; decoding or the question comes after it)"
                )
            ids = kwargs.get("input_ids", args[0] if args else None)
            if not isinstance(ids, torch.Tensor):
                raise ValueError(
                    "scorer='reconstruct' needs the prefill's input_ids (it reads them again); "
                    "got none (inputs_embeds?)"
                )
            if ids.dim() != 2 or ids.shape[0] != 1:
                raise ValueError(
                    "scorer='reconstruct' runs on one sequence (batch size 1); got input_ids "
                    f"of shape {tuple(ids.shape)}"
                )
            given = kwargs.get("past_key_values", kwargs.get("cache"))
            if given is not None and given.get_seq_length() != 0:
                raise ValueError(
                    "scorer='reconstruct' needs an empty cache before the prefill: the whole "
                    f"prefilled sequence is the context; the cache holds {given.get_seq_length()}"
                )
            out = original(*args, **kwargs)
            cache = _output_cache(out)
            captured["cache"] = given if cache is None else cache
            captured["ids"] = [int(t) for t in ids[0].tolist()]
            return out

        inner.forward = forward
        try:
            yield
        finally:
            if had_own:
                inner.forward = original
            else:
                del inner.forward
        if captured:
            if captured["cache"] is None:
                raise ValueError(
                    "the prefill kept no cache (use_cache=False?): nothing to compress"
                )
            self.compress_by_reconstruction(model, captured["cache"], captured["ids"], prompt_ids)

    def instruction_ids(self, model) -> list[int]:
        """The ids read before the reconstruction (the field `reconstruct_prompt_ids`
        says which); a ValueError where the model's tokenizer does not load."""
        if self.reconstruct_prompt_ids is not None:
            return [int(t) for t in self.reconstruct_prompt_ids]
        name = str(getattr(getattr(model, "config", None), "name_or_path", "") or "")
        if name not in self._prompt_ids_of:
            how = (
                "pass PageEntroKVPress(..., reconstruct_prompt_ids=tokenizer.encode("
                "pagekv.runtime.reconstruct.REPEAT_PROMPT, add_special_tokens=False)) "
                "(or [] for no instruction)"
            )
            if not name:
                raise ValueError(
                    "scorer='reconstruct' reads an instruction before repeating the context, "
                    f"and the model has no config.name_or_path to load its tokenizer from: {how}"
                )
            try:
                from transformers import AutoTokenizer

                tok = AutoTokenizer.from_pretrained(name)
            except Exception as e:  # offline hub, a model built from a config, ...
                raise ValueError(
                    f"scorer='reconstruct' could not load the tokenizer of {name!r} to "
                    f"tokenise its instruction ({type(e).__name__}: {e}); {how}"
                ) from e
            self._prompt_ids_of[name] = list(tok.encode(REPEAT_PROMPT, add_special_tokens=False))
        return list(self._prompt_ids_of[name])

    @torch.no_grad()
    def compress_by_reconstruction(self, model, cache, context_ids, prompt_ids) -> None:
        """Score the prefilled `cache` (it holds exactly `context_ids`) by reconstruction
        and compact every layer in place to its planned pages.

        The pass reads `cache` and writes its own keys and values into a copy
        (`reconstruction_scores`), so `cache` holds the prefill alone until it is
        compacted. Each layer is planned as the runner plans a reconstruct
        configuration (``Runner.plan``: profiles ``as_profiles(scores["max"])``,
        ``reconstruction_masses``); every layer is planned before any is compacted, so a
        strict BudgetError leaves the cache whole.
        """
        n = len(context_ids)
        layers = list(cache.layers)
        if n < 1:
            raise ValueError("the prefill was empty: nothing to reconstruct")
        for i, la in enumerate(layers):
            if getattr(la, "is_sliding", False):
                raise ValueError(
                    f"layer {i} of the cache is a sliding-window layer; scorer='reconstruct' "
                    "needs full-attention layers"
                )
            held = None if getattr(la, "keys", None) is None else int(la.keys.shape[-2])
            if held != n:
                raise ValueError(
                    f"layer {i} of the cache holds {held} tokens, the prefill {n}; "
                    "scorer='reconstruct' needs a plain DynamicCache (not quantized or static)"
                )
        scores = reconstruction_scores(  # on a copy of the cache: `cache` stays as it is
            model, cache, list(context_ids), list(prompt_ids), chunk=self.reconstruct_chunk
        )
        profiles = as_profiles(scores["max"])  # [L, H, n], rows sum to 1
        cfg = self.eviction_config(n)
        plans = []
        for i, la in enumerate(layers):
            prof = profiles[i : i + 1]  # [1, H, n]: one layer on plan's layer axis
            masses = reconstruction_masses(
                {k: v[i : i + 1] for k, v in scores.items() if k.startswith("focus")},
                prof,
                cfg.n_sink,
            )
            plans.append(self._plan(prof, int(la.keys.shape[1]), cfg, masses, self.backend))
        for i, (la, p) in enumerate(zip(layers, plans, strict=True)):
            kept = p.kept_indices()[0].to(la.keys.device)  # [G, k']
            [(keys, values)], _ = compact_layers([la.keys], [la.values], [kept], self.backend)
            la.keys, la.values = keys.contiguous(), values.contiguous()
            if self.record:
                self.plans[i] = p


@dataclass
class MeanPoolPagePress(PageEntroKVPress):
    """`PageEntroKVPress` with mean pooling (every head of a group weighs ``1/r``): the
    side-by-side baseline, same pages and budget accounting, only the pooling differs."""

    policy: str = "mean"


def _output_cache(out):
    """The cache a model forward returned (``cache`` in transformers >= 5.24, whose
    ``past_key_values`` alias warns; ``past_key_values`` before), or None."""
    for name in ("cache", "past_key_values"):
        cache = getattr(out, name, None)
        if cache is not None and hasattr(cache, "layers"):
            return cache
    return None


def _number(v) -> bool:
    """An int or float, not a bool (NaN fails every range check it is put to)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)
