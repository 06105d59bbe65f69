from __future__ import annotations

from pathlib import Path

import pytest
import torch

from neuron_lmi.backends.cpu.llm import LLM


@pytest.fixture(scope="session")
def tiny_llm(tiny_llama_dir: Path) -> LLM:
    return LLM(
        str(tiny_llama_dir), dtype="fp32", enforce_eager=True, max_rolling_batch_size=16, n_positions=256
    )


@pytest.fixture(scope="session")
def hf_tiny_llama(tiny_llama_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()


def random_prompts(lengths: list[int], seed: int = 0, vocab: int = 49000) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]


def hf_greedy(model, prompt: list[int], new_tokens: int) -> tuple[list[int], list[float]]:
    """transformers' greedy continuation (stopping at EOS) and the log_softmax of each chosen token."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    chosen = out.sequences[0, len(prompt) :]
    logits = torch.cat([step.float() for step in out.logits])
    logprobs = torch.log_softmax(logits, -1).gather(1, chosen[:, None])[:, 0]
    return chosen.tolist(), logprobs.tolist()
