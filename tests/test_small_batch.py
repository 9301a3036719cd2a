"""`pagekv.runtime.small_batch`: linear layers on 2-4 rows as W @ x^T, inside a block only."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagekv.runtime.small_batch import MAX_ROWS, small_batch_linear, small_batch_linears
from tests.test_runner import tiny_model


@pytest.mark.parametrize("shape", [(1, 64), (2, 64), (2, 1, 64), (1, 3, 64), (4, 64), (5, 64),
                                   (2, 4, 64), (9, 64)])  # fmt: skip
@pytest.mark.parametrize("bias", [False, True])
def test_equals_f_linear(shape, bias):
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=g)
    w = torch.randn(300, 64, generator=g)
    b = torch.randn(300, generator=g) if bias else None
    got, want = small_batch_linear(x, w, b), F.linear(x, w, b)
    assert got.shape == want.shape == (*shape[:-1], 300)
    rows = x.numel() // 64
    if 2 <= rows <= MAX_ROWS:  # another order of the float sums
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # F.linear itself: bit for bit
        assert torch.equal(got, want)


def test_patches_only_inside_the_block():
    model = tiny_model("llama", layers=2)
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    assert linears and not any("forward" in vars(m) for m in linears)
    x = torch.randn(2, 1, linears[0].in_features)
    with small_batch_linears(model):
        assert all("forward" in vars(m) for m in linears)
        torch.testing.assert_close(linears[0](x), F.linear(x, linears[0].weight))
    assert not any("forward" in vars(m) for m in linears)  # restored


def test_restored_after_an_error():
    model = tiny_model("llama", layers=1)
    with pytest.raises(RuntimeError), small_batch_linears(model):
        raise RuntimeError("boom")
    assert not any("forward" in vars(m) for m in model.modules())
