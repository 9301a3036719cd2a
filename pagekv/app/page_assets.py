"""What the page loads besides its layout: the stylesheet (assets/app.css), the script
(assets/app.js, with the lessons' titles it counts Next / Previous presses over), the
theme in the system's own fonts, and the first screen's drawing (assets/gqa.svg)."""

from __future__ import annotations

import json

import gradio as gr

from pagekv.app.lesson_checks import LESSON_TITLES
from pagekv.paths import ASSETS_DIR, CSS_PATH

#: The page's own script (number boxes, presenter view, share links, lesson presses).
JS_PATH = ASSETS_DIR / "app.js"
#: The first screen's drawing: a GQA group, the union of per-head picks, pooled pages.
GQA_DRAWING = ASSETS_DIR / "gqa.svg"
#: The page's fonts: the system's own. Gradio's default theme asks
#: for a web font in two weights, and bold text fell back to another face offline.
SYSTEM_FONTS = ["ui-sans-serif", "system-ui", "-apple-system", "Segoe UI", "Roboto",
                "Helvetica Neue", "Arial", "sans-serif"]  # fmt: skip
SYSTEM_MONO = ["ui-monospace", "SFMono-Regular", "Menlo", "Consolas", "monospace"]


def launch_assets() -> dict:
    """The page's stylesheet, script and theme (system fonts), as `launch` takes them."""
    css = CSS_PATH.read_text() if CSS_PATH.exists() else None
    titles = f"window.pagekvTitles = {json.dumps(list(LESSON_TITLES))};"
    head = f"<script>{titles}\n{JS_PATH.read_text()}</script>" if JS_PATH.exists() else None
    theme = gr.themes.Default(font=SYSTEM_FONTS, font_mono=SYSTEM_MONO)
    return dict(css=css, head=head, theme=theme)
