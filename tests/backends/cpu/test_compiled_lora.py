"""LoRA with the compiled step and extend graphs on: a batch holding an adapted line runs eagerly (the
graphs have the base weights frozen in), and every line's tokens still equal the merged weights'."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from neuron_lmi.backends.cpu.llm import LLM
from neuron_lmi.engine.types import SamplingParams
from neuron_lmi.testing.lora import ATTENTION, MLP, make_tiny_adapter, merge_adapter
from tests.engine.conftest import hf_greedy, random_prompts

pytestmark = pytest.mark.slow

NEW = 8


def test_adapted_batches_run_eagerly_beside_the_compiled_graphs(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("NEURON_LMI_CACHE_DIR", str(tmp_path / "cache"))
    adapter = make_tiny_adapter(tmp_path / "a", tiny_llama_dir, 4, ATTENTION + MLP, 8.0, seed=21)
    llm = LLM(
        str(tiny_llama_dir), dtype="fp32", enforce_eager=False, max_rolling_batch_size=4, n_positions=128,
        enable_lora=True, max_lora_rank=4, max_loras=1, lora_modules=f"a={adapter}",
    )  # fmt: skip
    runner = llm.core.runner
    assert runner.compiled_decode is not None and runner.capabilities.mixed_steps
    prompts = random_prompts([9, 21, 13], seed=8)
    names = ["a", None, None]
    results = llm.generate(prompts, [SamplingParams(max_new_tokens=NEW, adapter=n) for n in names])
    merged = merge_adapter(tiny_llama_dir, adapter, tmp_path / "merged")
    models = {
        name: AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        for name, path in (("a", merged), (None, tiny_llama_dir))
    }
    for prompt, name, result in zip(prompts, names, results, strict=True):
        assert result.token_ids == hf_greedy(models[name], prompt, NEW)[0], name
    assert runner.rows.occupancy().rows_used == 0
