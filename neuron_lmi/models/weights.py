"""Copy a Hugging Face-named state dict into the fused parameters of ``LlamaForCausalLM`` (and its
subclasses: the MLP of each layer class is filled by its entry in ``MLP_LOADERS``).

A matmul weight may arrive as a ``QuantizedTensor`` (a GGUF file's own Q4/Q8 codes): it is fused
with ``cat_rows`` like a dense one and takes its parameter's place as a ``QuantizedLinear``
(``_put``); embeddings and norms are always dense.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from neuron_lmi.models.args import ModelArgs
from neuron_lmi.models.llama import DecoderLayer, LlamaForCausalLM
from neuron_lmi.models.mixtral import MixtralDecoderLayer, Qwen3MoeDecoderLayer
from neuron_lmi.models.quant import QuantizedTensor, cat_rows, replace_weight, to_linear

Tensor = torch.Tensor | QuantizedTensor


def _take(state: dict[str, Tensor], name: str, shape: tuple[int, ...] | None = None) -> Tensor:
    if name not in state:
        raise ValueError(f"checkpoint is missing tensor {name!r}")
    tensor = state.pop(name)
    if shape is not None and tuple(tensor.shape) != shape:
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {shape}")
    return tensor


def _dense(tensor: Tensor) -> torch.Tensor:
    return tensor.dequantize() if isinstance(tensor, QuantizedTensor) else tensor


def _put(owner: nn.Module, name: str, value: Tensor) -> None:
    """Copy a dense ``value`` into parameter ``name``; a quantized one replaces it with its kernel."""
    if isinstance(value, QuantizedTensor):
        value = to_linear(value)
        if isinstance(value, nn.Module):
            replace_weight(owner, name, value)
            return
    getattr(owner, name).copy_(value)


@torch.no_grad()
def load_hf_weights(model: LlamaForCausalLM, state_dict: dict[str, Tensor]) -> None:
    """Fill ``model`` from HF names; raises ``ValueError`` on a missing, misshapen or unused tensor."""
    state = dict(state_dict)
    a = model.args
    q_out, kv_out = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
    embed = _take(state, "model.embed_tokens.weight", (a.vocab_size, a.hidden_size))
    model.embed.copy_(_dense(embed))
    model.norm.copy_(_dense(_take(state, "model.norm.weight", (a.hidden_size,))))
    if a.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        if isinstance(embed, QuantizedTensor):  # the head reads the file's codes; lookups stay dense
            _put(model, "lm_head", embed)
    else:
        _put(model, "lm_head", _take(state, "lm_head.weight", (a.vocab_size, a.hidden_size)))
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        for norm, hf_name in layer.norm_names.items():
            getattr(layer, norm).copy_(_dense(_take(state, f"{p}{hf_name}.weight", (a.hidden_size,))))
        qkv = [
            _take(state, p + "self_attn.q_proj.weight", (q_out, a.hidden_size)),
            _take(state, p + "self_attn.k_proj.weight", (kv_out, a.hidden_size)),
            _take(state, p + "self_attn.v_proj.weight", (kv_out, a.hidden_size)),
        ]
        _put(layer, "wqkv", cat_rows(qkv))
        _put(layer, "wo", _take(state, p + "self_attn.o_proj.weight", (a.hidden_size, q_out)))
        _mlp_loader(layer)(layer, state, p, a)
        _load_attention_extras(layer, state, p, a)
    leftover = [k for k in state if not k.endswith("rotary_emb.inv_freq")]
    if leftover:
        raise ValueError(f"checkpoint has tensors this architecture does not use: {sorted(leftover)[:5]}")


def _load_attention_extras(layer: DecoderLayer, state: dict[str, Tensor], p: str, a: ModelArgs) -> None:
    """Biases (Llama's ``attention_bias``: q/k/v/o; Qwen2: q/k/v) and per-head q/k norms."""
    if layer.bqkv is not None:
        layer.bqkv.copy_(torch.cat([_take(state, p + f"self_attn.{n}_proj.bias") for n in ("q", "k", "v")]))
    if layer.bo is not None:
        layer.bo.copy_(_take(state, p + "self_attn.o_proj.bias"))
    if layer.q_norm is not None and layer.k_norm is not None:
        layer.q_norm.copy_(_dense(_take(state, p + "self_attn.q_norm.weight", (a.head_dim,))))
        layer.k_norm.copy_(_dense(_take(state, p + "self_attn.k_norm.weight", (a.head_dim,))))


def _mlp_loader(layer: DecoderLayer) -> Callable[..., None]:
    """The MLP loader of ``layer``'s class or its nearest base class that has one."""
    for cls in type(layer).__mro__:
        if cls in MLP_LOADERS:
            return MLP_LOADERS[cls]
    raise ValueError(f"no weight loader for the MLP of {type(layer).__name__}")


def _load_dense_mlp(layer: DecoderLayer, state: dict[str, Tensor], p: str, a: ModelArgs) -> None:
    inter, hidden = a.intermediate_size, a.hidden_size
    gate = _take(state, p + "mlp.gate_proj.weight", (inter, hidden))
    _put(layer, "w_gate_up", cat_rows([gate, _take(state, p + "mlp.up_proj.weight", (inter, hidden))]))
    _put(layer, "w_down", _take(state, p + "mlp.down_proj.weight", (hidden, inter)))
    if a.mlp_bias:
        layer.b_gate_up.copy_(torch.cat([_take(state, p + f"mlp.{n}_proj.bias") for n in ("gate", "up")]))
        layer.b_down.copy_(_take(state, p + "mlp.down_proj.bias"))


def _load_experts(
    layer: MixtralDecoderLayer,
    state: dict[str, Tensor],
    router: str,
    experts: str,
    names: tuple[str, str, str],
    hidden: int,
) -> None:
    """The router ``router`` and each expert ``{experts}{e}.`` with its gate, up and down weights
    ``names``, into the layer's fused gate/up and down stacks (the layer's shapes are the expected)."""
    n_experts, inter = layer.router.shape[0], layer.experts_down.shape[2]
    layer.router.copy_(_take(state, router, (n_experts, hidden)))
    gate, up, down = names
    for e in range(n_experts):
        x = f"{experts}{e}."
        w_gate = _take(state, f"{x}{gate}.weight", (inter, hidden))
        layer.experts_gate_up[e].copy_(torch.cat([w_gate, _take(state, f"{x}{up}.weight", (inter, hidden))]))
        layer.experts_down[e].copy_(_take(state, f"{x}{down}.weight", (hidden, inter)))


def _load_moe_mlp(layer: MixtralDecoderLayer, state: dict[str, Tensor], p: str, a: ModelArgs) -> None:
    """HF ``block_sparse_moe.gate`` (router) and ``experts.{e}.w1/w3`` (gate/up), ``w2`` (down)."""
    moe = p + "block_sparse_moe."
    _load_experts(layer, state, moe + "gate.weight", moe + "experts.", ("w1", "w3", "w2"), a.hidden_size)


def _load_qwen3_moe_mlp(layer: Qwen3MoeDecoderLayer, state: dict[str, Tensor], p: str, a: ModelArgs) -> None:
    """HF ``mlp.gate`` (router) and ``mlp.experts.{e}.gate_proj/up_proj/down_proj``."""
    names = ("gate_proj", "up_proj", "down_proj")
    _load_experts(layer, state, p + "mlp.gate.weight", p + "mlp.experts.", names, a.hidden_size)


# Layer class -> the loader of its MLP weights (attention and norms are common to all); a subclass
# without an entry takes its base class's.
MLP_LOADERS: dict[type[DecoderLayer], Callable[..., None]] = {
    DecoderLayer: _load_dense_mlp,
    MixtralDecoderLayer: _load_moe_mlp,
    Qwen3MoeDecoderLayer: _load_qwen3_moe_mlp,
}
