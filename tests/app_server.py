"""Launch the Gradio app in this process on a free local port, for the app and browser tests
(in-process, so tests can read server-side state such as `handlers.MODELS`)."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # app.py lives at the repository root, outside any package
    sys.path.insert(0, str(ROOT))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def launched_app(cold: bool = False):
    """Yield `(demo, url)` of a launched app, closed on exit; `cold` forgets every loaded model and
    its memos first, as a fresh `python app.py`."""
    import app
    from pagekv.app.handlers import MODELS

    if cold:
        with MODELS.lock:
            MODELS.studies.clear()
    demo = app.build_demo()
    demo.queue(default_concurrency_limit=1)
    _, url, _ = demo.launch(
        prevent_thread_lock=True,
        server_name="127.0.0.1",
        server_port=free_port(),
        show_error=False,
        quiet=True,
        **app.launch_assets(),
    )
    try:
        yield demo, url.rstrip("/")
    finally:
        demo.close()


def answer_rows(table_html) -> list[list[str]]:
    """The answers table's body rows as cell texts (the app sends it as HTML)."""
    from html.parser import HTMLParser

    rows: list[list[str]] = []

    class Rows(HTMLParser):
        cell = None
        in_body = False

        def handle_starttag(self, tag, attrs):
            if tag == "tbody":
                self.in_body = True
            elif tag == "tr" and self.in_body:
                rows.append([])
            elif tag == "td" and self.in_body:
                self.cell = []

        def handle_endtag(self, tag):
            if tag == "td" and self.cell is not None:
                rows[-1].append("".join(self.cell).strip())
                self.cell = None

        def handle_data(self, data):
            if self.cell is not None:
                self.cell.append(data)

    Rows().feed(table_html or "")
    return rows


def answer_headers(table_html) -> list[str]:
    """The answers table's column titles."""
    import re

    return re.findall(r"<th[^>]*>([^<]*)</th>", table_html or "")
