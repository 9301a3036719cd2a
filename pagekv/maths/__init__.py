"""The maths of Page-EntroKV, torch only: configuration, the policies, attention
profiles, collision entropy and head weights, pooling, pages and budgets, metrics,
the plan of a run, and the constructed group of the retention bound.

Imports torch and this folder only (never transformers, gradio, plotly, `kernels`
or another layer of `pagekv`): docs/design.md, "Layers".
"""
