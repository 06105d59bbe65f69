"""Greedy output with compiled artifacts equals the eager engine's; the compile command reports a hit."""

from __future__ import annotations

import json

import pytest

from neuron_lmi.cli import main
from neuron_lmi.engine.llm import LLM
from neuron_lmi.engine.types import SamplingParams
from tests.compile.conftest import CompiledStore

pytestmark = pytest.mark.slow


def test_greedy_compiled_equals_eager_token_for_token(compiled_store: CompiledStore) -> None:
    common = {"max_rolling_batch_size": compiled_store.n_rows, "n_positions": compiled_store.n_positions}
    eager = LLM(str(compiled_store.model_dir), **common)
    compiled = LLM(
        str(compiled_store.model_dir),
        compiled=True,
        compiled_graph_path=str(compiled_store.root),
        no_compile=True,
        **common,
    )
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
        "--no-compile",
        "--json",
    ]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["key"] == compiled_store.key
    assert summary["compiled"] is False and summary["graphs"] == 2
    assert summary["size_bytes"] > 0 and summary["seconds"] >= 0


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
