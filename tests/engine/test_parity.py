"""Greedy token ids and log-probabilities against transformers' own implementation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from neuron_lmi.backends.cpu.llm import LLM
from neuron_lmi.engine.types import SamplingParams
from neuron_lmi.testing.checkpoints import make_tiny_checkpoint

from .conftest import hf_greedy, random_prompts

GREEDY = SamplingParams(max_new_tokens=40)


def assert_parity(llm: LLM, hf_model, prompts: list[list[int]], params: SamplingParams) -> None:
    results = llm.generate(prompts, params)
    for prompt, result in zip(prompts, results, strict=True):
        ref_ids, ref_logprobs = hf_greedy(hf_model, prompt, params.max_new_tokens)
        assert result.token_ids == ref_ids
        assert (result.finish_reason.value == "eos_token") == (len(ref_ids) < params.max_new_tokens)
        assert max(abs(a - b) for a, b in zip(result.logprobs, ref_logprobs, strict=True)) < 1e-3
    assert llm.core.runner.rows.occupancy().rows_used == 0


def test_tiny_llama_gqa_matches_transformers(tiny_llm: LLM, hf_tiny_llama) -> None:
    assert hf_tiny_llama.config.num_key_value_heads < hf_tiny_llama.config.num_attention_heads
    assert_parity(tiny_llm, hf_tiny_llama, random_prompts([5, 17, 30, 9, 64]), GREEDY)


def test_tiny_mistral_sliding_window_matches_transformers(tiny_mistral_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_mistral_dir), dtype=torch.float32).eval()
    window = hf.config.sliding_window
    prompts = random_prompts([6, 25], seed=3)
    # The window must be shorter than the sequence, or it is never exercised.
    assert window < min(len(p) for p in prompts) + GREEDY.max_new_tokens
    llm = LLM(
        str(tiny_mistral_dir), dtype="fp32", enforce_eager=True, max_rolling_batch_size=4, n_positions=256
    )
    assert llm.core.runner.model.args.sliding_window == window
    assert_parity(llm, hf, prompts, GREEDY)


@pytest.mark.parametrize(
    "rope_scaling",
    [
        {"rope_type": "linear", "factor": 2.0},
        {"rope_type": "dynamic", "factor": 2.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ],
    ids=lambda s: s["rope_type"],
)
def test_rope_scaling_types_match_transformers(tmp_path: Path, rope_scaling: dict) -> None:
    from transformers import AutoModelForCausalLM

    # max_position_embeddings=48 < prompt + new tokens, so dynamic NTK actually rescales mid-run.
    path = make_tiny_checkpoint(
        tmp_path / "rope",
        "llama",
        seed=2,
        rope_scaling=rope_scaling,
        max_position_embeddings=48,
        rope_theta=500.0,
    )
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    llm = LLM(str(path), dtype="fp32", enforce_eager=True, max_rolling_batch_size=2, n_positions=128)
    assert llm.core.runner.model.args.rope.kind == rope_scaling["rope_type"]
    assert_parity(llm, hf, random_prompts([20], seed=4), GREEDY)


@pytest.mark.slow
def test_smollm2_real_weights_match_transformers(smollm2_gguf: Path) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32
    ).eval()
    llm = LLM("smollm2", dtype="fp32", enforce_eager=True, max_rolling_batch_size=8, n_positions=512)
    texts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time, in a small village,",
        "The three primary colors are",
        "Water boils at",
        "import numpy as np\n",
        "The best way to learn a language is",
        "<|im_start|>user\nName a planet.<|im_end|>\n<|im_start|>assistant\n",
    ]
    prompts = [llm.tokenizer.encode(t) for t in texts]
    assert_parity(llm, hf, prompts, SamplingParams(max_new_tokens=64))
