"""The live backend: prefill a prompt once, then evict and decode under many configurations.

docs/design.md, "The data path": one prefill captures the cache and the observation window's
queries (`pagekv.runtime.prefill`); every `EvictionConfig` then plans
(`pagekv.maths.plan`), gathers the kept tokens of the cache straight into the paged decode
cache (`pagekv.runtime.paged_cache`: the one copy of K and V a run makes; the prefill's
cache is left as it is) and decodes greedily, without a new prefill::

    runner = Runner(model, tokenizer)
    pre = runner.prefill(input_ids, window_max=128)
    res = runner.evaluate(pre, EvictionConfig(policy="entropy", budget=0.2))
    res.answer, res.stored_tokens, res.timings  # a pagekv.runtime.result.RunResult

Positions and modes (docs/design.md, the end of "The data path"): the decode continues
at position `n`, not `k'`; "inside", the first answer token is the prefill's argmax;
"after", the question is prefilled into the decode cache at `n..n+q-1` in one step.

The decode cache. Every plan decodes from a `PagedCache`
(`pagekv.runtime.paged_cache`): each (layer, group)'s kept tokens in blocks of a pool,
with room for the question and the answer, each (layer, group) attending exactly its
own tokens, whatever their number. Head-independent plans are not dense (each group
keeps a union of its own size); the runner stores every group's union padded up to
the layer's largest union with that group's next-best pages (by `Plan.page_scores`,
ties toward the lower page), and the decode attends to the padding too:
`union_tokens` reports the real unions, `stored_tokens` what is stored,
`padding_tokens` the difference. A global plan (`allocation="global"`) stores exactly
the pages it allocated to each group (`Evicted.allocated`), without padding.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from pagekv.maths.config import EvictionConfig
from pagekv.maths.entropy import HeadMasses
from pagekv.maths.metrics import needle_retention
from pagekv.maths.paging import (
    expand_pages,
    kept_token_indices,
    page_sizes,
    protected_pages,
    select_pages_padded,
)
from pagekv.maths.plan import Plan, plan
from pagekv.maths.policies import get_policy
from pagekv.runtime.backend import pooler, resolve_backend
from pagekv.runtime.decode import GraphBuckets, LeanDecoder, greedy, resolve_decode
from pagekv.runtime.paged_cache import PagedCache
from pagekv.runtime.prefill import (
    Prefill,
    WindowQueryCapture,
    as_id_list,
    cache_kwarg,
    forward,
    synced_now,
)
from pagekv.runtime.reconstruct import CHUNK as RECONSTRUCT_CHUNK
from pagekv.runtime.reconstruct import (
    REPEAT_PROMPT,
    as_profiles,
    reconstruction_masses,
    reconstruction_scores,
)
from pagekv.runtime.result import RunResult
from pagekv.runtime.serve import PoolRun, serve

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- results


@dataclass
class Evicted:
    """What a plan keeps of a prefill's cache: the kept tokens' indices, which the decode
    gathers straight into its paged cache (`Runner.decode_cache`) to decode from
    position `n`."""

    plan: Plan
    backends: dict  # step -> "triton" / "torch" ("none": the step did not run), "device"
    #: Per layer sorted token indices `[G, k_l]` int64 (None: full): group g stores the
    #: first `stored_tokens[l][g]` of its row.
    kept_indices: list[torch.Tensor] | None
    stored_tokens: list  # [L][G] what the decode cache stores
    union_tokens: list  # [L][G] the policy's kept sets (Plan.union_tokens)
    ragged: bool  # layers or groups hold different lengths (head_independent, global)
    kept_bytes: int  # the bytes of the stored tokens' keys and values
    score_s: float | None  # profiles and masses (memoised: ~0 after the first time)
    #: Plan, indices and the gather into the decode cache (None for `full`: nothing is
    #: evicted; its copy into the decode cache counts in the decode).
    evict_s: float | None
    #: A global plan: each group stores exactly the tokens allocated to it.
    allocated: bool = False
    #: The bytes of the paged cache the decode read (`PagedCache.row_nbytes`); None
    #: before a decode.
    decode_bytes: int | None = None
    #: Whether the decode's one-token steps were replayed from a CUDA graph.
    graphed: bool = False


# --------------------------------------------------------------------------- runner


#: Greedy steps a CUDA decode runs between host reads of its tokens: a read waits for
#: the device to finish, so reading every token would stall the queue once per token.
DECODE_CHUNK = 8


class Runner:
    """Prefill once, evaluate many eviction configurations (see the module docstring).

    Args:
        model: a transformers causal LM of the Llama / Qwen2 / Mistral / Qwen3 family
            (`model.model.layers[i].self_attn.q_proj`), in eval mode.
        tokenizer: decodes answers; `None` (tests) makes the answer the token ids
            joined by spaces.
        backend: "auto" (Triton on CUDA when the kernels import, else torch), "torch"
            or "triton", resolved by `pagekv.runtime.backend.resolve_backend` (a BackendError
            where Triton cannot run). Scoring and compaction dispatch through
            `pagekv.runtime.backend`; the choice is logged and reported in every result.
        decode_dtype: the linear weights of the decode step (`pagekv.runtime.decode`,
            `resolve_decode`): "auto" (the default: float16 for a float32 model on the
            CPU, the model's own dtype elsewhere), "float32" (the prefill's numerics on
            a float32 model), "float16" or "bfloat16". A ValueError for a model the
            step cannot run.
    """

    def __init__(self, model, tokenizer=None, backend: str = "auto", decode_dtype="auto"):
        self.model = model
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.backend = resolve_backend(backend, self.device)  # "torch" or "triton"
        log.info("pagekv runner: %s backend on %s", self.backend, self.device)
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else None
        self.text_config = cfg if cfg is not None else model.config
        self._cache_kw = cache_kwarg(model)
        self.eos_ids = set(eos_token_ids(model, tokenizer))
        #: The decode step's weight dtype, and the label each result carries.
        self.decode_weights, self.decode_path = resolve_decode(decode_dtype, model)
        self._lean: LeanDecoder | None = None  # built on the first decode
        self._graphs: GraphBuckets | None = None  # the CUDA graphs, one per capacity bucket
        #: Greedy steps between host reads of the tokens (`pagekv.runtime.decode.greedy`):
        #: 1 on the CPU, where a read waits on nothing; `DECODE_CHUNK` on CUDA.
        self.decode_chunk = 1 if self.device.type == "cpu" else DECODE_CHUNK
        #: Replay the one-token step from a CUDA graph (`pagekv.runtime.decode`):
        #: on CUDA with the Triton backend, whose paged-decode kernel reads the tables.
        self.cuda_graphs = self.device.type == "cuda" and self.backend == "triton"
        log.info("pagekv runner: decode with %s", self.decode_path)

    def warm_up(self) -> float:
        """Run one tiny prefill, eviction and decode step, so that the first real run's
        timings are warm (first calls pay one-off costs: kernel compilation on CUDA,
        allocator and dispatch set-up on the CPU). Returns the seconds it took."""
        t0 = time.perf_counter()
        pre = self.prefill([0] * 48, window_max=8)
        cfg = EvictionConfig(policy="entropy", budget=0.5, page_size=4, n_sink=4, window=8)
        self.evaluate(pre, cfg, max_new_tokens=2, stop_at_eos=False)
        return time.perf_counter() - t0

    # ---------------------------------------------------------------- prefill

    def prefill(self, input_ids, window_max: int = 128, question_ids=None) -> Prefill:
        """Run the prompt once, keep its cache and its last `window_max` queries.

        Args:
            input_ids: list[int] or LongTensor `[n]` (or `[1, n]`): the whole prompt, or
                the context only when `question_ids` is given.
            window_max: how many window queries to capture per layer; every later
                `config.window` must be `<= window_max` (or cover the whole prompt).
            question_ids: question-after mode: the question's ids, prefilled after
                compaction at positions `n..`.
        """
        ids = as_id_list(input_ids, "input_ids")
        q_ids = None if question_ids is None else as_id_list(question_ids, "question_ids")
        if isinstance(window_max, bool) or not isinstance(window_max, int) or window_max < 1:
            raise ValueError(f"window_max must be an integer >= 1; got {window_max!r}")
        n = len(ids)
        self._check_length(n + len(q_ids or ()))
        cache = _new_cache()
        cap = WindowQueryCapture(self.model, window_max)
        with torch.inference_mode(), cap:
            t0 = synced_now(self.device)
            out = forward(self.model, ids, 0, cache, self._cache_kw, self.device)
            prefill_s = synced_now(self.device) - t0
        q_win = cap.stacked()  # [L, H, w', d]
        scales = cap.scales
        return Prefill(
            ids=ids,
            n=n,
            cache=cache,
            q_win=q_win,
            first_logits=out.logits[0, -1].float(),
            question_ids=q_ids,
            timings={"prefill_s": prefill_s},
            n_layers=len(cache.layers),
            n_heads=int(q_win.shape[1]),
            n_groups=int(cache.layers[0].keys.shape[1]),
            head_dim=int(q_win.shape[3]),
            scale=scales[0],
            scales=scales,
            backend=self.backend,
        )

    # ---------------------------------------------------------------- evict

    def plan(self, pre: Prefill, config: EvictionConfig) -> Plan:
        """Score `pre` (memoised per window and n_sink) and plan under `config`: the
        `Plan` that `evict` compacts, with the scoring backend in `backends["score"]`
        and `timings` `{score_s, plan_s}`. Raises BudgetError (a ValueError naming the
        smallest feasible budget) when the protected pages alone exceed the budget."""
        if not isinstance(config, EvictionConfig):
            raise TypeError(f"config must be an EvictionConfig; got {type(config).__name__}")
        t0 = synced_now(self.device)
        scales = None
        if config.scorer == "reconstruct":
            profiles, masses, scored_on = self.reconstruction_scores(pre, config.n_sink)
            scales = self.reconstruction(pre)["max"].sum(-1)  # [L, H] the raw attention
        else:
            profiles, masses, scored_on = pre.scores(config.window, config.n_sink)  # memoised
        t1 = synced_now(self.device)
        pool = pooler(self.backend)
        p = plan(profiles, pre.n_groups, config, masses=masses, scales=scales, pool_pages=pool)
        return scored(p, scored_on, t1 - t0, synced_now(self.device) - t1)

    def reconstruction(self, pre: Prefill, chunk: int = RECONSTRUCT_CHUNK) -> dict:
        """The reconstruction pass's scores on `pre` (`pagekv.runtime.reconstruct`):
        `{"max": [L, H, n], "mean": [L, H, n]}`, not normalised. Runs once per prompt
        and is memoised on `pre`; its seconds go in `pre.timings["reconstruct_s"]`.
        The pass copies the prefill's cache into one of its own, so `pre.cache` stays
        as it was (tests/test_reconstruct.py)."""
        if pre.reconstruction is None:
            t0 = synced_now(self.device)
            tok = self.tokenizer
            prompt = [] if tok is None else tok.encode(REPEAT_PROMPT, add_special_tokens=False)
            pre.reconstruction = reconstruction_scores(
                self.model,
                pre.cache,
                pre.ids,
                prompt,
                chunk=chunk,
                cache_kw=self._cache_kw,
                backend=self.backend,
            )
            pre.timings["reconstruct_s"] = synced_now(self.device) - t0
        return pre.reconstruction

    def reconstruction_scores(
        self, pre: Prefill, n_sink: int
    ) -> tuple[torch.Tensor, HeadMasses, str]:
        """Profiles `[L, H, n]` of the reconstruction pass (its "max" aggregation) and
        the head masses for `n_sink` sinks (the reconstruction queries' focus,
        `reconstruction_masses`), memoised on `pre` like `Prefill.scores`."""
        key = ("reconstruct", int(n_sink))
        if key not in pre._scores:
            cached = next(
                (v for (kind, _), v in pre._scores.items() if kind == "reconstruct"), None
            )
            scores = self.reconstruction(pre)
            prof = as_profiles(scores["max"]) if cached is None else cached[0]
            pre._scores[key] = (prof, reconstruction_masses(scores, prof, n_sink), self.backend)
        return pre._scores[key]

    def evict(self, pre: Prefill, config: EvictionConfig, planned: Plan | None = None) -> Evicted:
        """What `config`'s plan keeps of `pre.cache` (the kept tokens' indices; the
        decode gathers them): `planned` when given (from `Runner.plan` on the same
        prefill and configuration: each run is planned once), else planned here (a
        BudgetError as in `Runner.plan`)."""
        if planned is None:
            planned = self.plan(pre, config)
        elif planned.config != config or planned.n != pre.n or "score" not in planned.backends:
            raise ValueError(
                "planned was not made by Runner.plan for this configuration and prompt"
            )
        p = planned
        t1 = synced_now(self.device)
        # The plan's counts, read once (`Plan.union_counts`): dense, k' and the padding
        # targets come from this one host wait, whatever the number of layers.
        union = p.union_counts()
        keeps_all = get_policy(config.policy).keeps_all
        allocated = p.allocated
        if keeps_all:
            kept_idx = None
        elif allocated:
            # Each group's own allocation, its rows padded past their counts with the
            # last token (never read: a group gathers its first `stored` indices).
            widths = [max(row) for row in union]
            idx = kept_token_indices(p.keep, max(widths)).clamp_(max=p.n - 1)
            kept_idx = [idx[layer, :, :w] for layer, w in enumerate(widths)]
        else:
            kept_idx = list(p.kept_indices().unbind(0)) if p.dense else padded_kept_indices(p)
        stored = [[pre.n] * pre.n_groups for _ in union] if keeps_all else p.stored_counts()
        ragged = len({t for row in stored for t in row}) > 1
        t2 = synced_now(self.device)
        return Evicted(
            plan=p,
            backends={
                **{k: v for k, v in p.backends.items() if k != "device"},
                "compact": "none",  # the gather's, once it ran (`decode_cache`)
                "device": str(self.device),
            },
            kept_indices=kept_idx,
            stored_tokens=stored,
            union_tokens=union,
            ragged=ragged,
            allocated=allocated,
            kept_bytes=pre.token_bytes * sum(map(sum, stored)),
            score_s=None if keeps_all else p.timings["score_s"],
            evict_s=None if keeps_all else p.timings["plan_s"] + (t2 - t1),
        )

    # ---------------------------------------------------------------- evaluate

    def evaluate(
        self,
        pre: Prefill,
        config: EvictionConfig,
        max_new_tokens: int = 24,
        needle_positions=None,
        stop_at_eos: bool = True,
        return_logits: bool = False,
        planned: Plan | None = None,
    ) -> RunResult:
        """Evict under `config` (the prefill's cache is left as it is) and decode greedily.

        Args:
            pre: from `prefill`; left untouched.
            config: the eviction configuration.
            max_new_tokens: at most this many answer tokens (an EOS token, when
                generated, is included in `tokens` and ends the answer).
            needle_positions: prompt token indices of the needle's answer; fills
                `needle_retention` and `needle_kept_all`.
            stop_at_eos: stop at the tokenizer's or generation config's EOS ids.
            return_logits: keep every step's float32 logits in `RunResult.logits`.
            planned: `self.plan(pre, config)`, when the caller planned already.
        """
        self._check_decode(pre, max_new_tokens)
        ev = self.evict(pre, config, planned)
        return self._decoded(
            pre, config, ev, max_new_tokens, stop_at_eos, return_logits, needle_positions
        )

    def _decoded(self, pre, config, ev, max_new_tokens, stop_at_eos, keep_logits, needle_positions):
        """`ev` decoded on its own (timed) and its `RunResult`."""
        with torch.inference_mode():
            cache, t0 = self._gather(pre, [ev], max_new_tokens)
            tokens, logits, stop = self._decode(
                pre, ev, max_new_tokens, stop_at_eos, keep_logits, cache=cache
            )
            decode_s = synced_now(self.device) - t0
        return self._result(pre, config, ev, tokens, logits, stop, decode_s, needle_positions)

    def evaluate_pair(
        self,
        pre: Prefill,
        config_a: EvictionConfig,
        config_b: EvictionConfig,
        max_new_tokens: int = 24,
        needle_positions=None,
        stop_at_eos: bool = True,
        on_token=None,
        planned: tuple[Plan | None, Plan | None] = (None, None),
    ) -> tuple[RunResult, RunResult]:
        """Two configurations on one prefill, decoded in ONE batched pass (batch of 2)
        when their compacted caches have the same shape in every layer (pooled policies
        at one budget and page size), else one after the other.

        Each row decodes exactly as `evaluate` would (greedy, positions from `n`), both
        rows' kept tokens gathered into one decode cache; a row
        that reaches EOS keeps being fed its last token, and what follows is ignored.
        `on_token(tokens_a, tokens_b)` is called after every step with the tokens so far
        (for streaming). `timings["decode_batch"]` says 2 when the pass was shared
        (its `decode_s` is then the shared pass's time).
        """
        self._check_decode(pre, max_new_tokens)
        ev_a, ev_b = self.evict(pre, config_a, planned[0]), self.evict(pre, config_b, planned[1])
        same = not (ev_a.allocated or ev_b.allocated)
        same = same and ev_a.stored_tokens == ev_b.stored_tokens
        if not same or max_new_tokens == 0:
            out = [
                self._decoded(pre, cfg, ev, max_new_tokens, stop_at_eos, False, needle_positions)
                for cfg, ev in ((config_a, ev_a), (config_b, ev_b))
            ]
            if on_token is not None:
                on_token(out[0].tokens, out[1].tokens)
            return out[0], out[1]
        with torch.inference_mode():
            cache, t0 = self._gather(pre, [ev_a, ev_b], max_new_tokens)
            (tok_a, tok_b), _, (stop_a, stop_b) = self._decode(
                pre, ev_a, max_new_tokens, stop_at_eos, pair=ev_b, on_token=on_token, cache=cache
            )
            decode_s = synced_now(self.device) - t0
        res_a = self._result(pre, config_a, ev_a, tok_a, None, stop_a, decode_s, needle_positions)
        res_b = self._result(pre, config_b, ev_b, tok_b, None, stop_b, decode_s, needle_positions)
        res_a.timings["decode_batch"] = res_b.timings["decode_batch"] = 2
        return res_a, res_b

    def _result(self, pre, config, ev, tokens, logits, stop, decode_s, needle_positions):
        """The `RunResult` of a decode on `ev`."""
        p = ev.plan
        uor = p.uor.to(torch.float64)
        stored, union = ev.stored_tokens, ev.union_tokens
        res = RunResult(
            answer=self._detok(tokens),
            tokens=tokens,
            policy=config.policy,
            config=config.to_dict(),
            mode=pre.mode,
            prompt_tokens=pre.n + len(pre.question_ids or ()),
            context_tokens=pre.n,
            budget_tokens=int(p.budget_tokens),
            union_tokens=union,
            stored_tokens=stored,
            padding_tokens=[
                [s - u for s, u in zip(sr, ur, strict=True)]
                for sr, ur in zip(stored, union, strict=True)
            ],
            head_tokens=None if p.overlap is None else int(p.overlap.per_head_tokens),
            uor={"mean": float(uor.mean()), "max": float(uor.max())},
            uor_per_group=uor.tolist(),
            backend=self.backend,
            backends={
                **ev.backends,
                "decode": self.decode_path + (", CUDA graph" if ev.graphed else ""),
            },
            device=str(self.device),
            timings={
                "prefill_s": float(pre.timings.get("prefill_s", 0.0)),
                **(
                    {"reconstruct_s": float(pre.timings["reconstruct_s"])}
                    if config.scorer == "reconstruct" and "reconstruct_s" in pre.timings
                    else {}
                ),
                "score_s": ev.score_s,
                "evict_s": ev.evict_s,
                "decode_s": decode_s,
                "decode_batch": 1,
            },
            cache_bytes_before=_cache_bytes(pre.cache),
            cache_bytes_after=int(ev.kept_bytes),
            cache_bytes_decode=ev.decode_bytes,
            first_token_from_full_prefill=pre.mode == "inside" and bool(tokens),
            stop_reason=stop,
            plan=p,
            logits=logits,
        )
        if needle_positions is not None:
            res.needle_positions = [int(t) for t in needle_positions]
            # bool [L, G, n]: what the decode attends to (a global plan's padding is masked)
            stored_keep = p.keep if ev.allocated else _stored_keep(p, ev.kept_indices)
            ret = needle_retention(stored_keep, needle_positions)
            res.needle_retention = ret.tolist()
            res.needle_kept_all = bool((ret == 1).all())
            if p.head_keep is not None:  # a per-head plan: its groups store unions
                res.needle_retention_union = p.needle_retention(needle_positions).tolist()
        return res

    # ---------------------------------------------------------------- a pool

    def serve(
        self,
        prompts,
        config: EvictionConfig,
        pool_bytes: int,
        max_new_tokens: int = 24,
        window_max: int = 128,
        stop_at_eos: bool = True,
    ) -> PoolRun:
        """Decode `prompts` together in one pool of `pool_bytes` bytes, each evicted
        under `config`: a prompt is admitted when the blocks for its kept pages and its
        answer are free, every live row is decoded in one batched step, and a row that
        finishes returns its blocks (`pagekv.runtime.serve`). Each answer is the one
        `evaluate` gives the prompt alone. Returns the `PoolRun`: the answers, the rows
        live and the blocks in use at each step, and the tokens per second.

        `prompts`: each a list of token ids, or a pair `(context_ids, question_ids)`."""
        return serve(self, prompts, config, pool_bytes, max_new_tokens, window_max, stop_at_eos)

    # ---------------------------------------------------------------- internals

    def decode_cache(self, evs: list[Evicted], pre: Prefill, max_new: int) -> PagedCache:
        """The decode cache of `evs` (one per batch row, the same `stored_tokens`): each
        (layer, row, group)'s stored tokens gathered from `pre.cache` straight into a
        `PagedCache` (`PagedCache.gathered`; its `gathered_on` the backend that ran),
        with room for the question and `max_new` answer tokens, in pages of the plan's
        size."""
        extra = len(pre.question_ids or ()) + max_new
        keys = [lay.keys for lay in pre.cache.layers]
        values = [lay.values for lay in pre.cache.layers]
        kept = []
        for layer, k in enumerate(keys):
            rows = [None if ev.kept_indices is None else ev.kept_indices[layer] for ev in evs]
            if len(rows) > 1 and any(r is not None for r in rows):  # a pair: [B, G, k]
                n, G = k.shape[2], k.shape[1]
                every = torch.arange(n, device=k.device).expand(G, n)
                rows = [torch.stack([every if r is None else r for r in rows])]
            kept.append(rows[0])
        counts = [[ev.stored_tokens[layer] for ev in evs] for layer in range(len(keys))]
        page = evs[0].plan.config.page_size
        kernel = self.backend == "triton"
        return PagedCache.gathered(keys, values, kept, counts, extra, page, kernel, self.backend)

    def _gather(self, pre, evs, max_new) -> tuple[PagedCache, float]:
        """The decode cache of `evs` (`decode_cache`), with what it took recorded in
        each: the gather's backend and seconds (in `evict_s`; a full cache's copy counts
        in the decode) and its bytes; and the time the decode's clock starts."""
        t0 = synced_now(self.device)
        cache = self.decode_cache(evs, pre, max_new)
        t1 = synced_now(self.device)
        for row, ev in enumerate(evs):
            ev.decode_bytes = cache.row_nbytes(row)
            if ev.evict_s is not None:
                ev.evict_s += t1 - t0
                ev.backends["compact"] = cache.gathered_on
        return cache, t1 if all(ev.evict_s is not None for ev in evs) else t0

    def _decode(
        self, pre, ev, max_new, stop_at_eos, keep_logits=False, pair=None, on_token=None, cache=None
    ):
        """Greedy decode of `ev` in the lean step over its decode cache (`cache`, else
        `decode_cache` builds it), with `pair` as a batch of 2 when given; positions
        continue at `n` (see the module docstring). `(tokens, logits, stop)`, each stop
        and token list per row with `pair`."""
        evs = [ev] if pair is None else [ev, pair]
        if cache is None:
            cache = self.decode_cache(evs, pre, max_new)
        graphs = self.cuda_graphs and pair is None
        if not graphs:
            step = self._lean_decoder().step
            forward = lambda ids, pos, c=cache: step(ids, pos, c)  # noqa: E731
        else:
            # The one-token steps replayed from the CUDA graph of the cache's capacity
            # bucket, whose pools hold the tokens from here on.
            if self._graphs is None:
                self._graphs = GraphBuckets(self._lean_decoder())
            forward = self._graphs.step_for(cache)
            del cache
        try:
            tokens, logits, stops = greedy(
                forward, pre, max_new, self.eos_ids if stop_at_eos else (), self.decode_chunk,
                keep_logits, len(evs), on_token,
            )  # fmt: skip
        finally:
            ev.graphed = graphs and forward.graphed
        return (tokens[0], logits, stops[0]) if pair is None else (tokens, logits, stops)

    def _lean_decoder(self) -> LeanDecoder:
        if self._lean is None:
            self._lean = LeanDecoder(self.model, self.decode_weights)
        return self._lean

    def _detok(self, tokens: list[int]) -> str:
        if self.tokenizer is None:
            return " ".join(str(t) for t in tokens)
        return self.tokenizer.decode(tokens, skip_special_tokens=True).strip()

    def _check_decode(self, pre: Prefill, max_new_tokens) -> None:
        """`max_new_tokens` an integer >= 0, and the whole sequence within the model."""
        n = max_new_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"max_new_tokens must be an integer >= 0; got {n!r}")
        self._check_length(pre.n + len(pre.question_ids or ()) + n)

    def _check_length(self, total: int) -> None:
        """Sliding-window layers index the window by cache slot, which eviction breaks;
        refuse sequences longer than the window rather than decode them wrongly."""
        cfg = self.text_config
        sw = getattr(cfg, "sliding_window", None)
        types = getattr(cfg, "layer_types", None)
        uses_sw = sw is not None and (types is None or "sliding_attention" in types)
        if uses_sw and total > sw:
            raise ValueError(
                f"{total} tokens exceed the model's sliding window of {sw}; sliding-window "
                "attention after eviction is not supported"
            )


