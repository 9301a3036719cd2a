"""The greedy decode waits on the device once per chunk of tokens, not once per token:
decoding 8 more tokens in chunks of 4 adds 2 host reads, counted two ways as
in tests/test_host_waits.py (reads of tensors everywhere; on CUDA also the syncs that
`torch.cuda.set_sync_debug_mode` reports). A negative control reads every token."""

from __future__ import annotations

import pytest

from pagekv import EvictionConfig
from pagekv.runtime.runner import Runner
from tests.test_host_waits import CudaSyncs, HostReads
from tests.test_runner import prompt, tiny_model

CHUNK = 4


def _reads(runner, device, reads, max_new: int) -> tuple[int, int | None]:
    """Host reads (and CUDA syncs) of one greedy decode of `max_new` tokens."""
    pre = runner.prefill(prompt(60, seed=3), window_max=16, question_ids=prompt(4, seed=2))
    ev = runner.evict(pre, EvictionConfig(policy="entropy", budget=0.5, page_size=8, window=16))
    if device.type == "cuda":
        with reads, CudaSyncs() as cuda:
            runner._decode(pre, ev, max_new, False, False)
        return reads.total, cuda.total
    with reads:
        runner._decode(pre, ev, max_new, False, False)
    return reads.total, None


@pytest.mark.parametrize("chunk", [CHUNK, 1], ids=["chunks", "every-token"])
def test_decode_reads_once_per_chunk(device, monkeypatch, chunk):
    runner = Runner(tiny_model("llama").to(device), None, decode_dtype="float32")
    runner.decode_chunk = chunk
    reads = HostReads(monkeypatch).install()
    _reads(runner, device, reads, 4)  # warm-up
    (n8, s8), (n16, s16) = (_reads(runner, device, reads, m) for m in (8, 16))
    assert n16 - n8 == 8 // chunk, (n8, n16)  # chunk 1: the negative control, 8 more
    if device.type == "cuda":
        assert s16 - s8 <= 8 // chunk, (s8, s16)
