"""The app's own parts, which the library never imports and the wheel does not hold.

The engine, without gradio or plotly: `worker` (the one model worker; its invariant is
in docs/design.md, "One model worker"), `memo` (byte-bounded LRU), `model_registry`
(models by name), `sessions` (a session's runs one at a time), `allocator` (glibc
housekeeping of a server), `study` (`Study`: a model, its prefills, plans and finished
runs, the app's three caches, and the tasks), `side` (`Side`: one side's
`EvictionConfig` and question position) and `comparison` (two sides planned and decoded
on one prompt).

What a person sees: `figures/` (every figure; plotly only there), `run_figures` (a
comparison's views, kept in its study's memos), `answers`, `lessons` (their words in
lessons.md), `lesson_checks`, `presets`, `share` (links), the run's inputs
(`run_inputs`: the controls, their ranges and `parse_run`), and the page's handlers
`handlers` and `lesson_handlers` (gradio only there). `app.py` lays out the page and
wires them.
"""
