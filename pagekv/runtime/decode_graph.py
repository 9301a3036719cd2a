"""The one-token decode step as a CUDA graph.

A decode step of a 1.5B model on a GPU is some 28 x 20 kernel launches of a few
microseconds each, so launching them from Python costs more than running them. A CUDA
graph records the launches once and replays them with one call. What a replay needs:
inputs and outputs at fixed addresses, and no value read from the host that changes
from step to step. The decode step provides that with a `static` `PagedCache`
(`pagekv.runtime.paged_cache`: writes and attention through the block tables and the
device lengths, the paged-decode kernel for attention) and its position as a 0-dim
device tensor (`LeanDecoder.step`).

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
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import torch

from pagekv.runtime.messages import one_line

log = logging.getLogger(__name__)


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