# --------------------------------------------------------------------------- helpers


def scored(p: Plan, backend: str, score_s: float, plan_s: float) -> Plan:
    """`p` with how its prefill was scored, what `evict` reads and reports: the backend
    in `backends["score"]`, the seconds in `timings` (`Runner.plan`, or a caller that
    planned from its own profiles)."""
    p.backends = {"score": backend, **p.backends}
    p.timings = {"score_s": score_s, "plan_s": plan_s}
    return p


def padded_kept_indices(p: Plan) -> list[torch.Tensor]:
    """Dense per-layer kept indices for a plan whose groups keep different amounts.

    Per layer `l`, every group keeps its own kept pages (for head_independent, the
    union of its heads' pages) and is padded up to the layer's largest kept count with
    its next-best pages by `p.page_scores[l, g]`: the selection rule itself
    (`pagekv.maths.paging.select_pages_padded`) with the group's kept pages ranked
    first and the layer's largest count as the budget, so ties go to the lower page as
    in every selection. Only the last page can be partial and it is always protected,
    so the deficits are whole pages and the padding is exact.

    Host waits: the plan's counts (`Plan.union_counts`, read once and shared with the
    runner) and one check that every layer reached its target, for any number of
    layers (the page geometry is computed on the host). The device work is the same
    for any number of layers too: every layer is padded and indexed at once, and each
    layer's indices are a view `[G, k_l]` of one `[L, G, max k_l]` tensor.

    Example: `P = 2`, group 0 keeps pages {0, 3} (4 tokens), group 1 keeps
    {0, 1, 3} (6 tokens); group 0 gains its best remaining page, say 2, and both
    groups store 6 tokens: `[[0, 1, 4, 5, 6, 7], [0, 1, 2, 3, 6, 7]]`.

    Returns: per layer an int64 `[G, k_l]` tensor of sorted token indices.
    """
    L, G, n = p.keep.shape
    P = p.config.page_size
    counts = p.union_counts() if isinstance(p, Plan) else p.union_tokens.tolist()
    targets = [max(row) for row in counts]  # [L] host ints
    # The page geometry is host arithmetic on n and P (no read of the plan's device copy).
    sizes = page_sizes(p.n, P)
    prot = protected_pages(p.n, P, p.config.n_sink, p.window)
    page_keep = select_pages_padded(p.page_scores, p.page_keep, prot, sizes, targets)
    stored = (page_keep.to(torch.int64) * p.page_sizes).sum(-1)  # [L, G] on the device
    reached = stored == p.union_tokens.amax(-1, keepdim=True)
    if not bool(reached.all()):  # one wait for all layers
        layer = int((~reached).any(-1).to(torch.int64).argmax())
        raise AssertionError(f"cannot pad layer {layer} to exactly {targets[layer]} tokens")
    idx = kept_token_indices(expand_pages(page_keep, n, P), max(targets))  # [L, G, k_max]
    return [idx[layer, :, :t] for layer, t in enumerate(targets)]


