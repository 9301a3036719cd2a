"""Pages, protected pages and budgeted page selection (docs/design.md, "The data path").

Page `j` holds tokens `[j*P, min((j+1)*P, n))`; the last page may be partial.
Worked example, `n = 10, P = 4`: pages `[0, 1, 2]` hold tokens `[0..3]`, `[4..7]`,
`[8, 9]`; `page_sizes(10, 4) == [4, 4, 2]`. With `n_sink = 1, window = 2`, pages
0 (sink) and 2 (window) are protected: 6 tokens. A budget `k = 9` then leaves
room for no more pages (6 + 4 > 9) and the plan keeps 6 tokens; `k = 10` keeps all.
"""

from __future__ import annotations

import math

import torch


class BudgetError(ValueError):
    """The protected pages alone need more tokens than the budget allows.

    `min_budget` is the smallest budget fraction that is feasible for this prompt
    (`protected_tokens / n`), `protected_tokens` what the protected pages hold.
    """

    def __init__(self, message: str, min_budget: float, protected_tokens: int):
        super().__init__(message)
        self.min_budget = min_budget
        self.protected_tokens = protected_tokens


def num_pages(n: int, page_size: int) -> int:
    return -(-n // page_size)


def page_sizes(n: int, page_size: int, device=None) -> torch.Tensor:
    """Tokens per page, `[n_pages]` int64 (the last page may be partial)."""
    starts = torch.arange(0, n, page_size, device=device)
    return (torch.clamp(starts + page_size, max=n) - starts).to(torch.int64)


def to_device(host: torch.Tensor, device) -> torch.Tensor:
    """A small host tensor (page geometry) on `device` without a host wait: on CUDA it is
    pinned and the copy queued (a copy from pageable memory synchronises the stream);
    elsewhere a plain copy (or the tensor itself)."""
    device = torch.device(device)
    if device.type == "cuda" and host.device.type == "cpu":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def page_reduce(scores: torch.Tensor, page_size: int, reduction: str = "max") -> torch.Tensor:
    """Page scores from token scores: `[..., n]` -> `[..., n_pages]` (max or sum)."""
    n = scores.shape[-1]
    pages = num_pages(n, page_size)
    pad = pages * page_size - n
    if reduction == "max":
        x = torch.nn.functional.pad(scores, (0, pad), value=float("-inf"))
        return x.view(*scores.shape[:-1], pages, page_size).amax(-1)
    if reduction == "sum":
        x = torch.nn.functional.pad(scores, (0, pad), value=0.0)
        x = x.view(*scores.shape[:-1], pages, page_size)
        # A page's tokens added in index order, one float32 add at a time, from 0: the
        # order kernels/pool_pages.py uses, so both backends give the same bits and a
        # near-tie between pages cannot flip between them (torch's `sum` order is
        # unspecified). The padding adds 0, which changes nothing.
        acc = torch.zeros_like(x[..., 0])
        for i in range(page_size):
            acc = acc + x[..., i]
        return acc
    raise ValueError(f"page reduction must be 'max' or 'sum'; got {reduction!r}")


def protected_pages(n: int, page_size: int, n_sink: int, window: int, device=None) -> torch.Tensor:
    """Bool `[n_pages]`: pages holding a sink token (`t < n_sink`) or a window token
    (`t >= n - window`). These are always kept and count inside the budget."""
    tok = torch.zeros(n, dtype=torch.bool, device=device)
    tok[: min(n_sink, n)] = True
    tok[max(n - window, 0) :] = True
    return page_reduce(tok.float(), page_size, "max") > 0


def min_feasible_budget(n: int, page_size: int, n_sink: int, window: int) -> float:
    """The smallest budget fraction whose `floor(beta * n)` holds all protected pages."""
    prot = protected_pages(n, page_size, n_sink, window)
    return int(page_sizes(n, page_size)[prot].sum()) / n


def check_budget(sizes: torch.Tensor, protected: torch.Tensor, budget_tokens: int) -> int:
    """The protected token count; BudgetError when it exceeds `budget_tokens`."""
    n = int(sizes.sum())
    prot_tokens = int(sizes[protected].sum())
    if prot_tokens > budget_tokens:
        min_budget = prot_tokens / n
        raise BudgetError(
            f"budget of {budget_tokens} tokens is below the {prot_tokens} tokens the "
            f"protected pages (sinks and window) hold; the smallest feasible budget for "
            f"this {n}-token prompt is {math.ceil(min_budget * 1000) / 1000:.3f} "
            f"({math.ceil(min_budget * 1000) / 10:.1f}% of the prompt, {prot_tokens} tokens); "
            "raise the budget or lower n_sink, window or page size",
            min_budget=min_budget,
            protected_tokens=prot_tokens,
        )
    return prot_tokens


def select_pages(
    page_scores: torch.Tensor, protected: torch.Tensor, sizes: torch.Tensor, budget_tokens: int
) -> torch.Tensor:
    """Keep the protected pages, then the best pages while the kept count stays `<= k`.

    Args:
        page_scores: `[..., n_pages]` float, higher = keep; no NaN; on any device.
        protected: `[n_pages]` bool.
        sizes: `[n_pages]` int64 tokens per page.
        budget_tokens: `k`.

    Pass `protected` and `sizes` on the CPU (they are tiny and depend only on `n`
    and `P`): the counts selection needs are then read without waiting on the
    device, and the selection itself runs where `page_scores` lives.

    Returns:
        Bool `[..., n_pages]`. Ties break toward the lower page index (a stable
        descending sort), so the result is deterministic. Only the last page can be
        partial and it is always protected (the window covers the last token), so
        every row keeps the same number of tokens.

    Raises:
        BudgetError: when the protected pages alone hold more than `k` tokens.
    """
    sizes_h, prot_h = sizes.cpu(), protected.cpu()
    check_budget(sizes_h, prot_h, budget_tokens)
    return _select(
        page_scores, prot_h, sizes_h, to_device(prot_h, page_scores.device), budget_tokens
    )


def select_pages_padded(
    page_scores: torch.Tensor,
    page_keep: torch.Tensor,
    protected: torch.Tensor,
    sizes: torch.Tensor,
    targets: list[int],
) -> torch.Tensor:
    """Pad every row's kept pages with its next-best pages up to its layer's target.

    Row `(l, g)` keeps its pages `page_keep[l, g]` and its protected pages (ranked
    first), then its best other pages by `page_scores[l, g]` while its count stays
    `<= targets[l]`: `select_pages`' rule, with the same tie rule (the lower page). The
    runner stores a plan whose groups keep different counts this way
    (`padded_kept_indices`). Every layer at once: one stable sort of all rows, and each
    layer's target a threshold on the running count, so the device work does not grow
    with the layers and nothing waits on the device.

    Args:
        page_scores: `[L, G, n_pages]` float; page_keep: `[L, G, n_pages]` bool.
        protected, sizes: `[n_pages]`, on the CPU (host arithmetic on `n` and `P`).
        targets: `L` host ints, each `>=` its layer's largest kept count (protected
            pages included).

    Returns:
        Bool `[L, G, n_pages]`.
    """
    dev = page_scores.device
    first = page_keep | to_device(protected.cpu(), dev)
    key = page_scores.masked_fill(first, float("inf"))  # kept and protected pages first
    budget = to_device(torch.tensor(targets, dtype=torch.int64), dev).view(-1, 1, 1)
    return _keep_sorted(key, to_device(sizes.cpu(), dev), budget)


def _keep_sorted(key: torch.Tensor, sizes: torch.Tensor, budget) -> torch.Tensor:
    """Bool like `key`: the pages by a stable descending sort of `key` (ties to the lower
    index) while their running size `sizes[page]` stays `<= budget`."""
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices
    keep_sorted = torch.cumsum(sizes[order], dim=-1) <= budget
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


def _select(
    page_scores: torch.Tensor,
    prot_h: torch.Tensor,
    sizes_h: torch.Tensor,
    prot_d: torch.Tensor,
    budget_tokens: int,
) -> torch.Tensor:
    """`select_pages` with the geometry on the host (`prot_h`, `sizes_h`) and the
    protected mask already on the scores' device (`prot_d`): it queues device work and
    never waits. The caller has checked the budget (`check_budget`: `plan` once for
    every row, `select_pages` at its entry)."""
    free_sizes = sizes_h[~prot_h]
    n_free = int(free_sizes.numel())
    if n_free > 0 and bool((free_sizes == free_sizes[0]).all()):
        room = budget_tokens - int(sizes_h[prot_h].sum())
        return _select_uniform(page_scores, prot_d, int(free_sizes[0]), room, n_free=n_free)
    # General page sizes: protected first, then a stable descending sort of the scores.
    key = torch.where(prot_d, torch.full_like(page_scores, float("inf")), page_scores)
    return _keep_sorted(key, to_device(sizes_h, page_scores.device), budget_tokens)


def select_pages_global(
    page_scores: torch.Tensor,
    protected: torch.Tensor,
    sizes: torch.Tensor,
    budget_tokens: int,
    per_layer: bool = False,
) -> torch.Tensor:
    """One budget shared by every row: keep each row's protected pages, then the best
    free pages of ALL rows while the total stays `<= rows * budget_tokens`.

    The rows' scores are compared as they are, so the caller puts them on one scale:
    `pagekv.maths.plan.plan` pools them from the model's own attention probabilities
    (the window scorer's profiles, or the reconstruction scorer's raw attention through
    `plan`'s `scales`), and a (layer, group) whose pages the model attends to more keeps
    more of them. Ties break toward the lower flat index (row-major, then page), a
    stable descending sort. Rows keep different amounts; the total is the most whole
    pages that fit.

    Example: two rows of 4 one-token pages, page 0 protected, `k = 2` each (total 4):
    scores `[[9, 3, 1, 0], [9, 1, 1, 1]]`; the two free slots go to `(0, 1)` (3) and
    `(0, 2)` (1, the lowest index of a four-way tie), so row 0 keeps pages {0, 1, 2} and
    row 1 only {0}.

    With `per_layer`, the budget is shared within each index of the first dimension
    (a layer: `allocation="layer"`) instead: layer `l`'s rows keep the most whole
    pages that fit in `rows_l * k`, by the same rule. Two layers of one row each are
    then two uniform rows.

    Args:
        page_scores: `[..., n_pages]` float, higher = keep (rows: every leading index).
        protected: `[n_pages]` bool; sizes: `[n_pages]` int64; budget_tokens: `k` per row.
        per_layer: share within each index of dim 0 (`[L, G, n_pages]`: per layer).

    Returns:
        Bool `[..., n_pages]`.

    Raises:
        BudgetError: when a row's protected pages alone hold more than `k` tokens.
    """
    sizes_h, prot_h = sizes.cpu(), protected.cpu()
    check_budget(sizes_h, prot_h, budget_tokens)  # then every row's protected pages fit
    dev = page_scores.device
    return _select_global(
        page_scores, to_device(prot_h, dev), to_device(sizes_h, dev), budget_tokens, per_layer
    )


def _select_global(
    page_scores: torch.Tensor,
    prot_d: torch.Tensor,
    sizes_d: torch.Tensor,
    budget_tokens: int,
    per_layer: bool = False,
) -> torch.Tensor:
    """`select_pages_global` with the geometry already on the scores' device (`prot_d`,
    `sizes_d`): it queues device work and never waits. The caller has checked the budget
    (`plan`, or `select_pages_global` at its entry)."""
    shape = page_scores.shape
    S = shape[0] if per_layer and len(shape) > 1 else 1  # budgets shared within each
    rows = page_scores.reshape(S, -1, shape[-1]).double()  # [S, R, n_pages]
    R = rows.shape[1]
    free = (~prot_d).expand_as(rows)
    key = torch.where(free, rows, torch.full_like(rows, float("inf"))).reshape(S, -1)
    return _keep_sorted(key, sizes_d.repeat(R), R * budget_tokens).view(shape)


def _select_uniform(
    page_scores: torch.Tensor, protected: torch.Tensor, page_size: int, room: int, n_free: int
) -> torch.Tensor:
    """`select_pages` when every unprotected page holds `page_size` tokens (always the
    case: only the last page can be partial, and it is protected).

    The best `m = room // page_size` free pages without a full sort: `v`, the m-th
    largest free score (from an unsorted top-k), splits them into those above `v`
    (all kept) and those equal to `v`, of which the lowest-indexed fill the rest.
    This is the stable sort's tie rule, at the cost of a top-k and a cumsum.
    """
    m = min(room // page_size, n_free)
    shape = page_scores.shape
    if m == 0:
        return protected.expand(shape).clone()
    if m == n_free:
        return torch.ones(shape, dtype=torch.bool, device=page_scores.device)
    key = torch.where(protected, torch.full_like(page_scores, float("-inf")), page_scores)
    v = torch.topk(key, m, dim=-1, sorted=False).values.amin(-1, keepdim=True)  # [..., 1]
    above = key > v
    tied = key == v
    need = m - above.sum(-1, keepdim=True)  # >= 1: v itself is among the best m
    keep_tied = tied & (torch.cumsum(tied, dim=-1) <= need)
    return above | keep_tied | protected


def expand_pages(page_keep: torch.Tensor, n: int, page_size: int) -> torch.Tensor:
    """Page mask `[..., n_pages]` -> token mask `[..., n]`."""
    return page_keep[..., torch.arange(n, device=page_keep.device) // page_size]


def kept_token_indices(keep: torch.Tensor, k: int) -> torch.Tensor:
    """The sorted indices of the kept tokens of every row: bool `[..., n]` -> int64
    `[..., k]`, for a mask whose every row keeps exactly `k` tokens (the caller knows
    `k`; a row keeping fewer gets `n` in its missing slots).

    Without a boolean-mask index, which waits on the device for the count: the j-th
    kept token is the first `t` whose running count reaches `j + 1`, a binary search in
    the cumulative count. Example: `keep = [F, T, T, F, T]`, `k = 3`: the counts are
    `[0, 1, 2, 2, 3]`, the first reaching 1, 2 and 3 are `[1, 2, 4]`.
    """
    cum = torch.cumsum(keep, dim=-1)  # int64 [..., n]
    want = torch.arange(1, k + 1, device=keep.device).expand(*keep.shape[:-1], k)
    return torch.searchsorted(cum, want.contiguous())  # [..., k]


def pages_touched(keep: torch.Tensor, page_size: int) -> torch.Tensor:
    """How many pages of `page_size` tokens each row's kept tokens touch: bool `[..., n]`
    -> int64 `[...]`. A paged cache holds a page while any of its tokens is kept, so
    `pages_touched(keep, P) * P` is the memory a row takes in a cache of pages of `P`
    (`physical_tokens`), whatever selected the tokens.

    >>> pages_touched(torch.tensor([[1, 0, 0, 1, 1, 0, 0, 0]], dtype=torch.bool), 4)
    tensor([2])
    """
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1; got {page_size}")
    n = keep.shape[-1]
    pad = num_pages(n, page_size) * page_size - n
    padded = torch.nn.functional.pad(keep.to(torch.int8), (0, pad))
    pages = padded.view(*keep.shape[:-1], -1, page_size).amax(-1)
    return pages.to(torch.int64).sum(-1)


def physical_tokens(keep: torch.Tensor, page_size: int) -> int:
    """The tokens a paged cache of pages of `page_size` allocates for the kept tokens
    `keep` (bool `[..., n]`, e.g. `[L, G, n]` per (layer, KV head)): the pages touched,
    summed over every row, times `page_size`."""
    return int(pages_touched(keep, page_size).sum()) * page_size
