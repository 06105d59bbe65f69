"""A Hugging Face checkpoint's ``config.json``, read in one place for every backend and command.

It sits with the configuration because the configuration needs it first: a local model's
``max_position_embeddings`` sets ``n_positions`` before anything is loaded (``loader``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CONFIG_FILE = "config.json"


def read_hf_config(folder: str | Path, who: str) -> dict[str, Any]:
    """``folder/config.json`` as a dict; ``ValueError`` naming ``who`` needs it when it is missing or
    not a JSON object."""
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        raise ValueError(f"{who} needs a Hugging Face checkpoint directory; no {path}")
    return read_hf_config_file(path, who)


def read_hf_config_file(path: str | Path, who: str) -> dict[str, Any]:
    """A ``config.json`` named as a file (``neuron-lmi cache key --model-config``, ``plan --model``);
    ``ValueError`` naming the file when it is missing, not valid JSON or not a JSON object."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{who}: no such file {path}")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return config


def max_position_embeddings(config: dict[str, Any]) -> int | None:
    """The model's own context limit from its ``config.json``, when it states a positive one (a
    vision-language checkpoint served text-only, Gemma 3's, states it in ``text_config``)."""
    value = config.get("max_position_embeddings")
    text = config.get("text_config")
    if value is None and isinstance(text, dict):
        value = text.get("max_position_embeddings")
    return value if isinstance(value, int) and value > 0 else None
