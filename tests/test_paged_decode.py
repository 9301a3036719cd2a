"""The paged-decode kernel (kernels/paged_decode.py) against its torch twin and SDPA on the dense
cache, on awkward sizes: partial and single pages, uneven groups, one token, pages of 1 to 64,
lists not starting at block 0, split ranges. Interpreted on the CPU, compiled on CUDA."""

from __future__ import annotations

import pytest
import torch

from pagekv.kernels.paged_decode import merge_splits, paged_decode
from pagekv.runtime.paged_cache import PagedCache
from tests.test_kernels import assert_close

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def paged_case(B, G, r, d, P, lengths, dtype, device, seed=0):
    """Random queries, a pool with the (row, group) lists shuffled through it (block
    ids not in order), and the dense `[B, G, len, d]` caches they hold."""
    gen = torch.Generator().manual_seed(seed)
    pages = [[-(-n // P) for n in row] for row in lengths]
    total = sum(map(sum, pages))
    order = torch.randperm(total + 3, generator=gen)[:total]  # 3 blocks no list uses
    k_pool = torch.randn(total + 3, P, d, generator=gen)
    v_pool = torch.randn(total + 3, P, d, generator=gen)
    max_pages = max(map(max, pages))
    table = torch.full((B, G, max_pages), -1, dtype=torch.int32)
    dense, i = [], 0
    for b in range(B):
        for g in range(G):
            ids = order[i : i + pages[b][g]]
            i += pages[b][g]
            table[b, g, : len(ids)] = ids.to(torch.int32)
            n = lengths[b][g]
            dense.append((k_pool[ids].reshape(-1, d)[:n], v_pool[ids].reshape(-1, d)[:n]))
    q = torch.randn(B, G * r, d, generator=gen) * 2
    lens = torch.tensor(lengths, dtype=torch.int32)
    cast = dict(device=device, dtype=dtype)
    return (q.to(**cast), k_pool.to(**cast), v_pool.to(**cast), table.to(device),
            lens.to(device), dense)  # fmt: skip


def torch_twin(q, dense, G, P, dtype):
    """The torch path of `PagedCache.attend` (what the torch backend's decode runs) over
    the same (row, group) tokens, in pages of `P`: `[B, H, d]`."""
    B, _, d = q.shape
    keys = [[dense[b * G + g][0].to(dtype) for g in range(G)] for b in range(B)]
    values = [[dense[b * G + g][1].to(dtype) for g in range(G)] for b in range(B)]
    cache = PagedCache([(keys, values)], extra=0, page_size=P)
    return cache.attend(0, q[:, :, None], d**-0.5)[:, :, 0]


def sdpa_reference(q, dense, G, dtype):
    """SDPA over each (row, group)'s dense cache, in float64 and in `dtype`."""
    B, H, d = q.shape
    r = H // G
    out = {torch.float64: torch.empty(B, H, d, dtype=torch.float64),
           dtype: torch.empty(B, H, d, dtype=torch.float32)}  # fmt: skip
    for b in range(B):
        for g in range(G):
            k, v = dense[b * G + g]
            qg = q[b, g * r : (g + 1) * r].cpu()
            for dt in out:
                o = torch.nn.functional.scaled_dot_product_attention(
                    qg.to(dt)[None], k.to(dt)[None], v.to(dt)[None]
                )[0]
                out[dt][b, g * r : (g + 1) * r] = o.to(out[dt].dtype)
    return out[torch.float64], out[dtype]


CASES = [
    # (B, G, r, d, P, lengths [B][G])
    (1, 2, 3, 64, 16, [[37, 80]]),  # groups of different lengths, a partial last page
    (1, 1, 6, 128, 64, [[1]]),  # one token in a single page
    (2, 2, 4, 32, 4, [[9, 64], [130, 3]]),  # two rows, small pages, tiles span pages
    (1, 3, 1, 16, 1, [[5, 17, 200]]),  # pages of one token, r = 1
    (1, 2, 7, 64, 8, [[300, 299]]),  # the second model's r = 7, several tiles
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "case", CASES, ids=[f"B{c[0]}-G{c[1]}-r{c[2]}-d{c[3]}-P{c[4]}" for c in CASES]
)
def test_paged_decode_matches_twin_and_sdpa(device, case, dtype):
    B, G, r, d, P, lengths = case
    q, k_pool, v_pool, table, lens, dense = paged_case(B, G, r, d, P, lengths, dtype, device)
    got = paged_decode(q, k_pool, v_pool, table, lens)
    ref, low = sdpa_reference(q, dense, G, dtype)
    floor = 1e-5 if dtype == torch.float32 else 2e-3
    assert got.dtype == dtype and got.shape == q.shape
    assert_close("paged decode vs SDPA (float64)", got.float(), ref, low, floor=floor)
    twin = torch_twin(q.cpu(), dense, G, k_pool.shape[1], dtype)
    assert twin.dtype == dtype and twin.shape == q.shape
    assert_close("twin vs SDPA (float64)", twin.float(), ref, low, floor=floor)


@pytest.mark.parametrize("splits", [1, 2, 3, 50])
def test_split_token_ranges_merge_to_the_same_output(device, splits):
    """A cache cut into token ranges per (row, group), empty ones included (a range past
    a short group's length), merges to the one-range output."""
    q, k_pool, v_pool, table, lens, dense = paged_case(
        1, 2, 4, 32, 16, [[20, 500]], torch.float32, device, seed=3
    )
    one = paged_decode(q, k_pool, v_pool, table, lens, splits=1)
    got = paged_decode(q, k_pool, v_pool, table, lens, splits=splits)
    assert_close("split ranges", got, one, floor=2e-6)
    ref, _ = sdpa_reference(q, dense, 2, torch.float32)
    assert_close("one range vs SDPA", one, ref, floor=1e-5)


def test_merge_splits_by_hand():
    """Two splits of one row: maxima 0 and 1 (base 2), sums 1 and 2, values 2 and 4:
    (2 * 2^-1 + 4) / (1 * 2^-1 + 2) = 5 / 2.5 = 2. An empty split (l = 0) is ignored."""
    m = torch.tensor([[[0.0], [1.0], [-1e30]]])
    l = torch.tensor([[[1.0], [2.0], [0.0]]])  # noqa: E741
    acc = torch.tensor([[[[2.0]], [[4.0]], [[0.0]]]])
    assert merge_splits(m, l, acc).item() == pytest.approx(2.0)


def test_paged_decode_rejects_bad_input(device):
    q, k_pool, v_pool, table, lens, _ = paged_case(1, 2, 2, 16, 4, [[5, 6]], torch.float32, device)
    with pytest.raises(ValueError, match="multiple of KV groups"):
        paged_decode(q[:, :3], k_pool, v_pool, table, lens)
    with pytest.raises(ValueError, match="dtype"):
        paged_decode(q.half(), k_pool, v_pool, table, lens)
    with pytest.raises(ValueError, match="block_table"):
        paged_decode(q, k_pool, v_pool, table, lens[:, :1])
