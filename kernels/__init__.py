"""Triton kernels of the eviction step, each tested against its torch twin in `pagekv`.

- `pagekv.kernels.score`: attention profiles, sink mass and collision masses (two passes).
- `pagekv.kernels.pool_pages`: head pooling, page scores and protected pages.
- `pagekv.kernels.compact`: dense compaction (one layer, stacked layers, or every layer of a
  cache in one launch) and the paged write.

Importing a submodule imports Triton; `pagekv.runtime.backend` does so lazily. On CPU the
kernels run in the Triton interpreter, which needs `TRITON_INTERPRET=1` in the
environment before a kernel module is first imported.
"""
