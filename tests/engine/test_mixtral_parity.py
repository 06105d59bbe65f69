"""Mixtral through the real engine: greedy ids and log-probabilities against transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from neuron_lmi.backends.cpu.llm import LLM
from neuron_lmi.models import MixtralForCausalLM
from neuron_lmi.testing.checkpoints import make_tiny_checkpoint

from .conftest import random_prompts
from .test_parity import GREEDY, assert_parity

VARIANTS = {  # name: make_tiny_checkpoint overrides
    "4-experts-gqa": {"seed": 11},
    "8-experts-sliding-window": {
        "seed": 12, "num_local_experts": 8, "sliding_window": 8, "safe_serialization_max_shard": "1MB",
    },
    "top-1-of-4": {"seed": 13, "num_experts_per_tok": 1},
}  # fmt: skip


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tiny_mixtral_matches_transformers(tmp_path: Path, variant: str) -> None:
    from transformers import AutoModelForCausalLM

    path = make_tiny_checkpoint(tmp_path / variant, "mixtral", **VARIANTS[variant])
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    config = hf.config
    assert config.num_key_value_heads < config.num_attention_heads
    prompts = random_prompts([5, 17, 30, 9], seed=len(variant))
    llm = LLM(str(path), dtype="fp32", enforce_eager=True, max_rolling_batch_size=4, n_positions=128)
    model = llm.core.runner.model
    assert isinstance(model, MixtralForCausalLM)
    assert model.args.moe is not None and model.args.moe.n_experts == config.num_local_experts
    assert model.args.sliding_window == config.sliding_window
    if config.sliding_window is not None:  # the window must be shorter than the sequence
        assert config.sliding_window < min(map(len, prompts)) + GREEDY.max_new_tokens
    assert_parity(llm, hf, prompts, GREEDY)
