"""The CPU engine's default dtype (bf16 only where bf16 matmuls are native) and ``option.quantize``
through the engine builder, ``serve``'s CPU builder and ``generate``."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from neuron_lmi.backends.cpu.engine import CpuEngineOptions, default_cpu_dtype, resolve_cpu_dtype
from neuron_lmi.models.native import host_cpu_flags
from tests.conftest import cpu_options


@pytest.mark.parametrize(
    ("flags", "capability", "expected"),
    [
        ({"avx2", "fma"}, "AVX2", "fp32"),  # AVX2-only
        ({"avx512f", "avx512_bf16"}, "AVX512", "bf16"),  # Cooper Lake, Zen 4
        ({"avx512f", "amx_bf16", "amx_tile"}, "AVX512", "bf16"),  # Sapphire Rapids
        ({"avx512f", "avx512_vnni"}, "AVX512", "fp32"),  # Skylake/Cascade Lake: no bf16
        ({"avx512_bf16", "amx_bf16"}, "AVX2", "fp32"),  # ATEN_CPU_CAPABILITY=avx2 turned AVX-512 off
        (set(), "DEFAULT", "fp32"),  # not x86, or no /proc/cpuinfo
    ],
)
def test_default_cpu_dtype(flags: set[str], capability: str, expected: str) -> None:
    assert default_cpu_dtype(flags, capability) == expected


def test_host_cpu_flags_reads_the_first_flags_line(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 amx_bf16\n\nprocessor\t: 1\nflags\t\t: other\n")
    assert host_cpu_flags(info) == {"fpu", "avx2", "amx_bf16"}
    assert host_cpu_flags(tmp_path / "missing") == frozenset()


def test_an_explicit_dtype_wins() -> None:
    assert resolve_cpu_dtype("fp32") == "fp32" and resolve_cpu_dtype("bf16") == "bf16"
    assert resolve_cpu_dtype(None) == resolve_cpu_dtype("auto") in ("fp32", "bf16")
    unset = cpu_options("smollm2", dtype=None)  # the host's, as serve runs it
    assert unset.dtype == unset.dtype_name() == resolve_cpu_dtype(None)
    assert dataclasses.replace(unset, dtype="auto").dtype_name() == resolve_cpu_dtype(None)
    assert cpu_options("smollm2", dtype="fp32").dtype_name() == "fp32"


@pytest.mark.parametrize(
    ("keys", "switches", "match"),
    [
        ({"quantize": "fp8"}, {}, "Neuron-only"),
        ({"quantize": "static_int8"}, {}, "Neuron-only"),
        ({"quantize": "int4", "compiled_graph_path": "/compiled"}, {}, "AOT-compiled"),
        ({"quantize": "int4"}, {"compiled": True}, "AOT-compiled"),
    ],
)
def test_unsupported_quantize_is_rejected(keys: dict[str, Any], switches: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(cpu_options("smollm2", **keys), **switches).validate_quantize()


def _cpu_builder_kwargs(monkeypatch: pytest.MonkeyPatch, model: Path, **cli: str) -> dict[str, Any]:
    from neuron_lmi.backends import registry
    from neuron_lmi.backends.cpu import engine as cpu_engine
    from neuron_lmi.config import load_config

    seen: dict[str, Any] = {}

    def record(options: CpuEngineOptions, model_name: str | None = None) -> Any:
        seen.update(dataclasses.asdict(options), served_as=model_name)
        return argparse.Namespace()

    monkeypatch.setattr(cpu_engine, "cpu_process_engine", record)
    resolved = load_config({"model_id": str(model), **cli}, None, env={})
    registry.get("cpu")(registry.BuildRequest(resolved, {}, "cpu", 1))
    return seen


def test_serve_builder_defaults_by_host_and_passes_quantize(
    monkeypatch: pytest.MonkeyPatch, tiny_llama_dir: Path
) -> None:
    default = _cpu_builder_kwargs(monkeypatch, tiny_llama_dir)
    assert default["dtype"] == resolve_cpu_dtype(None)  # what /info reports (ProcessEngine.model_dtype)
    assert default["served_as"] == str(tiny_llama_dir)  # model_name(resolved): the model id as given
    assert default["quantize"] is None
    told = _cpu_builder_kwargs(monkeypatch, tiny_llama_dir, dtype="fp32", quantize="int4")
    assert told["dtype"] == "fp32" and told["quantize"] == "int4"


def test_generate_flags() -> None:
    from neuron_lmi.commands import generate

    parser = argparse.ArgumentParser()
    generate.add_parser(parser.add_subparsers())
    assert parser.parse_args(["generate", "hi"]).dtype is None  # unset: the host's, as serve
    args = parser.parse_args(["generate", "hi", "--dtype", "fp32", "--quantize", "int8"])
    assert (args.dtype, args.quantize) == ("fp32", "int8")
