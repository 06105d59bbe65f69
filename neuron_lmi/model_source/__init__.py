"""Turn a ``model_id`` into a local path: built-in names, local paths, ``s3://`` URIs, Hub ids.

``fetch_model`` is the one entry point; :mod:`.s3` and :mod:`.hub` hold the remote sources.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

from neuron_lmi.model_source.base import Deadline, ModelLoadTimeout, ModelSourceError
from neuron_lmi.model_source.hub import fetch_hub
from neuron_lmi.model_source.s3 import fetch_s3, parse_s3_uri, verify_file

__all__ = [
    "Deadline",
    "ModelLoadTimeout",
    "ModelSourceError",
    "fetch_adapter",
    "fetch_hub",
    "fetch_model",
    "fetch_s3",
    "model_cache_dir",
    "parse_s3_uri",
    "verify_file",
]

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def model_cache_dir(env: Mapping[str, str]) -> Path:
    """Where fetched models go: ``NEURON_LMI_MODEL_CACHE``, else ``~/.cache/neuron-lmi/models``."""
    return Path(env.get("NEURON_LMI_MODEL_CACHE") or Path.home() / ".cache" / "neuron-lmi" / "models")


def fetch_model(
    model_id: str,
    cache_dir: Path,
    timeout_s: float | None = None,
    env: Mapping[str, str] | None = None,
    *,
    revision: str | None = None,
) -> Path:
    """Return a local directory or ``.gguf`` file for ``model_id``.

    Accepts a built-in name (``smollm2`` → its bundled GGUF), a local directory holding
    ``config.json`` or a ``.gguf``, a ``.gguf`` file, ``s3://bucket/prefix`` (or one object), or a
    Hub id ``org/name``. ``env`` (default ``os.environ``) supplies AWS credentials/region,
    ``AWS_ENDPOINT_URL[_S3]``, ``HF_TOKEN``, ``HF_HUB_OFFLINE``, ``HF_HUB_CACHE``/``HF_HOME``,
    ``HF_ENDPOINT`` and ``HTTPS_PROXY``. Raises ModelSourceError, FileNotFoundError, ModelLoadTimeout.
    """
    env = os.environ if env is None else env
    text = model_id.strip()
    deadline = Deadline.start(text, timeout_s)
    if text.startswith("s3://"):
        return fetch_s3(text, Path(cache_dir), deadline, env)
    if text and "/" not in text and "://" not in text and (builtin := _builtin(text)) is not None:
        return builtin
    local = Path(text.removeprefix("file://")).expanduser()
    if text and local.exists():
        return _check_local(local)
    if "://" in text:
        raise ModelSourceError(f"model {text!r}: unsupported scheme; use a local path, s3://… or a Hub id")
    if HUB_ID.fullmatch(text):
        return fetch_hub(text, Path(cache_dir), deadline, env, revision)
    raise ModelSourceError(
        f"model {text!r} is not a built-in name ({', '.join(_builtin_names())}), an existing local "
        "path, an s3:// URI or a Hugging Face Hub id (org/name)"
    )


def fetch_adapter(
    source: str, cache_dir: Path, env: Mapping[str, str] | None = None, timeout_s: float | None = None
) -> Path:
    """A LoRA adapter's directory for ``source``: a local directory, ``s3://bucket/prefix`` (mirrored
    as a model is) or a Hub id. What the directory holds is the adapter reader's to check."""
    env = os.environ if env is None else env
    text = source.strip()
    deadline = Deadline.start(text, timeout_s)
    if text.startswith("s3://"):
        return fetch_s3(text, Path(cache_dir), deadline, env)
    local = Path(text.removeprefix("file://")).expanduser()
    if text and local.is_dir():
        return local.resolve()
    if "://" not in text and not local.is_absolute() and HUB_ID.fullmatch(text):
        return fetch_hub(text, Path(cache_dir), deadline, env, None)
    raise ModelSourceError(f"adapter {text!r} is not a local directory, an s3:// URI or a Hub id")


def _builtin_names() -> list[str]:
    from neuron_lmi.models.builtin import BUILTIN_MODELS  # lazily, as in _builtin: torch

    return sorted(BUILTIN_MODELS)


def _builtin(name: str) -> Path | None:
    """The bundled file behind a built-in name; imported lazily (the models package pulls in torch)."""
    from neuron_lmi.models.builtin import resolve_builtin

    return resolve_builtin(name)


def _check_local(path: Path) -> Path:
    path = path.resolve()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and ((path / "config.json").is_file() or any(path.glob("*.gguf"))):
        return path
    raise ModelSourceError(f"local model {str(path)!r} is neither a .gguf file nor a folder with config.json")
