"""The systemd unit and environment file for an inf2 EC2 instance."""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path, PurePosixPath

import pytest

from compile_cache import default_cache_root
from neuron_lmi.backends.common import model_cache_dir
from neuron_lmi.config import load_config

INSTANCE_DIR = Path(__file__).resolve().parents[2] / "deploy" / "instance"


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """systemd's INI dialect: repeated keys accumulate, ``#``/``;`` lines are comments."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        key, sep, value = line.partition("=")
        if current is None or not sep:
            raise ValueError(f"not a unit file line: {raw!r}")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def parse_env_file(text: str) -> dict[str, str]:
    env = {}
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, sep, value = line.partition("=")
            if not sep or " " in key or "#" in value:
                raise ValueError(f"bad environment line (no inline comments allowed): {line!r}")
            env[key] = value
    return env


def test_unit_file() -> None:
    unit = parse_unit((INSTANCE_DIR / "neuron-lmi.service").read_text())
    assert set(unit) == {"Unit", "Service", "Install"}
    service = unit["Service"]
    assert service["ExecStart"] == ["/opt/neuron-lmi/venv/bin/neuron-lmi serve"]
    assert service["EnvironmentFile"] == ["/etc/neuron-lmi/neuron-lmi.env"]
    assert service["Restart"] == ["on-failure"] and service["KillSignal"] == ["SIGTERM"]
    assert "StartLimitBurst" in unit["Unit"] and "StartLimitBurst" not in service
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]
    assert "network-online.target" in unit["Unit"]["After"]

    env = parse_env_file((INSTANCE_DIR / "neuron-lmi.env").read_text())
    grace = float(env["SERVING_GRACE_PERIOD_S"])
    assert int(service["TimeoutStopSec"][0]) > grace, "systemd must wait for the server's drain"


def unit_environment(service: dict[str, list[str]]) -> dict[str, str]:
    """``Environment=`` lines: space-separated, optionally quoted ``KEY=VALUE`` assignments."""
    env = {}
    for line in service.get("Environment", []):
        for assignment in shlex.split(line):
            key, sep, value = assignment.partition("=")
            if not sep:
                raise ValueError(f"Environment={line!r}: not KEY=VALUE")
            env[key] = value
    return env


def test_caches_live_in_the_units_own_directories(monkeypatch: pytest.MonkeyPatch) -> None:
    """A system user has no home directory: systemd creates StateDirectory (/var/lib/<name>) and
    CacheDirectory (/var/cache/<name>) for it, and every download and compile cache points there."""
    service = parse_unit((INSTANCE_DIR / "neuron-lmi.service").read_text())["Service"]
    assert service["StateDirectory"] == ["neuron-lmi"] and service["CacheDirectory"] == ["neuron-lmi"]
    roots = (PurePosixPath("/var/lib/neuron-lmi"), PurePosixPath("/var/cache/neuron-lmi"))
    # the environment file is read after Environment= and overrides it, as systemd does
    env = {**unit_environment(service), **parse_env_file((INSTANCE_DIR / "neuron-lmi.env").read_text())}
    for name in ("NEURON_LMI_CACHE_DIR", "NEURON_LMI_MODEL_CACHE", "HF_HOME", "HOME", "XDG_CACHE_HOME"):
        assert any(PurePosixPath(env[name]).is_relative_to(root) for root in roots), (name, env.get(name))
    assert PurePosixPath(service["WorkingDirectory"][0]) in roots
    compiled = env["OPTION_COMPILED_GRAPH_PATH"]
    assert compiled.startswith("s3://") or PurePosixPath(compiled).is_relative_to(roots[1])

    # what the server itself resolves from that environment, with no home directory to fall back on
    def no_home(cls: type) -> Path:
        raise RuntimeError("the service user has no home directory")

    monkeypatch.setattr(Path, "home", classmethod(no_home))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert default_cache_root() == Path("/var/cache/neuron-lmi/compile")  # compiled s3:// entries
    assert model_cache_dir(env) == Path("/var/cache/neuron-lmi/models")  # s3:// and Hub models


def test_environment_file_is_a_valid_config(tmp_path: Path) -> None:
    env = parse_env_file((INSTANCE_DIR / "neuron-lmi.env").read_text())
    resolved = load_config(None, None, {**env, "SM_MODEL_DIR": str(tmp_path)})
    assert resolved.ignored == {}
    assert resolved.config.parallel.tensor_parallel_degree == 8
    assert (resolved.config.server.host, resolved.config.server.port) == ("0.0.0.0", 8080)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_analyze_verify() -> None:
    result = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(INSTANCE_DIR / "neuron-lmi.service")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    problems = [line for line in result.stderr.splitlines() if "neuron-lmi.service" in line]
    # the user, venv and env file exist only on the target instance
    problems = [p for p in problems if "not found" not in p and "No such file" not in p and "user" not in p]
    assert problems == [], result.stderr
