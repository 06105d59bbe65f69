"""Model implementations, looked up by ``config.architectures`` in ``ARCHITECTURES``."""

from __future__ import annotations

from typing import Any

import torch

from neuron_lmi.models.args import ModelArgs, model_args_from_config
from neuron_lmi.models.gemma3 import Gemma3ForCausalLM
from neuron_lmi.models.llama import LlamaForCausalLM
from neuron_lmi.models.mixtral import MixtralForCausalLM, Qwen3MoeForCausalLM
from neuron_lmi.models.quant import QuantizedTensor
from neuron_lmi.models.weights import load_hf_weights

# Mistral is Llama plus a sliding window, which ModelArgs carries; Mixtral adds experts. Qwen2
# (q/k/v biases) and Qwen3 (q/k norms, head_dim of its own) are ModelArgs flags on the Llama
# layer; Qwen3-MoE mixes Mixtral-style expert layers with dense ones; Gemma 3 has its own norms.
# A Gemma 3 vision-language checkpoint is served text-only by its language model.
ARCHITECTURES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForCausalLM,
}


def build_model(
    config: Any,
    state_dict: dict[str, torch.Tensor | QuantizedTensor],
    n_positions: int,
    dtype: torch.dtype = torch.float32,
) -> LlamaForCausalLM:
    """Instantiate the registered implementation for ``config`` and load ``state_dict`` into it."""
    args = model_args_from_config(config)
    model_cls = ARCHITECTURES.get(args.architecture)
    if model_cls is None:
        raise ValueError(
            f"unsupported architecture {args.architecture!r}; supported: {', '.join(sorted(ARCHITECTURES))}"
        )
    model = model_cls(args, n_positions=n_positions, dtype=dtype)
    # QuantizedTensors (a GGUF file's codes) keep their own format; the loader places them.
    cast = {k: v if isinstance(v, QuantizedTensor) else v.to(dtype) for k, v in state_dict.items()}
    load_hf_weights(model, cast)
    return model.eval()


__all__ = [
    "ARCHITECTURES",
    "Gemma3ForCausalLM",
    "LlamaForCausalLM",
    "MixtralForCausalLM",
    "ModelArgs",
    "Qwen3MoeForCausalLM",
    "build_model",
    "model_args_from_config",
]
