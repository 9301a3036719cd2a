"""The comparison engine: one model, many prompts, many eviction configurations.

- `pagekv.engine.worker`: the one model worker every computation on the model runs on;
- `pagekv.engine.memo`: `ByteLRU`, the byte-bounded memo;
- `pagekv.engine.study`: `PromptSpec`, `Prompt` and `Study` (prefill once, run many);
- `pagekv.engine.comparison`: two `Side`s on one prompt, planned, decoded and summarised.

`pagekv run` and the app both use it (docs/design.md, "Layers"); it imports the library
below it and nothing a person sees.
"""
