"""The CPU image's SageMaker start-up contract, without Docker.

SageMaker runs the image as ``docker run <image> serve``: the Dockerfile's ENTRYPOINT plus ``serve``
(read from ``Dockerfile.cpu`` here). It mounts ``/opt/ml`` (here a temporary folder named by
``NEURON_LMI_SAGEMAKER_ROOT``, never the real ``/opt/ml``) with the model artifacts in
``/opt/ml/model``, sets no ``SM_MODEL_DIR`` (a training variable), and, for images labelled
``accept-bind-to-port=true``, may name the port in ``SAGEMAKER_BIND_TO_PORT``. So this runs that
command on a ``neuron-lmi package`` output (a directory, and a ``model.tar.gz`` unpacked with
``tar -xzf``), and on an environment-only deployment (``HF_MODEL_ID``, ``OPTION_*``, no
serving.properties), and checks what SageMaker relies on: the listening socket is 0.0.0.0 on that
port, ``GET /ping`` answers promptly, never 200 before the model is loaded, then 200;
``POST /invocations`` (LMI schema) returns ``generated_text``; ``stream: true`` gives JSON lines that
``neuron_lmi.deploy.sagemaker``'s stream decoder re-assembles from arbitrary ``PayloadPart`` cuts; the
configuration comes from the packaged ``serving.properties`` or the environment; SIGTERM exits 0,
and before SageMaker's SIGKILL 30 s later even when a request holds the drain.
The client only ever talks to 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest

from neuron_lmi.deploy.sagemaker import iter_stream_objects
from tests.server.conftest import cli_command, free_port

STARTUP_LIMIT_S = 120.0  # generous for 2 shared CPUs; SageMaker's health-check timeout is the real one
PING_ANSWER_S = 2.0  # every /ping that gets an answer gets it within this
INVOKE_TIMEOUT_S = 60.0
OPTIONS = ("option.max_rolling_batch_size=4", "option.n_positions=256")
NEW_TOKENS = 12
REQUEST = {
    "inputs": "The capital of France is",
    "parameters": {"max_new_tokens": NEW_TOKENS, "do_sample": False, "ignore_eos": True},
}
# What the real container would not have: configuration from the developer's shell.
STRIPPED_PREFIXES = ("OPTION_", "SERVING_", "SM_", "SAGEMAKER_", "HF_MODEL_ID", "NEURON_LMI_")
DOCKERFILE = Path(__file__).resolve().parents[2] / "deploy" / "docker" / "Dockerfile.cpu"
SAGEMAKER_KILL_S = 30.0  # SageMaker sends SIGKILL this long after SIGTERM


def _package(model: Path, out: Path) -> None:
    args = [*cli_command(), "package", "--model", str(model), "--out", str(out)]
    for option in OPTIONS:
        args += ["--option", option]
    done = subprocess.run(args, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.fixture(scope="module")
def packaged(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``neuron-lmi package`` into a directory (S3-prefix layout) and into ``model.tar.gz``."""
    tmp = tmp_path_factory.mktemp("sm_package")
    _package(tiny_llama_dir, tmp / "prefix" / "opt" / "ml" / "model")  # copied there as SageMaker does
    _package(tiny_llama_dir, tmp / "model.tar.gz")
    return {"dir": tmp / "prefix" / "opt" / "ml" / "model", "archive": tmp / "model.tar.gz"}


def _entry_command() -> list[str]:
    """``docker run <image> serve``: the image's ENTRYPOINT with ``serve`` in place of its CMD."""
    found = re.search(r"^ENTRYPOINT (\[.*\])$", DOCKERFILE.read_text(), re.M)
    assert found, f"no exec-form ENTRYPOINT in {DOCKERFILE}"
    entrypoint = json.loads(found.group(1))
    assert entrypoint[0] == "neuron-lmi", entrypoint
    return [*cli_command(), *entrypoint[1:], "serve"]


