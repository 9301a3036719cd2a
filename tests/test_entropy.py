"""The fast head-weight maths (`isolated_collision_mass`, `entropy_head_weights`) against the plain
reference functions (`isolate_sinks`, `collision_entropy`), on random profiles and on the
degenerate heads `SINK_EPS` guards: all mass on the sinks, `n <= n_sink`, `n_sink = 0`."""

import math

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from pagekv.maths.entropy import (
    SINK_EPS,
    collision_entropy,
    collision_mass,
    entropy_head_weights,
    isolate_sinks,
    isolated_collision_mass,
    row_focus_sums,
    sink_mass,
)
from tests.strategies import random_profiles

SETTINGS = settings(max_examples=150, deadline=None)


@st.composite
def profiles_with_degenerate_heads(draw):
    """`(profiles [L, H, n] float32, n_groups, n_sink)`; some heads put all their mass
    on the sinks (exactly, or all but ~1e-9 of it), and `n` may be `<= n_sink`."""
    seed = draw(st.integers(0, 2**31 - 1))
    L = draw(st.integers(1, 2))
    G = draw(st.integers(1, 3))
    r = draw(st.sampled_from([1, 2, 3, 4, 6]))
    n = draw(st.integers(1, 90))
    n_sink = draw(st.integers(0, 8))
    prof = random_profiles(seed, L, G * r, n).double()
    kinds = draw(
        st.lists(
            st.sampled_from(["random", "all_on_sinks", "almost_all_on_sinks"]),
            min_size=L * G * r,
            max_size=L * G * r,
        )
    )
    s = min(n_sink, n)
    if 0 < s < n:
        flat = prof.view(L * G * r, n)
        for i, kind in enumerate(kinds):
            if kind == "random":
                continue
            rest = 0.0 if kind == "all_on_sinks" else 1e-9
            flat[i, s:] *= rest / float(flat[i, s:].sum())
            flat[i, :s] *= (1.0 - rest) / float(flat[i, :s].sum())
            event(kind)
    if n <= n_sink:
        event("n <= n_sink")
    if n_sink == 0:
        event("n_sink = 0")
    return prof.float(), G, n_sink


def degenerate(prof: torch.Tensor, n_sink: int) -> torch.Tensor:
    """Bool `[L, H]`: heads whose non-sink mass is below `SINK_EPS` (the guarded ones)."""
    if n_sink <= 0 or prof.shape[-1] <= n_sink:
        return torch.zeros(prof.shape[:2], dtype=torch.bool)
    return prof[..., n_sink:].float().sum(-1) < SINK_EPS


@SETTINGS
@given(case=profiles_with_degenerate_heads())
def test_isolated_collision_mass_equals_the_reference(case):
    prof, _, n_sink = case
    n = prof.shape[-1]
    got = isolated_collision_mass(prof, n_sink)
    ref = collision_mass(isolate_sinks(prof, n_sink))
    assert got.shape == ref.shape == prof.shape[:2]
    torch.testing.assert_close(got, ref, rtol=2e-5, atol=0, msg="isolated collision mass")
    deg = degenerate(prof, n_sink)
    if bool(deg.any()):
        event("a guarded head")
        # The guarded heads are uniform over the non-sink tokens: mass 1 / (n - n_sink).
        assert torch.equal(got[deg], torch.full_like(got[deg], 1.0 / (n - n_sink)))
    if n_sink <= 0 or n <= n_sink:  # nothing to isolate
        torch.testing.assert_close(got, collision_mass(prof), rtol=0, atol=0)


@SETTINGS
@given(case=profiles_with_degenerate_heads())
def test_isolate_sinks_is_the_definition(case):
    """The reference itself, against float64 arithmetic written out here."""
    prof, _, n_sink = case
    n = prof.shape[-1]
    iso = isolate_sinks(prof, n_sink)
    torch.testing.assert_close(iso.double().sum(-1), torch.ones(prof.shape[:2]).double(),
                               rtol=0, atol=1e-5)  # fmt: skip
    if n_sink <= 0 or n <= n_sink:
        assert torch.equal(iso, prof.float())
        return
    assert bool((iso[..., :n_sink] == 0).all()), "sinks are zeroed"
    p = prof.double()
    rest = p[..., n_sink:]
    want = rest / rest.sum(-1, keepdim=True)  # a(t) / (1 - m), t >= n_sink
    deg = degenerate(prof, n_sink)
    want[deg] = 1.0 / (n - n_sink)
    torch.testing.assert_close(iso[..., n_sink:].double(), want, rtol=1e-5, atol=1e-7)
    # 1 - m_h, the design's divisor, agrees with the non-sink mass on usable heads.
    one_minus_m = 1.0 - sink_mass(prof, n_sink).double()
    ok = ~deg & (one_minus_m > 1e-3)
    torch.testing.assert_close(rest.sum(-1)[ok], one_minus_m[ok], rtol=1e-4, atol=1e-6)


