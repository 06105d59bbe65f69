"""The Python API (``LLM``) resolves its configuration as ``serve`` does: serving.properties and
``OPTION_*`` under its keyword arguments, into the very options serve's CPU builder makes."""

from __future__ import annotations

from pathlib import Path

import pytest

from neuron_lmi.backends import registry
from neuron_lmi.backends.cpu import engine as cpu_engine
from neuron_lmi.backends.cpu import llm as llm_module
from neuron_lmi.backends.cpu.engine import CpuEngineOptions
from neuron_lmi.backends.cpu.llm import LLM
from neuron_lmi.config import ConfigError, ResolvedConfig, load_config

# serving.properties wins over the environment, as in LMI: its rows, the environment's positions.
ENV = {"OPTION_MAX_ROLLING_BATCH_SIZE": "5", "OPTION_N_POSITIONS": "96"}


def _serve_view(monkeypatch: pytest.MonkeyPatch, resolved: ResolvedConfig) -> CpuEngineOptions:
    """What serve's CPU builder hands the engine process for ``resolved``."""
    seen: list[CpuEngineOptions] = []
    monkeypatch.setattr(
        cpu_engine, "cpu_process_engine", lambda options, model_name=None: seen.append(options)
    )
    registry.get("cpu")(registry.BuildRequest(resolved, {}, "cpu", 1))
    return seen[0]


def test_llm_resolves_properties_and_environment_as_serve_does(
    monkeypatch: pytest.MonkeyPatch, tiny_llama_properties: Path, tiny_llama_dir: Path
) -> None:
    llm = LLM(properties=tiny_llama_properties, env=ENV)
    assert llm.options == _serve_view(monkeypatch, load_config(None, tiny_llama_properties, ENV))
    opts = llm.options
    assert (opts.model, opts.max_rolling_batch_size, opts.n_positions) == (str(tiny_llama_dir), 3, 96)
    assert (opts.dtype, opts.compile_graphs) == ("fp32", False)
    assert llm.core.runner.rows.n_rows == 3  # the engine is built from them


def test_llm_keywords_win_over_every_source(tiny_llama_properties: Path) -> None:
    llm = LLM(
        properties=tiny_llama_properties, env=ENV, max_rolling_batch_size=2, n_positions=64, dtype="auto"
    )
    assert (llm.options.max_rolling_batch_size, llm.options.n_positions) == (2, 64)
    assert llm.options.dtype == "fp32"  # dtype="auto" is no dtype: serving.properties still says fp32


def test_llm_refuses_what_is_not_configuration(tiny_llama_properties: Path) -> None:
    with pytest.raises(ConfigError, match=r"compile_graphs.*not a neuron-lmi configuration option"):
        LLM(properties=tiny_llama_properties, env=ENV, compile_graphs=True)
    with pytest.raises(ConfigError, match="n-positions"):
        LLM(properties=tiny_llama_properties, env=ENV, n_positions=0)


def test_an_unset_llm_runs_as_served(monkeypatch: pytest.MonkeyPatch, tiny_llama_dir: Path) -> None:
    """No keyword but the model: the host's dtype and the compiled graphs, as ``serve`` (the options
    only: building the engine would compile)."""
    monkeypatch.setattr(llm_module, "build_cpu_engine_core", lambda options: (None, None))
    options = LLM(str(tiny_llama_dir), env={}).options
    assert options == _serve_view(monkeypatch, load_config({"model_id": str(tiny_llama_dir)}, None, {}))
    assert options.compile_graphs is True and options.dtype == cpu_engine.resolve_cpu_dtype(None)