def _sagemaker_env(model_dir: Path, port: int, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The container's environment: ``/opt/ml`` is ``model_dir``'s parent; no SM_MODEL_DIR."""
    assert model_dir.name == "model", model_dir
    env = {k: v for k, v in os.environ.items() if not k.startswith(STRIPPED_PREFIXES)}
    env.update(NEURON_LMI_SAGEMAKER_ROOT=str(model_dir.parent), SAGEMAKER_BIND_TO_PORT=str(port))
    # Eager, as in tests/server/conftest.py: the compiled graphs have their own tests.
    env.update(HF_HUB_OFFLINE="1", OPTION_ENFORCE_EAGER="true")
    env.update(extra or {})
    return env


def _listening_addresses(port: int) -> set[str]:
    """Local addresses of IPv4 sockets in LISTEN state on ``port``, read from /proc/net/tcp."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        address, port_hex = fields[1].split(":")
        if fields[3] == "0A" and int(port_hex, 16) == port:  # 0A = TCP_LISTEN
            found.add(".".join(str(int(address[i : i + 2], 16)) for i in (6, 4, 2, 0)))
    return found


def _wait_until_ready(proc: subprocess.Popen[bytes], url: str, log: Path) -> list[Any]:
    """Poll ``/ping`` the way SageMaker does until 200; returns every outcome before it."""
    before: list[Any] = []
    deadline = time.monotonic() + STARTUP_LIMIT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"serve exited with {proc.returncode} during start-up:\n{log.read_text()[-3000:]}")
        try:
            status = httpx.get(f"{url}/ping", timeout=PING_ANSWER_S).status_code
        except httpx.TimeoutException:
            pytest.fail(f"/ping took over {PING_ANSWER_S}s to answer:\n{log.read_text()[-3000:]}")
        except httpx.TransportError as exc:  # not listening yet: connection refused
            before.append(type(exc).__name__)
            time.sleep(0.2)
            continue
        if status == 200:
            # The engine (model loaded) is built before serve binds, so its log line must be there.
            log_now = log.read_text(errors="replace")
            assert "CPU engine:" in log_now, "/ping was 200 before the model loaded"
            return before
        assert status == 503, f"/ping answered {status} while loading"
        before.append(status)
        time.sleep(0.2)
    proc.kill()
    pytest.fail(f"/ping not 200 within {STARTUP_LIMIT_S}s:\n{log.read_text()[-3000:]}")