@SETTINGS
@given(
    case=profiles_with_degenerate_heads(),
    tau=st.sampled_from([0.25, 0.5, 1.0, 2.0, 4.0]),
    isolate=st.booleans(),
)
def test_head_weights_equal_softmax_of_reference_entropies(case, tau, isolate):
    """`w_h = softmax_{h in g}(-H2(h) / tau)` with `H2 = collision_entropy(isolate_sinks(a))`
    (or of `a` itself without isolation), computed in float64 from the references."""
    prof, G, n_sink = case
    L, H, _ = prof.shape
    got = entropy_head_weights(prof, G, n_sink, tau=tau, isolate=isolate)
    src = isolate_sinks(prof, n_sink) if isolate else prof
    h2 = collision_entropy(src).double()  # [L, H]
    ref = torch.softmax(-h2.view(L, G, H // G) / tau, dim=-1).view(L, H)
    torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-6, msg="head weights")
    torch.testing.assert_close(got.double().view(L, G, -1).sum(-1), torch.ones(L, G).double(),
                               rtol=0, atol=1e-5)  # fmt: skip
    if tau == 1.0:  # proportional to the collision masses ||a~_h||^2
        m = collision_mass(src).double().view(L, G, -1)
        prop = (m / m.sum(-1, keepdim=True)).view(L, H)
        torch.testing.assert_close(got.double(), prop, rtol=1e-4, atol=1e-6)


@SETTINGS
@given(case=profiles_with_degenerate_heads())
def test_pure_sink_heads_get_the_smallest_weight_of_their_group(case):
    """The guard's purpose: a head with all its mass on the sinks counts as the most
    diffuse head possible (uniform over the non-sink tokens), never as a focused one."""
    prof, G, n_sink = case
    L, H, _ = prof.shape
    deg = degenerate(prof, n_sink).view(L, G, -1)
    w = entropy_head_weights(prof, G, n_sink).view(L, G, -1)
    if bool(deg.any()):
        event("group with a guarded head")
    for li in range(L):
        for g in range(G):
            for h in deg[li, g].nonzero().flatten().tolist():
                assert float(w[li, g, h]) <= float(w[li, g].min()) * (1 + 1e-5), (li, g, h)


def test_collision_entropy_worked_values():
    """0 for a one-hot head, log n for a uniform one, log 2 for two equal peaks."""
    n = 10
    p = torch.zeros(1, 3, n)
    p[0, 0, 3] = 1.0
    p[0, 1] = 1.0 / n
    p[0, 2, [1, 7]] = 0.5
    h2 = collision_entropy(p)
    torch.testing.assert_close(h2, torch.tensor([[0.0, math.log(n), math.log(2)]]))


@pytest.mark.parametrize(
    "n, n_sink", [(12, 4), (5, 4), (4, 4), (3, 4), (12, 0)], ids=lambda v: str(v)
)
def test_all_mass_on_sinks_worked_example(n, n_sink):
    """A head with every bit of its mass on the sinks, beside a one-hot non-sink head."""
    p = torch.zeros(1, 2, n)
    p[0, 0, 0] = 1.0  # all on sink token 0 (on a plain token when n_sink = 0)
    p[0, 1, n - 1] = 1.0  # one-hot on the last token
    iso = isolate_sinks(p, n_sink)
    mass = isolated_collision_mass(p, n_sink)
    if n_sink == 0 or n <= n_sink:  # nothing to isolate: the plain profile
        assert torch.equal(iso, p)
        assert mass.tolist() == [[1.0, 1.0]]
        return
    rest = n - n_sink
    assert torch.equal(iso[0, 0], torch.cat([torch.zeros(n_sink), torch.full((rest,), 1 / rest)]))
    assert mass[0, 0].item() == pytest.approx(1.0 / rest, rel=1e-6)
    assert mass[0, 1].item() == 1.0
    w = entropy_head_weights(p, 1, n_sink)
    # w proportional to the masses: (1/rest, 1) -> (1/(1+rest), rest/(1+rest)).
    assert w[0].tolist() == pytest.approx([1 / (1 + rest), rest / (1 + rest)], rel=1e-5)


@st.composite
def attention_rows(draw):
    """Rows of attention over N keys (softmax of random logits, some rows spiked or
    all on the first keys), a context length n_ctx <= N and a largest sink count."""
    R = draw(st.integers(1, 5))
    N = draw(st.integers(1, 24))
    n_ctx = draw(st.integers(1, N))
    max_sink = draw(st.integers(0, 30))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, R, N, generator=g) * draw(st.sampled_from([0.1, 1.0, 8.0]))
    if draw(st.booleans()):  # one row all on its first key (a pure sink row)
        logits[0, 0] = -1e4
        logits[0, 0, 0] = 0.0
    return torch.softmax(logits, -1), n_ctx, max_sink


