"""Gemma 3's language model: the Llama decoder with Gemma's norms, activation and scales.

What differs from ``llama.DecoderLayer`` (as transformers' ``modeling_gemma3`` computes it)::

    x ─ norm ─ attention ─ norm ─(+)─ norm ─ GeGLU MLP ─ norm ─(+)      four norms per layer
        input            post_attention  pre_feedforward  post_feedforward

* every RMSNorm, the q/k norms and the final one included, scales by ``1 + weight`` in fp32;
* the MLP gate is ``gelu_pytorch_tanh`` (``ModelArgs.hidden_act``), embeddings are multiplied by
  ``sqrt(hidden_size)``, the softmax scale is ``query_pre_attn_scalar ** -0.5``, and logits may be
  soft-capped: all ``ModelArgs`` fields the base model honours;
* sliding-window (local) and full (global) layers alternate, each kind with its own rotary table
  (``ModelArgs.layer_windows``, ``local_rope``: the base model's attention kinds).

``attn_logit_softcapping`` is not applied: transformers' Gemma 3 attention never applies it.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from neuron_lmi.models.args import ModelArgs
from neuron_lmi.models.llama import DecoderLayer, LlamaForCausalLM


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm scaled by ``1 + weight``, all in fp32 and cast back once (Gemma's weights are
    offsets from 1; adding 1 in bf16 would round them)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + weight.float())).to(x.dtype)


class Gemma3DecoderLayer(DecoderLayer):
    """``DecoderLayer`` with Gemma 3's four norms (``post_norm`` is the pre-feedforward one); the
    same prefill/decode/extend steps and cache contract."""

    norm_names: ClassVar[dict[str, str]] = {
        "input_norm": "input_layernorm",
        "attn_post_norm": "post_attention_layernorm",
        "post_norm": "pre_feedforward_layernorm",
        "ffn_post_norm": "post_feedforward_layernorm",
    }

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return gemma_rms_norm(x, weight, self.eps)

    def attn_out(self, attn: torch.Tensor) -> torch.Tensor:
        return self.norm(super().attn_out(attn), self.attn_post_norm)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(super().mlp(x), self.ffn_post_norm)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3's text model (``Gemma3ForCausalLM``, or the language model of a
    ``Gemma3ForConditionalGeneration`` checkpoint served text-only); the base model's contract."""

    layer_cls = Gemma3DecoderLayer

    def __init__(self, args: ModelArgs, n_positions: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(args, n_positions, dtype)
        if not args.qk_norm:
            raise ValueError(f"{args.architecture}: Gemma 3 layers have q/k norms; the config says none")

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return gemma_rms_norm(hidden, self.norm, self.args.rms_norm_eps)
