"""A Hugging Face checkpoint's ``config.json``, read in one place for every backend and command."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_hf_config(folder: str | Path, who: str) -> dict[str, Any]:
    """``folder/config.json`` as a dict; ``ValueError`` naming ``who`` needs it when it is missing or
    not a JSON object."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ValueError(f"{who} needs a Hugging Face checkpoint directory; no {path}")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return config
