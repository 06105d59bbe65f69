"""Overload, client disconnects, SIGTERM, a dying engine loop, and how ``serve`` binds and configures."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from neuron_lmi.engine.process_front import DEFAULT_MAX_RESTARTS
from tests.server.conftest import ServerProcess, cli_command, start_server

LONG = {"inputs": "Count forever:", "parameters": {"max_new_tokens": 240, "ignore_eos": True}, "stream": True}
# Long enough that the one row stays busy while the overload requests are sent, even on a fast host.
LONGER = {**LONG, "parameters": {"max_new_tokens": 4000, "ignore_eos": True}}


@pytest.fixture(scope="module")
def small_server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One KV row and a queue of one: the third concurrent request is over capacity."""
    tmp = tmp_path_factory.mktemp("small_server")
    server = start_server(
        tiny_llama_dir,
        tmp,
        ["--max-rolling-batch-size", "1", "--n-positions", "4096"],
        env={"SERVING_JOB_QUEUE_SIZE": "1"},
        api_key=None,
    )
    yield server
    server.stop(timeout_s=60)


def _hold_stream(
    url: str, started: threading.Event, result: dict[str, object], payload: dict[str, object] = LONG
) -> None:
    with httpx.stream("POST", f"{url}/invocations", json=payload, timeout=300) as r:
        for line in r.iter_lines():
            if line:
                started.set()
                obj = json.loads(line)
                if "generated_text" in obj:
                    result["text"] = obj["generated_text"]
                    result["tokens"] = obj["token"]


def test_client_disconnect_frees_row_quickly(tiny_server: ServerProcess) -> None:
    before = tiny_server.metric("neuron_lmi_aborted_requests_total")
    with tiny_server.client() as http, http.stream("POST", "/invocations", json=LONG) as r:
        lines = r.iter_lines()
        next(lines)
        next(lines)
    assert tiny_server.wait_rows_free(timeout_s=2.0) == 0
    assert tiny_server.metric("neuron_lmi_aborted_requests_total") >= before + 1
    # Non-streamed: aborted too. Sixteen prompts on eight rows take two waves of 240 tokens, well
    # past the client's timeout even where one 240-token answer alone fits inside it (fast hosts).
    waves = {**LONG, "inputs": [LONG["inputs"]] * 16, "stream": False}
    with tiny_server.client(timeout=0.3) as http, pytest.raises(httpx.TimeoutException):
        http.post("/invocations", json=waves)
    # Not a timing assertion: an AVX2-only host (AMD Zen 3) freed these rows 3.9 s after the
    # client's timeout, past the 2 s the faster hosts were held to; a leaked row never frees.
    assert tiny_server.wait_rows_free(timeout_s=15.0) == 0
    assert tiny_server.metric("neuron_lmi_aborted_requests_total") >= before + 2