def _stored_keep(p: Plan, kept_idx) -> torch.Tensor:
    """Bool `[L, G, n]`: the tokens the compacted cache actually stores."""
    if kept_idx is None:
        return torch.ones_like(p.keep)
    keep = torch.zeros_like(p.keep)
    for i, idx in enumerate(kept_idx):
        keep[i].scatter_(1, idx.to(keep.device), True)
    return keep


def _new_cache(layers=None):
    """A fresh DynamicCache of plain (full-attention) layers, optionally holding the given
    `(keys, values)` pairs `[1, G, k, d]`, which must be tensors no one else holds."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cache = DynamicCache()
    first, made_as = None, None
    for k, v in layers or ():
        layer = DynamicLayer()
        if made_as == (k.dtype, v.dtype, k.device):
            # The state `lazy_initialization` gives (device, flags, whatever the
            # installed transformers sets) without its two placeholder tensors, each
            # made on the host and moved to the device: 2 x 28 of them per eviction
            # step on the pilot model (tests/test_host_waits.py).
            layer.__dict__.update(first.__dict__)
        else:
            layer.lazy_initialization(k, v)
            first, made_as = layer, (k.dtype, v.dtype, k.device)
        layer.keys, layer.values = k, v  # later `update`s concatenate into new tensors
        cache.layers.append(layer)
    return cache


def _cache_bytes(cache) -> int:
    return int(sum(lay.keys.nbytes + lay.values.nbytes for lay in cache.layers))


def eos_token_ids(model, tokenizer) -> tuple[int, ...]:
    """Every id that ends a greedy decode, in order: the generation config's EOS (an
    int or a list: instruct models often end a turn with a token of their own) and
    the tokenizer's. The one definition, used by the runner and `pagekv.runtime.models`."""
    ids: list[int] = []
    gen = getattr(model, "generation_config", None)
    for src in (getattr(gen, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        for i in src if isinstance(src, (list, tuple)) else [src]:
            if i is not None and int(i) not in ids:
                ids.append(int(i))
    return tuple(ids)
