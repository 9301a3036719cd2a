"""Shared generators of random attention profiles for the property tests."""

import torch
from hypothesis import strategies as st


def random_profiles(seed: int, L: int, H: int, n: int, sharpness: float = 6.0) -> torch.Tensor:
    """Peaky random distributions `[L, H, n]`: a mix of heads from diffuse to one-hot."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(L, H, n, generator=g, dtype=torch.float64)
    power = 1 + sharpness * torch.rand(L, H, 1, generator=g, dtype=torch.float64)
    p = x**power
    # Some heads put extra mass on the first tokens (sink-like heads).
    sink = (torch.rand(L, H, 1, generator=g) < 0.3).double() * 5 * p.sum(-1, keepdim=True)
    p[..., :1] += sink[..., 0:1]
    return (p / p.sum(-1, keepdim=True)).float()


@st.composite
def geometry(draw, r_values=(1, 2, 3, 4, 6, 8), max_n=160):
    """(seed, L, G, r, n, P, n_sink, window) with n not a multiple of P when P > 1."""
    seed = draw(st.integers(0, 2**31 - 1))
    L = draw(st.integers(1, 3))
    G = draw(st.integers(1, 3))
    r = draw(st.sampled_from(r_values))
    P = draw(st.integers(1, 64))
    n = draw(st.integers(2, max_n))
    if P > 1 and n % P == 0:
        n += 1
    n_sink = draw(st.integers(0, 6))
    window = draw(st.integers(1, 40))
    return seed, L, G, r, n, P, n_sink, window
