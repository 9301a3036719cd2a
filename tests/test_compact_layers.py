"""`compact_layers` (a whole cache in one launch) against its twin `compact_layer`, bit for bit:
every dtype, uneven and empty layers, a non-contiguous layer, a batch of two, and the bounds
check. CPU: the Triton interpreter; CUDA: compiled."""

from __future__ import annotations

import pytest
import torch

from pagekv.runtime import backend as be
from pagekv.runtime.backend import compact_layer

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
#: (B, G, n, d, kept per layer)
SHAPES = [
    (1, 2, 37, 16, (5, 30, 12)),  # layers of different lengths
    (2, 3, 50, 24, (0, 7)),  # a layer keeping nothing, batch 2, d not 2^k
    (1, 1, 300, 8, (300, 1)),  # every token; one token
]
IDS = ["B{}-G{}-n{}-d{}-k{}".format(*s[:4], "-".join(map(str, s[4]))) for s in SHAPES]


def _cache(shape, dtype, device, seed=0):
    B, G, n, d, kept = shape
    g = torch.Generator().manual_seed(seed)
    keys = [torch.randn(B, G, n, d, generator=g).to(device, dtype) for _ in kept]
    values = [torch.randn(B, G, n, d, generator=g).to(device, dtype) for _ in kept]
    idx = [
        torch.stack([torch.randperm(n, generator=g)[:k].sort().values for _ in range(G)])
        for k in kept
    ]  # [G, k_l] sorted
    return keys, values, [i.to(device) for i in idx]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_compact_layers_matches_the_twin(device, shape, dtype):
    keys, values, idx = _cache(shape, dtype, device)
    keys[-1] = keys[-1].transpose(2, 3).contiguous().transpose(2, 3)  # other strides
    got, used = be.compact_layers(keys, values, idx, backend="triton")
    twin, used_t = be.compact_layers(keys, values, idx, backend="torch")
    assert (used, used_t) == ("triton", "torch")
    for i, ((k, v), (kt, vt)) in enumerate(zip(got, twin, strict=True)):
        want_k, want_v = compact_layer(keys[i], values[i], idx[i])
        assert torch.equal(kt, want_k) and torch.equal(vt, want_v), f"twin, layer {i}"
        assert torch.equal(k, want_k), f"keys of layer {i}"
        assert torch.equal(v, want_v), f"values of layer {i}"
        assert k.is_contiguous() and v.is_contiguous() and k.device == keys[i].device


def test_compact_layers_checks_the_bounds(device):
    keys, values, idx = _cache(SHAPES[0], torch.float32, device)
    idx[1] = idx[1].clone()
    idx[1][0, -1] = keys[0].shape[2]  # one past the prompt, in the second layer
    with pytest.raises(ValueError, match="must lie in"):
        be.compact_layers(keys, values, idx, backend="triton")


@pytest.mark.parametrize("shape", SHAPES[:2], ids=IDS[:2])
def test_compact_layers_reads_index_views(device, shape):
    """Index views of one `[L, G, max k_l]` tensor: rows `max k_l` apart, not `k_l`."""
    keys, values, idx = _cache(shape, torch.float16, device, seed=3)
    k_max = max(i.shape[1] for i in idx)
    wide = torch.full((len(idx), shape[1], k_max), shape[2], dtype=torch.int64, device=device)
    for layer, i in enumerate(idx):
        wide[layer, :, : i.shape[1]] = i
    views = [wide[layer, :, : i.shape[1]] for layer, i in enumerate(idx)]
    assert any(v.shape[1] < k_max for v in views)  # the strides differ from the counts
    got, used = be.compact_layers(keys, values, views, backend="triton")
    assert used == "triton"
    for layer, (k, v) in enumerate(got):
        want_k, want_v = compact_layer(keys[layer], values[layer], idx[layer])
        assert torch.equal(k, want_k) and torch.equal(v, want_v), f"layer {layer}"


def test_compact_layers_refuses_a_negative_index(device):
    keys, values, idx = _cache(SHAPES[0], torch.float32, device)
    idx[2] = idx[2].clone()
    idx[2][1, 0] = -1
    with pytest.raises(ValueError, match="must lie in"):
        be.compact_layers(keys, values, idx, backend="triton")


@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_layers_into_rows_matches_the_twin(device, dtype):
    """Eviction into the paged pool (pairs, uneven groups, shared indices, whole layers) writes each
    (row, group)'s tokens to its own rows and nothing else."""
    g = torch.Generator().manual_seed(7)
    L, G, n, d, R = 3, 2, 40, 24, 2
    keys = [torch.randn(1, G, n, d, generator=g).to(device, dtype) for _ in range(L)]
    values = [torch.randn(1, G, n, d, generator=g).to(device, dtype) for _ in range(L)]

    def sorted_rows(shape, k):
        return torch.randperm(n, generator=g)[:k].sort().values.expand(*shape, k).clone()

    kept = [
        torch.stack([torch.stack([sorted_rows((), 9) for _ in range(G)]) for _ in range(R)]),
        torch.stack([sorted_rows((), 12) for _ in range(G)]),  # [G, k]: every row alike
        None,  # every token
    ]
    counts = [[[9, 4], [7, 9]], [[12, 12], [12, 12]], [[n, n], [n, n]]]
    starts = [[[0, 16], [32, 48]], [[3, 20], [40, 60]], [[0, n], [2 * n, 3 * n]]]
    rows = [64, 80, 4 * n]
    out = {}
    for backend in ("triton", "torch"):
        ok = [torch.full((r, d), -7.0, dtype=dtype, device=device) for r in rows]
        ov = [torch.full((r, d), -7.0, dtype=dtype, device=device) for r in rows]
        used = be.gather_layers(keys, values, kept, ok, ov, starts, counts, backend=backend)
        assert used == backend
        out[backend] = (ok, ov)
    for layer in range(L):
        written = torch.zeros(rows[layer], dtype=torch.bool)
        for r in range(R):
            for grp in range(G):
                s, c = starts[layer][r][grp], counts[layer][r][grp]
                idx = kept[layer]
                idx = torch.arange(n) if idx is None else (idx[r] if idx.dim() == 3 else idx)[grp]
                want_k = keys[layer][0, grp, idx[:c]]
                want_v = values[layer][0, grp, idx[:c]]
                for backend, (ok, ov) in out.items():
                    assert torch.equal(ok[layer][s : s + c], want_k), f"{backend} {layer} {r} {grp}"
                    assert torch.equal(ov[layer][s : s + c], want_v), f"{backend} {layer} {r} {grp}"
                written[s : s + c] = True
        for ok, ov in out.values():  # nothing else written
            assert bool((ok[layer][~written.to(device)] == -7).all())
            assert bool((ov[layer][~written.to(device)] == -7).all())
