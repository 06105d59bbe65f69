"""The static-shape graphs that ``torch.export`` traces for the cpu target, one per bucket.

Both graphs reuse the eager model's layer code (``DecoderLayer.qkv/attn_out/mlp``, ``apply_rotary``,
``grouped_decode_attention``) so compiled and eager compute the same thing. Differences from eager,
all forced by static shapes:

* weights and rotary tables are *constants* of the graph (the wrapper's parameters and buffers,
  named by ``constant_tensors``); AOTInductor is told not to embed them, and the loader hands it the
  live tensors, so every bucket's artifact shares one copy of the weights;
* the KV cache ``[layers, rows, kvh, n_positions, D]`` is an explicit *mutated input*, so prefill and
  decode artifacts write into the same ``cache_api.KVCache`` tensors;
* decode always runs all ``n_rows`` rows (batch = max_rolling_batch_size). A row that is not part of
  the step (``active[r]`` False) is padding: it computes on token 0 at position 0 and writes back the
  value already stored at that slot, so its cache is bit-for-bit unchanged whatever it holds (a free
  row, a paused row, a full row). Its logits are discarded by the runner;
* prefill handles one prompt right-padded to a context bucket ``T`` and writes all ``T`` positions of
  its row; positions at or past the prompt's length hold padding that attention never reads (the
  row's length in ``RowTable`` says where valid data ends).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from neuron_lmi.models.llama import DecoderLayer, LlamaForCausalLM, grouped_decode_attention
from neuron_lmi.models.rope import apply_rotary


def check_compilable(model: LlamaForCausalLM) -> None:
    """Raise ``ValueError`` for models these graphs cannot trace: per-sequence rope tables, or
    layers other than the plain ``DecoderLayer`` (a tensor-parallel shard)."""
    if not all(type(layer) is DecoderLayer for layer in model.layers):
        raise ValueError(
            "compiled cpu graphs cover tensor_parallel_degree=1 only; this model's layers are sharded"
        )
    if model.args.rope.kind == "dynamic":
        raise ValueError(
            "rope_scaling type 'dynamic' recomputes rotary tables per sequence length, which a "
            "static compiled graph cannot do; serve this model with the eager CPU engine"
        )


class _Graph(nn.Module):
    """Holds the model (its parameters become graph constants) and the rotary tables as buffers."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        super().__init__()
        check_compilable(model)
        self.model = model
        self.register_buffer("rope_cos", model.rotary.cos.contiguous(), persistent=True)
        self.register_buffer("rope_sin", model.rotary.sin.contiguous(), persistent=True)


class DecodeGraph(_Graph):
    """One decode step over every row; ``attn_len`` (the token-generation bucket) is baked in.

    Inputs: ``tokens``/``positions`` int64 ``[n_rows]``, ``active`` bool ``[n_rows]``, ``k_cache``/
    ``v_cache`` (mutated). Output: fp32 logits ``[n_rows, vocab]``.
    """

    def __init__(self, model: LlamaForCausalLM, attn_len: int) -> None:
        super().__init__(model)
        self.attn_len = attn_len

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        active: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        m, n = self.model, tokens.shape[0]
        rows = torch.arange(n)
        cos, sin = self.rope_cos[positions][:, None], self.rope_sin[positions][:, None]
        key_pos = torch.arange(self.attn_len)[None, :]
        mask = m.window_mask(positions[:, None], key_pos).view(n, 1, 1, self.attn_len)
        keep = active[:, None, None]
        x = F.embedding(tokens[:, None], m.embed)
        for i, layer in enumerate(m.layers):
            q, k, v = layer.qkv(x)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            # Index the 5-D cache itself (layer as an index tensor, not a view): a write through
            # ``k_cache[i]`` would be functionalised into a copy of the whole cache per layer.
            slot = (torch.full_like(rows, i), rows, slice(None), positions)
            k_cache[slot] = torch.where(keep, k[:, :, 0], k_cache[slot])
            v_cache[slot] = torch.where(keep, v[:, :, 0], v_cache[slot])
            k_all = k_cache[i, :, :, : self.attn_len]
            v_all = v_cache[i, :, :, : self.attn_len]
            attn = grouped_decode_attention(q, k_all, v_all, mask, m.scale)
            x = x + layer.attn_out(attn)
            x = x + layer.mlp(x)
        return m.logits(x[:, 0])


class PrefillGraph(_Graph):
    """Encode one prompt right-padded to ``length`` = the context bucket, into cache row ``row``.

    Inputs: ``tokens`` int64 ``[1, T]``, ``last`` int64 ``[1]`` (prompt length - 1), ``row`` int64
    ``[1]``, ``k_cache``/``v_cache`` (mutated: positions ``0..T-1`` of ``row``). Output: fp32 logits
    ``[1, vocab]`` of the last real token.
    """

    def __init__(self, model: LlamaForCausalLM, length: int) -> None:
        super().__init__(model)
        self.length = length

    def forward(
        self,
        tokens: torch.Tensor,
        last: torch.Tensor,
        row: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        m, t = self.model, self.length
        positions = torch.arange(t)
        cos, sin = self.rope_cos[:t][None], self.rope_sin[:t][None]
        mask = m.window_mask(positions[:, None], positions[None, :])
        x = F.embedding(tokens, m.embed)
        for i, layer in enumerate(m.layers):
            q, k, v = layer.qkv(x)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            slot = (torch.full_like(row, i)[:, None], row[:, None], slice(None), positions[None, :])
            k_cache[slot] = k.transpose(1, 2)
            v_cache[slot] = v.transpose(1, 2)
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=m.scale, enable_gqa=True)
            x = x + layer.attn_out(attn)
            x = x + layer.mlp(x)
        return m.logits(x[0, last])


def constant_tensors(graph: _Graph) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by its qualified name, tied ones under each of their names."""
    out = dict(graph.named_parameters(remove_duplicate=False))
    out.update(graph.named_buffers(remove_duplicate=False))
    return out
