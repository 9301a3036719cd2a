"""The runtime: a real model under eviction. Loading models, capturing window
queries, prefill, the eviction step (backend dispatch between the torch twins and
the Triton kernels, compaction of the KV cache), decoding, and the typed result of
a run; the paged layout as a library part, and a fixed pool of it that many prompts
share (`Runner.serve`).

Imports `pagekv.maths`, torch and transformers; `kernels` only lazily, inside
`backend`'s dispatch (docs/design.md, "Layers").
"""
