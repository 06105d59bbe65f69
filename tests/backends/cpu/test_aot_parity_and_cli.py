"""Greedy output with compiled artifacts equals the eager engine's; the compile command reports a hit."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from neuron_lmi.backends.cpu.llm import LLM
from neuron_lmi.cli import main
from neuron_lmi.engine.types import SamplingParams
from tests.backends.cpu.conftest import CompiledStore
from tests.conftest import cpu_options

pytestmark = pytest.mark.slow


def test_greedy_compiled_equals_eager_token_for_token(compiled_store: CompiledStore) -> None:
    common = {"max_rolling_batch_size": compiled_store.n_rows, "n_positions": compiled_store.n_positions}
    eager = LLM(str(compiled_store.model_dir), dtype="fp32", enforce_eager=True, **common)
    # option.compiled_graph_path: the bucket runner, on what the store holds (no_compile: no miss).
    stored = cpu_options(compiled_store.model_dir, compiled_graph_path=str(compiled_store.root), **common)
    compiled = LLM.from_options(replace(stored, no_compile=True))
    assert type(compiled.core.runner).__name__ == "CompiledCpuRunner"
    ids = list(range(300, 380))
    # Six requests on four rows with different lengths: rows join and leave mid-batch (interleaved),
    # and the 80-token prompt is longer than the largest compiled context bucket (64).
    prompts = [ids[:3], ids[:40], ids[:80], ids[5:6], ids[10:30], ids[:64]]
    params = [
        SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in (12, 5, 20, 9, 16, 7)
    ]
    want = [c.token_ids for c in eager.generate(prompts, params)]
    got = [c.token_ids for c in compiled.generate(prompts, params)]
    assert got == want
    assert [len(t) for t in got] == [12, 5, 20, 9, 16, 7]


def test_compile_command_hits_and_reports(
    compiled_store: CompiledStore, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "compile",
        "--model",
        str(compiled_store.model_dir),
        "--target",
        "cpu",
        "--dtype",
        "fp32",  # the store was compiled in fp32; the host default may be bf16
        "--n-positions",
        str(compiled_store.n_positions),
        "--max-rolling-batch-size",
        str(compiled_store.n_rows),
        "--cache-dir",
        str(compiled_store.root),
        "--graphs",
        "buckets",  # without option.compiled_graph_path, serve (and so compile) use the frozen graphs
        "--no-compile",
        "--json",
    ]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["key"] == compiled_store.key
    assert summary["compiled"] is False and summary["graphs"] == 2
    assert summary["size_bytes"] > 0 and summary["seconds"] >= 0


def test_compile_command_builds_the_graphs_serve_loads(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """By default ``compile --target cpu`` builds the frozen decode and extend packages that the CPU
    engine opens when it serves with the same settings; the engine then starts without compiling
    (``no_compile``), and a second compile is a hit for both."""
    argv = [
        "compile",
        "--model",
        str(tiny_llama_dir),
        "--dtype",
        "fp32",
        "--n-positions",
        "128",
        "--max-rolling-batch-size",
        "4",
        "--cache-dir",
        str(tmp_path),
        "--json",
    ]
    assert main(argv) == 0
    first = json.loads(capsys.readouterr().out)
    assert [p["graph"] for p in first["packages"]] == ["step", "extend"]
    assert first["compiled"] is True and all(p["compiled"] for p in first["packages"])
    assert first["key"] == first["packages"][0]["key"] and first["graphs"] == 2
    monkeypatch.setenv("NEURON_LMI_CACHE_DIR", str(tmp_path))
    as_served = cpu_options(tiny_llama_dir, max_rolling_batch_size=4, n_positions=128, enforce_eager=False)
    served = LLM.from_options(replace(as_served, no_compile=True))
    runner = served.core.runner
    assert runner.compiled_decode is not None and runner.compiled_extend is not None
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    assert len(served.generate([[300, 301, 302]], params)[0].token_ids) == 4
    assert runner.compiled_decode.steps > 0
    assert main([*argv, "--no-compile"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["compiled"] is False
    assert [p["key"] for p in again["packages"]] == [p["key"] for p in first["packages"]]


def test_compile_command_rejects_fp16_on_cpu(
    compiled_store: CompiledStore, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "compile",
        "--model",
        str(compiled_store.model_dir),
        "--dtype",
        "fp16",
        "--cache-dir",
        str(compiled_store.root),
    ]
    assert main(argv) == 2
    assert "--dtype" in capsys.readouterr().err
