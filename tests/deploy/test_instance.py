"""The systemd unit and environment file for an inf2 EC2 instance."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

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