def test_overload_is_503_or_429_with_retry_after(small_server: ServerProcess) -> None:
    """With the one row busy, a two-prompt request puts one prompt in the queue and overflows it."""
    url = small_server.url
    running, result = threading.Event(), {}
    holder = threading.Thread(target=_hold_stream, args=(url, running, result, LONGER), daemon=True)
    holder.start()
    assert running.wait(30)
    sm = httpx.post(f"{url}/invocations", json={"inputs": ["a", "b"], "parameters": {"max_new_tokens": 2}})
    oa = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2, "n": 2})
    assert sm.status_code == 503 and int(sm.headers["Retry-After"]) >= 1, sm.text
    assert sm.json()["error_type"] == "overloaded" and sm.json()["code"] == 503
    assert oa.status_code == 429 and "Retry-After" in oa.headers, oa.text
    assert oa.json()["error"]["type"] == "rate_limit_exceeded"
    holder.join(300)
    assert isinstance(result.get("text"), str)  # the request already running was not disturbed
    assert small_server.wait_rows_free() == 0
    assert small_server.metric("neuron_lmi_queue_length") == 0
    ok = httpx.post(f"{url}/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 2}})
    assert ok.status_code == 200


def test_sigterm_finishes_in_flight_then_exits_zero(small_server: ServerProcess) -> None:
    started, result = threading.Event(), {}
    t = threading.Thread(target=_hold_stream, args=(small_server.url, started, result), daemon=True)
    t.start()
    assert started.wait(30)
    code = small_server.stop(timeout_s=60)
    t.join(30)
    assert code == 0, small_server.log.read_text()[-2000:]
    assert isinstance(result.get("text"), str)  # the in-flight stream ran to its end
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{small_server.url}/ping", timeout=2)


# A sitecustomize that breaks EngineCore.step in every interpreter started with it on PYTHONPATH:
# the server's and its engine process's (the CPU engine core runs in a process of its own).
CRASHING_ENGINE = """
from neuron_lmi.engine import core
original = core.EngineCore.step
def step(self):
    if self.requests:
        raise RuntimeError("injected engine failure")
    return original(self)
core.EngineCore.step = step
"""


def _crash_hook(tmp_path: Path) -> Path:
    hook = tmp_path / "crash-hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(CRASHING_ENGINE)
    return hook


def _ping_within(url: str, status: int, timeout_s: float) -> httpx.Response:
    deadline = time.monotonic() + timeout_s
    while True:
        ping = httpx.get(f"{url}/ping", timeout=5)
        if ping.status_code == status or time.monotonic() > deadline:
            return ping
        time.sleep(0.2)


@pytest.mark.parametrize("fail_fast", [False, True])
def test_dead_engine_loop_is_never_silent(tiny_llama_dir: Path, tmp_path: Path, fail_fast: bool) -> None:
    """An engine loop that dies on every request: each death fails its request with a JSON 503 and
    ``Retry-After`` and starts a new engine process, ``DEFAULT_MAX_RESTARTS`` times; then the
    engine stays dead and ``/ping`` says so. ``SERVING_FAIL_FAST`` exits 3 at the first death."""
    port_server = start_server(
        tiny_llama_dir,
        tmp_path,
        ["--max-rolling-batch-size", "2"],
        api_key=None,
        env={
            "SERVING_FAIL_FAST": "true" if fail_fast else "false",
            "PYTHONPATH": str(_crash_hook(tmp_path)),
        },
    )
    request = {"inputs": "x", "parameters": {"max_new_tokens": 4}}
    try:
        for death in range(DEFAULT_MAX_RESTARTS + 1):
            r = httpx.post(f"{port_server.url}/generate", json=request, timeout=60)
            assert r.status_code == 503 and "engine" in r.json()["error"], r.text
            if fail_fast:
                assert port_server.proc.wait(30) == 3
                return
            restarting = death < DEFAULT_MAX_RESTARTS
            assert ("Retry-After" in r.headers) == restarting, (death, dict(r.headers))
            ping = _ping_within(port_server.url, 200 if restarting else 503, 120)
            assert ping.status_code == (200 if restarting else 503), (death, ping.text)
        time.sleep(1.0)  # it stays dead: no restart left
        ping = httpx.get(f"{port_server.url}/ping", timeout=5)
        assert ping.status_code == 503 and ping.json()["status"] == "unhealthy"
        r = httpx.post(f"{port_server.url}/generate", json=request, timeout=60)
        assert r.status_code == 503 and "Retry-After" not in r.headers
        assert port_server.stop(timeout_s=30) == 0
    finally:
        if port_server.proc.poll() is None:
            port_server.proc.kill()
            port_server.proc.wait(10)


def test_a_killed_engine_process_is_replaced(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """SIGKILL (the OOM killer's) on the engine process: its request gets a JSON 503 with
    ``Retry-After``, a new engine process serves the next request, and no row is lost."""
    server = start_server(
        tiny_llama_dir, tmp_path, ["--max-rolling-batch-size", "1", "--n-positions", "4096"], api_key=None
    )
    try:
        (engine,) = _engine_children(server.proc.pid)
        result: dict[str, httpx.Response] = {}

        def post() -> None:
            payload = {"inputs": "Count forever:", "parameters": {"max_new_tokens": 4000, "ignore_eos": True}}
            result["r"] = httpx.post(f"{server.url}/generate", json=payload, timeout=120)

        poster = threading.Thread(target=post, daemon=True)
        poster.start()
        deadline = time.monotonic() + 60
        while server.metric("neuron_lmi_kv_rows_used") < 1:
            assert time.monotonic() < deadline, "the request never took its row"
            time.sleep(0.05)
        os.kill(engine, signal.SIGKILL)
        poster.join(60)
        r = result["r"]
        assert r.status_code == 503 and "engine" in r.json()["error"] and "Retry-After" in r.headers
        assert _ping_within(server.url, 200, 120).status_code == 200
        (replacement,) = _engine_children(server.proc.pid)
        assert replacement != engine
        ok = httpx.post(f"{server.url}/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 3}})
        assert ok.status_code == 200 and ok.json()["generated_text"]
        assert server.wait_rows_free() == 0
        assert server.stop(timeout_s=30) == 0
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait(10)


def test_print_config_names_sources(tiny_llama_dir: Path) -> None:
    out = subprocess.run(
        [*cli_command(), "serve", "--model", str(tiny_llama_dir), "--n-positions", "128", "--print-config"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert str(tiny_llama_dir) in out.stdout and "128" in out.stdout and "cli" in out.stdout


def test_bind_host_follows_sagemaker_mode(tmp_path: Path) -> None:
    from neuron_lmi.commands.serve import bind_host
    from neuron_lmi.config import load_config

    plain_env = {"SM_MODEL_DIR": ""}
    sm_dir = tmp_path / "model"
    sm_dir.mkdir()
    (sm_dir / "serving.properties").write_text("option.model_id=smollm2\n")
    sm_env = {"SM_MODEL_DIR": str(sm_dir)}
    assert (
        bind_host(
            load_config({"model_id": "smollm2"}, None, {"SM_MODEL_DIR": str(tmp_path / "x")}), plain_env
        )
        == "127.0.0.1"
    )
    assert bind_host(load_config({}, None, sm_env), sm_env) == "0.0.0.0"
    assert bind_host(load_config({"host": "10.0.0.5"}, None, sm_env), sm_env) == "10.0.0.5"


# A sitecustomize that holds the engine process in its loading stage (building its EngineCore),
# where it reads no socket, after writing its pid where the test finds it.
SLOW_LOADING_ENGINE = """
import os, time
from neuron_lmi.engine import core
def loading(self, *args, **kwargs):
    with open(os.environ["ENGINE_PID_FILE"], "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)
core.EngineCore.__init__ = loading
"""


def _engine_children(server_pid: int) -> list[int]:
    """The server's engine processes: its children running the engine's bootstrap."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == server_pid and b"engine_main" in cmdline:
            found.append(int(stat.parent.name))
    return found


def _gone_within(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":  # exited; init reaps it
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_an_engine_still_loading_never_outlives_its_server(
    tiny_llama_dir: Path, tmp_path: Path, sig: int
) -> None:
    hook = tmp_path / "slow-hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SLOW_LOADING_ENGINE)
    pid_file = tmp_path / "engine.pid"
    env = {
        **os.environ,
        "PYTHONPATH": str(hook),
        "ENGINE_PID_FILE": str(pid_file),
        "OPTION_ENFORCE_EAGER": "true",
    }
    argv = [*cli_command(), "serve", "--model", str(tiny_llama_dir), "--host", "127.0.0.1", "--port", "0"]
    server = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not pid_file.exists() or not pid_file.read_text():
            assert server.poll() is None and time.monotonic() < deadline, "the engine never began loading"
            time.sleep(0.1)
        engine = int(pid_file.read_text())
        assert _engine_children(server.pid) == [engine]
        server.send_signal(sig)
        server.wait(30)
        assert _gone_within(engine, 10), f"engine process {engine} outlived its server ({sig!r})"
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(10)


def test_a_stepping_engine_never_outlives_a_killed_server(tiny_llama_dir: Path, tmp_path: Path) -> None:
    server = start_server(tiny_llama_dir, tmp_path, ["--max-rolling-batch-size", "1"], api_key=None)
    try:
        (engine,) = _engine_children(server.proc.pid)
        started = threading.Event()

        def stream() -> None:
            with (
                contextlib.suppress(httpx.HTTPError),
                httpx.stream("POST", f"{server.url}/invocations", json=LONGER, timeout=300) as r,
            ):
                for _ in r.iter_lines():
                    started.set()

        threading.Thread(target=stream, daemon=True).start()
        assert started.wait(60)  # the engine is stepping
        server.proc.kill()
        server.proc.wait(30)
        assert _gone_within(engine, 10), f"engine process {engine} outlived its killed server"
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait(10)
