"""The views: what a person sees. Comparisons of two configurations, every figure,
presets, lessons, and the app's handlers, input checks and view memo (each testable
without Gradio; `app.py` only lays out the page and wires them).

Imports every layer below it (the maths, the runtime, serving, tasks); plotly in
`figures`; gradio only in `app_ui` (updates and errors for the page).
"""
