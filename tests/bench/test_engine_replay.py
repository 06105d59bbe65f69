"""``bench/engine_replay.py``: the serving bench's requests, closed-loop on an in-process engine."""

from __future__ import annotations

from pathlib import Path

from bench.engine_replay import replay
from neuron_lmi.backends.cpu.engine import build_cpu_engine_core
from neuron_lmi.bench.workload import TokenCount, Workload
from tests.conftest import cpu_options


def test_every_request_runs_to_its_length_with_the_batch_kept_full(tiny_llama_dir: Path) -> None:
    options = cpu_options(tiny_llama_dir, max_rolling_batch_size=4, n_positions=64)
    core, _ = build_cpu_engine_core(options)
    workload = Workload(TokenCount("fixed", 12), TokenCount("fixed", 9), seed=3)
    result = replay(core, workload, concurrency=4, requests=10)
    assert result["output_tokens"] == 10 * 9
    assert not core.has_work() and core.runner.rows.occupancy().rows_used == 0
    # 10 requests through 4 rows: two full waves (the first token comes from the prefill, then 8
    # decode steps each), then the last 2 requests alone, never a full batch.
    assert result["full_steps"] == 2 * 8
    assert result["wall_ms_per_full_step"] >= result["model_ms_per_full_step"] > 0
    # Each wave's prompts go in one step (48 tokens, under the step budget), then its 8 decodes:
    # every step is one kind or the other, and their seconds add up to the run's.
    assert (result["prefill_steps"], result["decode_only_steps"]) == (3, 3 * 8) == (3, result["steps"] - 3)
    assert 0 < result["prefill_s"] + result["decode_only_s"] <= result["duration_s"]
