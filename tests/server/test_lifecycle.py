"""Overload, client disconnects, SIGTERM, a dying engine loop, and how ``serve`` binds and configures."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

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
    assert tiny_server.wait_rows_free(timeout_s=2.0) == 0
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


@pytest.mark.parametrize("fail_fast", [False, True])
def test_dead_engine_loop_is_never_silent(tiny_llama_dir: Path, tmp_path: Path, fail_fast: bool) -> None:
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
    try:
        r = httpx.post(
            f"{port_server.url}/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 4}}
        )
        assert r.status_code in (500, 503), r.text
        if fail_fast:
            assert port_server.proc.wait(30) == 3
            return
        time.sleep(1.5)
        ping = httpx.get(f"{port_server.url}/ping", timeout=5)
        assert ping.status_code == 503 and ping.json()["status"] == "unhealthy"
        assert port_server.stop(timeout_s=30) == 0
    finally:
        if port_server.proc.poll() is None:
            port_server.proc.kill()
            port_server.proc.wait(10)


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
