"""The CPU image's SageMaker start-up contract, without Docker.

The image runs ``ENTRYPOINT ["neuron-lmi"]`` + ``CMD ["serve"]``; SageMaker puts the model
artifacts in ``/opt/ml/model`` (here ``SM_MODEL_DIR``, never the real ``/opt/ml``) and, for images
labelled ``accept-bind-to-port=true``, names the port in ``SAGEMAKER_BIND_TO_PORT``. So this runs
``neuron-lmi serve`` with no arguments on a ``neuron-lmi package`` output (a directory, and a
``model.tar.gz`` unpacked with ``tar -xzf``) and checks what SageMaker relies on: the listening
socket is 0.0.0.0 on that port, ``GET /ping`` answers promptly, never 200 before the model is loaded,
then 200; ``POST /invocations`` (LMI schema) returns ``generated_text``; ``stream: true`` gives JSON
lines that ``deploy.sagemaker``'s stream decoder re-assembles from arbitrary ``PayloadPart`` cuts;
the configuration comes from the packaged ``serving.properties``; SIGTERM exits 0.
The client only ever talks to 127.0.0.1.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest

from deploy.sagemaker import iter_stream_objects
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
STRIPPED_PREFIXES = ("OPTION_", "SERVING_", "SM_", "SAGEMAKER_", "HF_MODEL_ID", "NEURON_LMI_API_KEY")


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
    _package(tiny_llama_dir, tmp / "prefix")
    _package(tiny_llama_dir, tmp / "model.tar.gz")
    return {"dir": tmp / "prefix", "archive": tmp / "model.tar.gz"}


def _sagemaker_env(model_dir: Path, port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(STRIPPED_PREFIXES)}
    env.update(SM_MODEL_DIR=str(model_dir), SAGEMAKER_BIND_TO_PORT=str(port), HF_HUB_OFFLINE="1")
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
    args = [*cli_command(), "serve", "--print-config"]
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

    def start(model_dir: Path) -> tuple[subprocess.Popen[bytes], str, Path, dict[str, str]]:
        port = free_port()
        env = _sagemaker_env(model_dir, port)
        log = tmp_path / f"serve-{port}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen([*cli_command(), "serve"], env=env, stdout=out, stderr=subprocess.STDOUT)
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

    started = time.monotonic()
    _wait_until_ready(proc, f"http://127.0.0.1:{port}", log)
    print(f"{model_dir.name}: /ping 200 after {time.monotonic() - started:.1f}s")
    assert _listening_addresses(port) == {"0.0.0.0"}

    with httpx.Client(base_url=url, timeout=INVOKE_TIMEOUT_S) as client:
        for _ in range(3):  # ready stays ready, and answers fast
            ping = client.get("/ping", timeout=PING_ANSWER_S)
            assert ping.status_code == 200 and ping.json() == {"status": "healthy"}
        info = client.get("/info").json()  # the served engine has the packaged limits
        served = (info["model_id"], info["max_batch_size"], info["max_total_tokens"])
        assert served == (str(model_dir), 4, 256)

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

    proc.send_signal(signal.SIGTERM)
    code = proc.wait(60)
    assert code == 0, log.read_text()[-3000:]


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


def test_bind_port_follows_sagemaker_bind_to_port(tmp_path: Path) -> None:
    """SAGEMAKER_BIND_TO_PORT in SageMaker mode; ``--port`` still wins; ignored outside SageMaker."""
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
    local = load_config({"model_id": "smollm2"}, None, {"SM_MODEL_DIR": str(tmp_path / "none")})
    assert bind_port(local, {"SM_MODEL_DIR": "", "SAGEMAKER_BIND_TO_PORT": "9123"}) == 8080
    bad_env = {**sm_env, "SAGEMAKER_BIND_TO_PORT": "http"}
    with pytest.raises(ValueError, match="SAGEMAKER_BIND_TO_PORT"):
        bind_port(load_config({}, None, bad_env), bad_env)
