"""Helpers for configuration tests: a hermetic environment (no real /opt/ml/model) and file writers."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

from neuron_lmi.config import ResolvedConfig, load_config

Loader = Callable[..., ResolvedConfig]


@pytest.fixture()
def load(tmp_path: Path) -> Loader:
    """``load_config`` with ``SM_MODEL_DIR`` pointing at an empty temporary folder unless given."""

    def _load(
        cli: Mapping[str, Any] | None = None,
        properties: Path | None = None,
        env: Mapping[str, str] | None = None,
    ) -> ResolvedConfig:
        merged = {"SM_MODEL_DIR": str(tmp_path / "no-sagemaker-dir"), **(env or {})}
        return load_config(cli or {}, properties, merged)

    return _load


@pytest.fixture()
def write_props(tmp_path: Path) -> Callable[[str, str], Path]:
    """Write ``text`` to ``<tmp>/<folder>/serving.properties`` and return the path."""

    def _write(text: str, folder: str = "props") -> Path:
        path = tmp_path / folder / "serving.properties"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return path

    return _write
