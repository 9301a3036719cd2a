"""Serving: one model worker that owns every computation on a model, the memos that
serve finished work without it, the models a server holds, per-session state, and
the allocator's housekeeping. `Study` is the engine the CLI, the app and the replay
share.

Imports the maths, the runtime and `pagekv.tasks`; never gradio or plotly. The
worker's invariant is written in docs/design.md, "One model worker".
"""
