"""Triton kernels of the eviction step, each tested against its torch twin in `pagekv`.

- `pagekv.kernels.score`: attention profiles, sink mass and collision masses (two passes).
- `pagekv.kernels.pool_pages`: head pooling, page scores and protected pages.
- `pagekv.kernels.compact`: dense compaction of every layer of a cache in one launch.
- `pagekv.kernels.paged_decode`: one new token's attention over a paged cache.

Importing a submodule imports Triton; `pagekv.runtime.backend` does so lazily. On CPU the
kernels run in the Triton interpreter, which needs `TRITON_INTERPRET=1` in the
environment before a kernel module is first imported.
"""
