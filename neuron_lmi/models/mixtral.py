"""Mixtral and Qwen3-MoE: the Llama/Mistral decoder with MLPs replaced by sparse mixtures of SwiGLU
experts (Qwen3-MoE: softmax, top-k, renormalised only under ``norm_topk_prob``; some layers dense).

Attention, norms, rotary tables, the sliding window and the KV-cache contract are
``llama.DecoderLayer``'s; only ``init_mlp``/``mlp`` differ. Per token (as transformers'
``MixtralSparseMoeBlock`` computes it)::

    h ─ router (linear, model dtype) ─ softmax in fp32 ─ top-k ─ renormalise to sum 1 ─ weights w
    out = Σ_k w_k · down_e(silu(gate_e(h)) · up_e(h))      e = the k-th chosen expert

Experts run batched: assignments are sorted by expert once, then one loop over the experts that
got tokens gathers their tokens (``index_select``), runs one fused gate|up and one down matmul,
and scatters the weighted result back (``index_add_``). No loop over tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch
import torch.nn.functional as F

from neuron_lmi.models.args import ModelArgs
from neuron_lmi.models.llama import DecoderLayer, LlamaForCausalLM, param
from neuron_lmi.models.quant import linear

Weight = torch.Tensor | torch.nn.Module  # dense [out, in] or a QuantizedLinear


def route(
    h: torch.Tensor, router: torch.Tensor, top_k: int, normalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h`` [N, hidden] -> (weights [N, k] in ``h.dtype``, experts [N, k]): the top-k of the
    softmax over all experts, renormalised to sum 1 per token when ``normalize`` (Qwen3-MoE's
    ``norm_topk_prob=False`` keeps the raw probabilities)."""
    probs = torch.softmax(linear(h, router).float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(h.dtype), experts


def sparse_moe(
    h: torch.Tensor,
    router: torch.Tensor,
    gate_up: Sequence[Weight],
    down: Sequence[Weight],
    top_k: int,
    normalize: bool = True,
) -> torch.Tensor:
    """Mixture of SwiGLU experts over ``h`` [N, hidden].

    ``router`` [E, hidden]; ``gate_up`` [E, 2I, hidden] (w1 rows then w3 rows); ``down``
    [E, hidden, I] (quantized: ``E``-long lists of ``QuantizedLinear``). Under tensor parallelism
    ``I`` is a rank's slice and the result is that rank's partial sum (routing is replicated, so
    every rank picks the same experts).
    """
    weights, experts = route(h, router, top_k, normalize)
    flat = experts.flatten()  # assignment a = token a // k, its (a % k)-th choice
    order = torch.argsort(flat, stable=True)
    tokens = order // top_k
    slot_weights = weights.flatten()[order]
    counts = torch.bincount(flat, minlength=router.shape[0]).tolist()
    out = torch.zeros_like(h)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        idx = tokens[start : start + n]
        gate, up = linear(h.index_select(0, idx), gate_up[e]).chunk(2, dim=-1)
        y = linear(F.silu(gate) * up, down[e]) * slot_weights[start : start + n, None]
        out.index_add_(0, idx, y)
        start += n
    return out


class MixtralDecoderLayer(DecoderLayer):
    """``DecoderLayer`` whose MLP is a sparse mixture of experts.

    Invariants: ``router`` is ``[E, hidden]``, ``experts_gate_up`` ``[E, 2I, hidden]`` (HF ``w1``
    rows then ``w3`` rows), ``experts_down`` ``[E, hidden, I]`` (HF ``w2``), with ``I`` =
    ``args.moe.intermediate_size`` or else ``args.intermediate_size``; ``1 <= top_k <= E``. The
    router stays dense when quantized.
    """

    linear_weights: ClassVar[tuple[str, ...]] = ("wqkv", "wo", "experts_gate_up", "experts_down")

    def init_mlp(self, args: ModelArgs, dtype: torch.dtype) -> None:
        if args.moe is None:
            raise ValueError(f"{args.architecture}: a Mixtral layer needs num_local_experts in the config")
        e, hidden = args.moe.n_experts, args.hidden_size
        i = args.moe.intermediate_size or args.intermediate_size
        self.top_k, self.normalize = args.moe.top_k, args.moe.normalize
        self.router = param((e, hidden), dtype)
        self.experts_gate_up = param((e, 2 * i, hidden), dtype)
        self.experts_down = param((e, hidden, i), dtype)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x, self.post_norm)
        flat = h.reshape(-1, h.shape[-1])
        experts = (self.experts_gate_up, self.experts_down)
        out = sparse_moe(flat, self.router, *experts, self.top_k, self.normalize)
        return out.view_as(h)


class MixtralForCausalLM(LlamaForCausalLM):
    """``LlamaForCausalLM`` with ``MixtralDecoderLayer``s; same prefill/decode/cache contract."""

    layer_cls = MixtralDecoderLayer


class Qwen3MoeDecoderLayer(MixtralDecoderLayer):
    """Qwen3-MoE's expert layer: Mixtral's, with experts of ``moe_intermediate_size``, softmax-then-
    top-k routing renormalised only under ``norm_topk_prob`` (``MoeSpec.normalize``), and Qwen3's
    q/k norms; it differs from Mixtral's in its checkpoint names (``weights.MLP_LOADERS``)."""


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """Qwen3-MoE: expert layers except those ``MoeSpec.dense_layers`` names, which keep a dense MLP
    of ``intermediate_size`` (``mlp_only_layers``, ``decoder_sparse_step``)."""

    layer_cls = Qwen3MoeDecoderLayer

    def make_layer(self, index: int) -> DecoderLayer:
        a = self.args
        if a.moe is None:
            raise ValueError(f"{a.architecture}: a Qwen3-MoE model needs num_experts in the config")
        cls = DecoderLayer if index in a.moe.dense_layers else self.layer_cls
        return cls(a, a.n_heads, a.n_kv_heads, self.dtype)
