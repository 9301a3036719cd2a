"""Linear layers on a few rows, fast on the CPU: the batched decode of A and B.

Decoding A and B together feeds every linear layer two rows at a time. On the CPU,
`F.linear` on 2-4 rows takes a path about as slow as two single rows (MKL on 2 cores),
while the same product written as `W @ x^T` is a matrix product that reads the weights
once. `python benchmarks/bench_pair_decode.py` (bundled model, first preset, A and B at
10 / 20 / 30 %): two separate decodes 2.28 / 2.15 / 2.66 s, the pair with `F.linear`
1.83 / 1.76 / 2.34 s, the pair with `W @ x^T` 1.03 / 1.09 / 1.73 s, the same tokens.
Inside `small_batch_linears(model)` the model's `nn.Linear` layers compute
inputs of 2 to `MAX_ROWS` rows that way; one row, more rows, other devices and every
other layer are left exactly as they are. The two products differ only in the order
of the float sums (equal within 1e-5, `tests/test_small_batch.py`), and
`tests/test_batched_decode.py` checks that the batched decode still gives exactly the
answers of separate decodes.
"""

from __future__ import annotations

import contextlib
import types

import torch
import torch.nn.functional as F

__all__ = ["MAX_ROWS", "small_batch_linear", "small_batch_linears"]

#: Inputs of 2 to MAX_ROWS rows use `W @ x^T` (beyond, F.linear is as fast or faster).
MAX_ROWS = 4


def small_batch_linear(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, computed as `(weight @ x^T)^T` when `x` has 2 to
    `MAX_ROWS` rows (all leading dimensions together)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not 2 <= rows <= MAX_ROWS:
        return F.linear(x, weight, bias)
    y = (weight @ x.reshape(rows, x.shape[-1]).t()).t()
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], weight.shape[0])


def _forward(self, x):
    return small_batch_linear(x, self.weight, self.bias)


@contextlib.contextmanager
def small_batch_linears(model: torch.nn.Module):
    """Within the block, `model`'s `nn.Linear` layers use `small_batch_linear` (CPU
    models only; elsewhere nothing changes). The layers are restored on exit."""
    if next(model.parameters()).device.type != "cpu":
        yield
        return
    patched = []
    try:
        for m in model.modules():
            if type(m) is torch.nn.Linear and "forward" not in vars(m):
                m.forward = types.MethodType(_forward, m)
                patched.append(m)
        yield
    finally:
        for m in patched:
            del m.forward
