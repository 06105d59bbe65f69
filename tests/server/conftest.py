"""A real ``neuron-lmi serve`` subprocess on a free loopback port, shared per session per model.

Servers are started through the installed console script when it exists (``python -m
neuron_lmi.cli`` otherwise) and are ready once ``/ping`` answers 200.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.conftest import cpu_options

API_KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
STARTUP_TIMEOUT_S = 180.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cli_command() -> list[str]:
    script = Path(sys.executable).with_name("neuron-lmi")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "neuron_lmi.cli"]


@dataclass
class ServerProcess:
    """One server subprocess; ``log`` collects its stderr/stdout for failure messages."""

    proc: subprocess.Popen[bytes]
    url: str
    log: Path
    headers: Mapping[str, str]

    def client(self, timeout: float = 60.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=dict(self.headers), timeout=timeout)

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.url}/metrics", headers=dict(self.headers), timeout=10).text
        for line in text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(f"{name} not in /metrics")

    def wait_rows_free(self, timeout_s: float = 10.0) -> float:
        deadline = time.monotonic() + timeout_s
        used = self.metric("neuron_lmi_kv_rows_used")
        while used and time.monotonic() < deadline:
            time.sleep(0.05)
            used = self.metric("neuron_lmi_kv_rows_used")
        return used

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            raise


def start_server(
    model: str | Path,
    tmp: Path,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    api_key: str | None = API_KEY,
    command: Sequence[str] | None = None,
) -> ServerProcess:
    """Start ``neuron-lmi serve`` and wait until ``/ping`` is 200 (or fail with its log)."""
    port = free_port()
    log = tmp / f"server-{port}.log"
    args = [
        *(command or cli_command()),
        "serve",
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    if api_key:
        args += ["--api-key", api_key]
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("OPTION_", "SERVING_", "SM_"))}
    # Eager unless a test asks otherwise: the compiled graphs cost a compile per model and shape,
    # and tests/backends/cpu/test_compiled_graphs.py covers them (test_compiled_graphs.py sets this to false).
    full_env["OPTION_ENFORCE_EAGER"] = "true"
    full_env.update(env or {})
    full_env.setdefault("SM_MODEL_DIR", str(tmp / "no-sagemaker-model-dir"))
    full_env.setdefault("NEURON_LMI_SAGEMAKER_ROOT", str(tmp / "no-sagemaker-root"))
    with log.open("wb") as out:
        proc = subprocess.Popen([*args, *extra_args], stdout=out, stderr=subprocess.STDOUT, env=full_env)
    url = f"http://127.0.0.1:{port}"
    server = ServerProcess(proc, url, log, AUTH if api_key else {})
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode} during start-up:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/ping", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    proc.kill()
    pytest.fail(f"server did not answer /ping within {STARTUP_TIMEOUT_S}s:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="session")
def tiny_server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The tiny random Llama behind an API key, 8 KV rows, 256 positions, fp32 like ``direct_engine``
    (the CPU default is bf16 on hosts with native bf16)."""
    tmp = tmp_path_factory.mktemp("tiny_server")
    args = ["--max-rolling-batch-size", "8", "--n-positions", "256", "--dtype", "fp32"]
    server = start_server(tiny_llama_dir, tmp, args)
    yield server
    code = server.stop()
    if code != 0:
        print(server.log.read_text()[-3000:])


@pytest.fixture(scope="session")
def tool_server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The tiny random Llama with ``option.tool_call_parser=hermes``: its chat template (SmolLM2's) has
    no tool support, so tools go through the built-in Hermes tool prompt. 512 positions for it."""
    tmp = tmp_path_factory.mktemp("tool_server")
    args = ["--max-rolling-batch-size", "4", "--n-positions", "512", "--dtype", "fp32"]
    server = start_server(tiny_llama_dir, tmp, [*args, "--tool-call-parser", "hermes"])
    yield server
    code = server.stop()
    if code != 0:
        print(server.log.read_text()[-3000:])


@pytest.fixture(scope="session")
def direct_engine(tiny_llama_dir: Path):
    """The same model in-process, for greedy parity with the server (same options as ``tiny_server``)."""
    from neuron_lmi.backends.cpu.engine import cpu_thread_engine

    return cpu_thread_engine(cpu_options(tiny_llama_dir, max_rolling_batch_size=2, n_positions=256))


def direct_greedy(engine, prompt: str | list[int], max_new_tokens: int) -> tuple[str, list[int]]:
    """Greedy text and token ids straight from the engine (no HTTP)."""
    from neuron_lmi.engine.types import SamplingParams

    async def run() -> tuple[str, list[int]]:
        await engine.start()
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
        events = [e async for e in engine.generate(engine.admit(prompt, params))]
        return "".join(e.text for e in events), [e.token_id for e in events]

    return asyncio.run(run())
