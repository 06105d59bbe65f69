"""Copy a Hugging Face-named state dict into the fused parameters of ``LlamaForCausalLM``."""

from __future__ import annotations

import torch

from neuron_lmi.models.llama import LlamaForCausalLM


def _take(state: dict[str, torch.Tensor], name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    if name not in state:
        raise ValueError(f"checkpoint is missing tensor {name!r}")
    tensor = state.pop(name)
    if shape is not None and tuple(tensor.shape) != shape:
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {shape}")
    return tensor


@torch.no_grad()
def load_hf_weights(model: LlamaForCausalLM, state_dict: dict[str, torch.Tensor]) -> None:
    """Fill ``model`` from HF names; raises ``ValueError`` on a missing, misshapen or unused tensor."""
    state = dict(state_dict)
    a = model.args
    q_out, kv_out = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
    model.embed.copy_(_take(state, "model.embed_tokens.weight", (a.vocab_size, a.hidden_size)))
    model.norm.copy_(_take(state, "model.norm.weight", (a.hidden_size,)))
    if a.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    else:
        model.lm_head.copy_(_take(state, "lm_head.weight", (a.vocab_size, a.hidden_size)))
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        layer.input_norm.copy_(_take(state, p + "input_layernorm.weight", (a.hidden_size,)))
        layer.post_norm.copy_(_take(state, p + "post_attention_layernorm.weight", (a.hidden_size,)))
        layer.wqkv.copy_(
            torch.cat(
                [
                    _take(state, p + "self_attn.q_proj.weight", (q_out, a.hidden_size)),
                    _take(state, p + "self_attn.k_proj.weight", (kv_out, a.hidden_size)),
                    _take(state, p + "self_attn.v_proj.weight", (kv_out, a.hidden_size)),
                ]
            )
        )
        layer.wo.copy_(_take(state, p + "self_attn.o_proj.weight", (a.hidden_size, q_out)))
        layer.w_gate_up.copy_(
            torch.cat(
                [
                    _take(state, p + "mlp.gate_proj.weight", (a.intermediate_size, a.hidden_size)),
                    _take(state, p + "mlp.up_proj.weight", (a.intermediate_size, a.hidden_size)),
                ]
            )
        )
        layer.w_down.copy_(_take(state, p + "mlp.down_proj.weight", (a.hidden_size, a.intermediate_size)))
        if a.attention_bias:
            layer.bqkv.copy_(
                torch.cat([_take(state, p + f"self_attn.{n}_proj.bias") for n in ("q", "k", "v")])
            )
            layer.bo.copy_(_take(state, p + "self_attn.o_proj.bias"))
        if a.mlp_bias:
            layer.b_gate_up.copy_(torch.cat([_take(state, p + f"mlp.{n}_proj.bias") for n in ("gate", "up")]))
            layer.b_down.copy_(_take(state, p + "mlp.down_proj.bias"))
    leftover = [k for k in state if not k.endswith("rotary_emb.inv_freq")]
    if leftover:
        raise ValueError(f"checkpoint has tensors this architecture does not use: {sorted(leftover)[:5]}")
