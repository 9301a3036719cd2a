"""`compact_layers`: a whole cache, one tensor per layer, compacted in one launch.

Against the twin (`compact_layer` per layer), bit for bit, for every dtype, with
layers that keep different counts (a padded plan), one that keeps nothing, a
non-contiguous layer and a batch of two; and the one bounds check still refuses an
index past the prompt. CPU: the Triton interpreter; CUDA: compiled.
"""

from __future__ import annotations

import pytest
import torch

from pagekv.runtime import backend as be
from pagekv.runtime.compaction import compact_layer

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
    """Each layer's `[G, k_l]` indices a view of one `[L, G, max k_l]` tensor (what
    `padded_kept_indices` passes): its rows `max k_l` apart, not `k_l`. A kernel that
    steps its index rows by `k_l` reads the wrong tokens for every shorter layer."""
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
