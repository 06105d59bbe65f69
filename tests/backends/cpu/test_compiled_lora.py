"""LoRA with the compiled step graph on: the step package takes the runner's adapter slots as inputs
(``LoraStepGraph``), so batches holding adapted lines stay compiled; every line's tokens equal the
merged weights', adapters of different ranks and targets side by side with base lines, and an
adapter written into a slot in place (one slot, two adapters in turn) is what the next step runs."""

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


def test_adapted_batches_run_in_the_compiled_step_graph(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("NEURON_LMI_CACHE_DIR", str(tmp_path / "cache"))
    a = make_tiny_adapter(tmp_path / "a", tiny_llama_dir, 4, ATTENTION + MLP, 8.0, seed=21)
    b = make_tiny_adapter(tmp_path / "b", tiny_llama_dir, 2, ("q_proj", "v_proj", "down_proj"), 4.0, seed=5)
    llm = LLM(
        str(tiny_llama_dir), dtype="fp32", enforce_eager=False, max_rolling_batch_size=4, n_positions=128,
        enable_lora=True, max_lora_rank=4, max_loras=2, lora_modules=f"a={a} b={b}",
    )  # fmt: skip
    runner = llm.core.runner
    step = runner.compiled_decode
    assert step is not None and step.lora is not None and runner.capabilities.mixed_steps
    eager: list[tuple[int | None, ...] | None] = []
    extend_eager = runner._extend_eager

    def recorded(rows, chunks, adapters=None, last=None):  # type: ignore[no-untyped-def]
        eager.append(None if adapters is None else tuple(adapters))
        return extend_eager(rows, chunks, adapters, last)

    runner._extend_eager = recorded  # type: ignore[method-assign]
    models = {
        name: AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        for name, path in (
            ("a", merge_adapter(tiny_llama_dir, a, tmp_path / "merged-a")),
            ("b", merge_adapter(tiny_llama_dir, b, tmp_path / "merged-b")),
            (None, tiny_llama_dir),
        )
    }
    prompts = random_prompts([9, 21, 13, 6], seed=8)
    names = ["a", None, "b", "a"]
    before = step.steps
    results = llm.generate(prompts, [SamplingParams(max_new_tokens=NEW, adapter=n) for n in names])
    for prompt, name, result in zip(prompts, names, results, strict=True):
        assert result.token_ids == hf_greedy(models[name], prompt, NEW)[0], name
    assert step.steps - before >= NEW and eager == []  # every step compiled, adapted ones too
    assert runner.rows.occupancy().rows_used == 0


def test_one_slot_rewritten_in_place_between_adapters(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("NEURON_LMI_CACHE_DIR", str(tmp_path / "cache"))
    a = make_tiny_adapter(tmp_path / "a", tiny_llama_dir, 4, ATTENTION, 8.0, seed=3)
    b = make_tiny_adapter(tmp_path / "b", tiny_llama_dir, 4, MLP, 8.0, seed=4)
    llm = LLM(
        str(tiny_llama_dir), dtype="fp32", enforce_eager=False, max_rolling_batch_size=4, n_positions=128,
        enable_lora=True, max_lora_rank=4, max_loras=1, lora_modules=f"a={a} b={b}",
    )  # fmt: skip
    assert llm.core.runner.compiled_decode.lora is not None
    prompt = random_prompts([11], seed=2)[0]
    for name, adapter in (("a", a), ("b", b), ("a", a)):  # the one slot holds a, then b, then a again
        merged = AutoModelForCausalLM.from_pretrained(
            str(merge_adapter(tiny_llama_dir, adapter, tmp_path / f"merged-{name}")), dtype=torch.float32
        ).eval()
        (result,) = llm.generate([prompt], [SamplingParams(max_new_tokens=NEW, adapter=name)])
        assert result.token_ids == hf_greedy(merged, prompt, NEW)[0], name