@SETTINGS
@given(case=attention_rows())
def test_row_focus_sums_equal_isolate_sinks_row_by_row(case):
    """For every sink count the sums equal the plain definitions row by row."""
    probs, n_ctx, max_sink = case
    masses, sinks = row_focus_sums(probs, n_ctx, max_sink)
    assert masses.shape == sinks.shape == (2, max_sink + 1)
    b = probs[..., :n_ctx].double()
    b = b / b.sum(-1, keepdim=True)
    for s in range(max_sink + 1):
        iso = isolate_sinks(b, s).double()
        torch.testing.assert_close(
            masses[..., s].double(), (iso * iso).sum(-1).sum(-1), atol=1e-5, rtol=1e-4
        )
        torch.testing.assert_close(
            sinks[..., s].double(), b[..., : min(s, n_ctx)].sum(-1).sum(-1), atol=1e-5, rtol=1e-4
        )


@SETTINGS
@given(case=attention_rows())
def test_row_focus_sums_reads_the_rows_and_never_writes_them(case):
    """The reconstruction pass reads its rows after the focus too (nothing may square
    them in place), and the same rows give the very same sums twice."""
    probs, n_ctx, max_sink = case
    rows = probs.clone()
    first = row_focus_sums(rows, n_ctx, max_sink)
    assert torch.equal(rows, probs)
    again = row_focus_sums(rows, n_ctx, max_sink)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))


def test_row_focus_sums_worked_values():
    """Worked rows: one-hot, uniform over 8 (1/(8 - s)), and s >= n_ctx."""
    N, n_ctx = 10, 8
    onehot = torch.zeros(N)
    onehot[5] = 1.0
    uniform = torch.cat([torch.full((n_ctx,), 0.1), torch.full((2,), 0.1)])
    sinks_only = torch.zeros(N)
    sinks_only[:2] = 0.5
    rows = torch.stack([onehot, uniform, sinks_only])
    for r, want in [
        (0, [1.0, 1.0, 1.0, 1.0]),
        (1, [1 / 8, 1 / 7, 1 / 6, 1 / 5]),
        (2, [0.5, 1.0, 1 / 6, 1 / 5]),
    ]:
        masses, _ = row_focus_sums(rows[r : r + 1], n_ctx, 3)
        torch.testing.assert_close(masses, torch.tensor(want), msg=str(r))
    masses, sinks = row_focus_sums(rows[1:2], n_ctx, 12)  # s = 8..12: nothing left
    torch.testing.assert_close(masses[8:], torch.full((5,), 1 / 8))
    torch.testing.assert_close(sinks[8:], torch.ones(5))
    torch.testing.assert_close(sinks[:3], torch.tensor([0.0, 1 / 8, 2 / 8]))
    # Two rows sum.
    masses, _ = row_focus_sums(rows[:2], n_ctx, 0)
    torch.testing.assert_close(masses, torch.tensor([1.0 + 1 / 8]))
    with pytest.raises(ValueError, match="n_ctx"):
        row_focus_sums(rows, 11, 2)
    with pytest.raises(ValueError, match="max_sink"):
        row_focus_sums(rows, 4, -1)
