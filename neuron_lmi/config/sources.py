"""Reading and writing LMI's ``serving.properties``, and finding the SageMaker model directory.

The format is the subset of Java properties that LMI documents: one ``key=value`` (or ``key: value``)
per line, ``#`` or ``!`` starts a comment line, surrounding whitespace is ignored, a trailing
backslash continues a line. Comments are whole-line only, so a value may contain ``#``.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neuron_lmi.config.options import ConfigError

PROPERTIES_NAME = "serving.properties"
CLI = "cli"  # the source label of a command-line value
SAGEMAKER_ROOT = Path("/opt/ml")
SAGEMAKER_ROOT_VAR = "NEURON_LMI_SAGEMAKER_ROOT"
SAGEMAKER_MODEL_DIR = SAGEMAKER_ROOT / "model"


@dataclass(frozen=True, slots=True)
class Origin:
    """Where a raw value came from: the name as written, the raw value, and the source label
    (``"cli"``, ``"serving.properties:<path>"``, ``"env:<VAR>"``...)."""

    key: str
    value: Any
    source: str


def properties_label(path: Path) -> str:
    """The source label used for values read from ``path``."""
    return f"{PROPERTIES_NAME}:{path}"


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """Join backslash-continued lines; yield (first line number, stripped text)."""
    out: list[tuple[int, str]] = []
    pending: str | None = None
    start = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if pending is None:
            if not line or line[0] in "#!":
                continue
            start = number
            pending = ""
        if line.endswith("\\") and not line.endswith("\\\\"):
            pending += line[:-1]
            continue
        out.append((start, pending + line))
        pending = None
    if pending:
        out.append((start, pending))
    return out


def parse_properties(text: str, label: str) -> dict[str, str]:
    """Parse properties text into ``{key: value}`` (keys as written; the last duplicate wins).

    A line without ``=`` or ``:`` raises ConfigError naming the line.
    """
    values: dict[str, str] = {}
    for number, line in _logical_lines(text):
        cut = min((i for i in (line.find("="), line.find(":")) if i >= 0), default=-1)
        if cut <= 0:
            raise ConfigError(f"line {number}", line, label, "expected key=value")
        values[line[:cut].strip()] = line[cut + 1 :].strip()
    return values


def read_properties(path: Path) -> dict[str, str]:
    """Read a serving.properties file; a missing file raises FileNotFoundError naming it."""
    if not path.is_file():
        raise FileNotFoundError(f"serving.properties not found: {path}")
    return parse_properties(path.read_text(encoding="utf-8"), properties_label(path))


def format_properties(values: Mapping[str, str], header: str | None = None) -> str:
    """Render ``{key: value}`` as properties text: ``engine`` first, then the other non-option keys,
    then ``option.*`` keys, each group sorted, so the output is stable for diffs."""

    def order(key: str) -> tuple[int, str]:
        return (0 if key == "engine" else 2 if key.startswith("option.") else 1, key)

    lines = [f"# {line}" for line in (header or "").splitlines()]
    for key in sorted(values, key=order):
        value = values[key]
        if "\n" in value or "\r" in value:
            raise ConfigError(key, value, "write_properties", "values cannot span lines")
        lines.append(f"{key}={value}")
    return "\n".join(lines) + "\n"


def write_text_atomic(path: Path, text: str) -> None:
    """Write via a temporary file in the same directory and rename, so readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def sagemaker_root(env: Mapping[str, str]) -> Path:
    """SageMaker's ``/opt/ml``; ``NEURON_LMI_SAGEMAKER_ROOT`` moves it (tests, local rehearsals)."""
    value = env.get(SAGEMAKER_ROOT_VAR, "").strip()
    return Path(value) if value else SAGEMAKER_ROOT


def sagemaker_model_dir(env: Mapping[str, str]) -> Path:
    """Where SageMaker unpacks ``model.tar.gz`` (or copies an S3 prefix): ``<sagemaker_root>/model``.

    ``SM_MODEL_DIR``, when set, names the folder instead. SageMaker *hosting* never sets it (it is a
    training-job variable), so it is only an explicit override here, never a sign of SageMaker.
    """
    value = env.get("SM_MODEL_DIR", "").strip()
    return Path(value) if value else sagemaker_root(env) / "model"


def holds_weights(folder: Path) -> bool:
    """A directory that is itself a model: a Hugging Face ``config.json`` or a ``.gguf`` file."""
    if not folder.is_dir():
        return False
    return (folder / "config.json").is_file() or any(folder.glob("*.gguf"))