def _print_config(env: Mapping[str, str]) -> str:
    args = [*_entry_command(), "--print-config"]
    done = subprocess.run(args, env=dict(env), capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _config_line(text: str, field_name: str) -> list[str]:
    """``[value, "<-", source]`` from the ``--print-config`` row of ``field_name``."""
    rows = [line.split() for line in text.splitlines() if line.startswith(field_name + " ")]
    assert len(rows) == 1, f"{field_name} not in --print-config output:\n{text}"
    return rows[0][-3:]


def _stream_like_sagemaker(client: httpx.Client, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The response bytes cut into 7-byte ``PayloadPart`` events (mid-line, mid-JSON, mid-UTF-8),
    decoded as ``invoke_endpoint_with_response_stream`` callers do."""
    with client.stream("POST", "/invocations", json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("application/jsonlines")
        raw = b"".join(response.iter_bytes())
    events = [{"PayloadPart": {"Bytes": raw[i : i + 7]}} for i in range(0, len(raw), 7)]
    return list(iter_stream_objects(events))


@pytest.fixture()
def serve_sagemaker_way(tmp_path: Path) -> Iterator[Any]:
    """Start ``neuron-lmi serve`` (the image's ENTRYPOINT + CMD) on a model dir; kills leftovers."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(
        model_dir: Path, extra: Mapping[str, str] | None = None
    ) -> tuple[subprocess.Popen[bytes], str, Path, dict[str, str]]:
        port = free_port()
        env = _sagemaker_env(model_dir, port, extra)
        log = tmp_path / f"serve-{port}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(_entry_command(), env=env, stdout=out, stderr=subprocess.STDOUT)
        procs.append(proc)
        return proc, f"http://127.0.0.1:{port}", log, env

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def _check_contract(model_dir: Path, start: Any) -> None:
    proc, url, log, env = start(model_dir)
    port = int(env["SAGEMAKER_BIND_TO_PORT"])
    properties = f"serving.properties:{model_dir / 'serving.properties'}"

    # The same resolution the running server does: everything from the packaged serving.properties.
    config = _print_config(env)
    assert _config_line(config, "model.model_id") == [str(model_dir), "<-", f"model_dir:{model_dir}"]
    assert _config_line(config, "batching.max_rolling_batch_size") == ["4", "<-", properties]
    assert _config_line(config, "batching.n_positions") == ["256", "<-", properties]
    assert f"bind address: 0.0.0.0:{port} (SageMaker mode)" in config

    _check_serving(proc, url, log, str(model_dir))
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(60)
    assert code == 0, log.read_text()[-3000:]


def _check_serving(proc: subprocess.Popen[bytes], url: str, log: Path, model_id: str) -> None:
    """What SageMaker's health checks and invocations see, on 0.0.0.0 at the assigned port."""
    port = int(url.rsplit(":", 1)[1])
    started = time.monotonic()
    _wait_until_ready(proc, url, log)
    print(f"{model_id}: /ping 200 after {time.monotonic() - started:.1f}s")
    assert _listening_addresses(port) == {"0.0.0.0"}

    with httpx.Client(base_url=url, timeout=INVOKE_TIMEOUT_S) as client:
        for _ in range(3):  # ready stays ready, and answers fast
            ping = client.get("/ping", timeout=PING_ANSWER_S)
            assert ping.status_code == 200 and ping.json() == {"status": "healthy"}
        info = client.get("/info").json()  # the served engine has the packaged limits
        served = (info["model_id"], info["max_batch_size"], info["max_total_tokens"])
        assert served == (model_id, 4, 256)

        response = client.post("/invocations", json=REQUEST)
        assert response.status_code == 200, response.text
        result = response.json()
        assert isinstance(result["generated_text"], str) and result["generated_text"]

        objects = _stream_like_sagemaker(client, REQUEST)
        assert len(objects) == NEW_TOKENS and all("token" in obj for obj in objects)
        final = objects[-1]
        assert final["generated_text"] == result["generated_text"]  # greedy: stream == non-stream
        assert "".join(obj["token"]["text"] for obj in objects) == final["generated_text"]
        assert all(obj.get("generated_text") is None for obj in objects[:-1])


def _files(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def test_packaged_directory_starts_the_sagemaker_way(packaged: dict[str, Path], serve_sagemaker_way) -> None:
    """An uncompressed S3 prefix, copied as is into the model dir."""
    _check_contract(packaged["dir"], serve_sagemaker_way)


def test_unpacked_model_tar_gz_starts_the_same_way(
    packaged: dict[str, Path], serve_sagemaker_way, tmp_path: Path
) -> None:
    """``model.tar.gz`` as SageMaker unpacks it: ``tar -xzf`` into ``.../opt/ml/model``."""
    model_dir = tmp_path / "opt" / "ml" / "model"
    model_dir.mkdir(parents=True)
    subprocess.run(["tar", "-xzf", str(packaged["archive"]), "-C", str(model_dir)], check=True, timeout=120)
    assert _files(model_dir) == _files(packaged["dir"])  # same files at the root, properties included
    properties = "serving.properties"
    assert (model_dir / properties).read_bytes() == (packaged["dir"] / properties).read_bytes()
    _check_contract(model_dir, serve_sagemaker_way)


def _hold_the_drain(port: int) -> socket.socket:
    """An /invocations request whose body never finishes arriving: the server's drain must wait for
    it (it is in flight) until the drain's time limit."""
    held = socket.create_connection(("127.0.0.1", port), timeout=10)
    held.sendall(
        b"POST /invocations HTTP/1.1\r\nHost: sagemaker\r\nContent-Type: application/json\r\n"
        b'Content-Length: 4096\r\n\r\n{"inputs": "The capital'
    )
    time.sleep(0.5)  # the request is in the app, waiting for the rest of its body
    return held


def test_environment_only_deployment_starts_the_sagemaker_way(
    tiny_llama_dir: Path, serve_sagemaker_way, tmp_path: Path
) -> None:
    """LMI's env-only deployment: ``HF_MODEL_ID`` and ``OPTION_*``, an empty ``/opt/ml/model``, no
    serving.properties, no SM_MODEL_DIR, and a grace period longer than SageMaker waits. SIGTERM
    arrives while a request holds the drain: the process still exits 0 before the SIGKILL."""
    model_dir = tmp_path / "opt" / "ml" / "model"
    model_dir.mkdir(parents=True)
    extra = {
        "HF_MODEL_ID": str(tiny_llama_dir),
        "OPTION_MAX_ROLLING_BATCH_SIZE": "4",
        "OPTION_N_POSITIONS": "256",
        "SERVING_GRACE_PERIOD_S": "120",
    }
    proc, url, log, env = serve_sagemaker_way(model_dir, extra)
    port = int(env["SAGEMAKER_BIND_TO_PORT"])

    config = _print_config(env)
    assert "# read" not in config  # no serving.properties anywhere
    assert _config_line(config, "model.model_id") == [str(tiny_llama_dir), "<-", "env:HF_MODEL_ID"]
    assert _config_line(config, "batching.max_rolling_batch_size") == [
        "4", "<-", "env:OPTION_MAX_ROLLING_BATCH_SIZE"
    ]  # fmt: skip
    assert f"bind address: 0.0.0.0:{port} (SageMaker mode)" in config
    assert "on SIGTERM: drain requests 20s, then stop the engine 3s" in config

    _check_serving(proc, url, log, str(tiny_llama_dir))
    with _hold_the_drain(port):
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(SAGEMAKER_KILL_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {SAGEMAKER_KILL_S:.0f}s after SIGTERM: SageMaker would SIGKILL it")
        took = time.monotonic() - sent
    assert code == 0, log.read_text()[-3000:]
    print(f"SIGTERM to exit with a request holding the drain: {took:.1f}s")
    assert 15 < took < SAGEMAKER_KILL_S - 2, "the drain should wait for the request, then stop in time"


def test_sagemaker_mode_needs_no_sm_model_dir(tmp_path: Path) -> None:
    """SageMaker hosting sets no SM_MODEL_DIR: ``/opt/ml`` present or SAGEMAKER_BIND_TO_PORT set is
    SageMaker; SM_MODEL_DIR alone is not; SERVING_SAGEMAKER decides when set."""
    from neuron_lmi.commands.serve import sagemaker_mode
    from neuron_lmi.config import load_config

    root = tmp_path / "opt" / "ml"
    absent = {"NEURON_LMI_SAGEMAKER_ROOT": str(tmp_path / "absent")}
    cases = [
        (absent, False),
        ({**absent, "SM_MODEL_DIR": str(tmp_path)}, False),  # a training variable, no sign of hosting
        ({**absent, "SAGEMAKER_BIND_TO_PORT": "8081"}, True),
        ({"NEURON_LMI_SAGEMAKER_ROOT": str(root)}, True),
        ({"NEURON_LMI_SAGEMAKER_ROOT": str(root), "SERVING_SAGEMAKER": "false"}, False),
        ({**absent, "SERVING_SAGEMAKER": "true"}, True),
    ]
    (root / "model").mkdir(parents=True)
    for env, expected in cases:
        assert sagemaker_mode(load_config({"model_id": "smollm2"}, None, env), env) is expected, env


def test_drain_ends_before_sagemakers_kill() -> None:
    """Under SageMaker the HTTP drain and the engine stop (plus its 5 s thread join) fit in 30 s."""
    from neuron_lmi.commands.serve import stop_timeouts
    from neuron_lmi.config import load_config

    absent = {"NEURON_LMI_SAGEMAKER_ROOT": "/nonexistent"}
    for grace in ("600", "30", "25"):
        resolved = load_config({}, None, {**absent, "SERVING_GRACE_PERIOD_S": grace})
        drain, engine_stop = stop_timeouts(resolved, sagemaker=True)
        assert drain + engine_stop + 5 < SAGEMAKER_KILL_S
        assert stop_timeouts(resolved, sagemaker=False) == (float(grace), float(grace))
    short = load_config({}, None, {**absent, "SERVING_GRACE_PERIOD_S": "2"})
    assert stop_timeouts(short, sagemaker=True) == (2.0, 2.0)


def test_bind_port_follows_sagemaker_bind_to_port(tmp_path: Path) -> None:
    """SAGEMAKER_BIND_TO_PORT whenever it is set (as SageMaker's inference toolkit reads it);
    ``--port`` still wins."""
    from neuron_lmi.commands.serve import bind_port
    from neuron_lmi.config import load_config

    sm_dir = tmp_path / "model"
    sm_dir.mkdir()
    (sm_dir / "serving.properties").write_text("option.model_id=smollm2\n")
    sm_env = {"SM_MODEL_DIR": str(sm_dir), "SAGEMAKER_BIND_TO_PORT": "9123"}
    assert bind_port(load_config({}, None, sm_env), sm_env) == 9123
    no_port_env = {"SM_MODEL_DIR": str(sm_dir)}
    assert bind_port(load_config({}, None, no_port_env), no_port_env) == 8080
    assert bind_port(load_config({"port": 7000}, None, sm_env), sm_env) == 7000
    absent = {"NEURON_LMI_SAGEMAKER_ROOT": str(tmp_path / "none")}
    env_only = {**absent, "SAGEMAKER_BIND_TO_PORT": "9123"}  # no model dir, no serving.properties
    assert bind_port(load_config({"model_id": "smollm2"}, None, env_only), env_only) == 9123
    assert bind_port(load_config({"model_id": "smollm2"}, None, absent), absent) == 8080
    bad_env = {**sm_env, "SAGEMAKER_BIND_TO_PORT": "http"}
    with pytest.raises(ValueError, match="SAGEMAKER_BIND_TO_PORT"):
        bind_port(load_config({}, None, bad_env), bad_env)
