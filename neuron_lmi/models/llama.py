"""Llama and Mistral decoder in plain torch, driven by an external static KV cache; the base of
every family served (Qwen2/Qwen3 are ``ModelArgs`` flags on it, Mixtral, Qwen3-MoE and Gemma 3
subclass it).

The model holds weights only. Prefill returns every layer's keys and values so the runner can
insert them into a ``cache_api`` row; decode writes one position per row into the cache tensors it
is given (``cache_api.write_step``) and attends over the first ``attn_len`` positions; extend does
the same for a chunk of T tokens per row, appended after what the row already holds (chunked
prefill, prefix reuse). Weights are fused (q|k|v and gate|up) so a layer costs three matmuls and
one attention.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from functools import partial
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from cache_api import KVCache, write_step
from neuron_lmi.models.args import ModelArgs
from neuron_lmi.models.attention import (
    AttentionGroup,
    AttentionKind,
    DecodeInputs,
    ExtendInputs,
    causal_mask,
    contiguous_rows,
    grouped_decode_attention,
)
from neuron_lmi.models.lora import ATTENTION_PROJECTIONS, PROJECTIONS, LayerLora, LoraBatch, add_lora
from neuron_lmi.models.quant import linear
from neuron_lmi.models.rope import Rotary, apply_rotary


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Variance in fp32 as the reference does, so bf16 runs stay close to it.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap * tanh(x / cap)``: scores or logits squashed into (-cap, cap); ``x`` when no cap."""
    return x if cap is None else torch.tanh(x / cap) * cap


# A config's ``hidden_act`` -> the gate activation of its gated MLP.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
}


def param(shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
    """A zero-filled frozen weight, filled later by ``weights.load_hf_weights``."""
    return nn.Parameter(torch.zeros(*shape, dtype=dtype), requires_grad=False)


class DecoderLayer(nn.Module):
    """One pre-norm block. Head counts are attributes so a tensor-parallel shard can hold fewer.

    ``prefill_step``/``decode_step`` are the whole block; the model loops over them, so a layer
    with the same two methods (``parallel.tp_model.ShardedDecoderLayer``) can stand in for it.
    Every matmul goes through ``quant.linear``, so a weight named in ``linear_weights`` may be a
    dense tensor or a ``QuantizedLinear`` (``models.quantize.quantize_model``).
    """

    # The [out, in] matmul weights (a 3-D one is one matrix per expert); biases and norms stay dense.
    linear_weights: ClassVar[tuple[str, ...]] = ("wqkv", "wo", "w_gate_up", "w_down")
    # Norm parameter -> its Hugging Face name in a layer (``weights.load_hf_weights``).
    norm_names: ClassVar[dict[str, str]] = {
        "input_norm": "input_layernorm",
        "post_norm": "post_attention_layernorm",
    }

    def __init__(self, args: ModelArgs, n_heads: int, n_kv_heads: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, args.head_dim
        self.eps = args.rms_norm_eps
        self.hidden_act = args.hidden_act
        qkv_out = (n_heads + 2 * n_kv_heads) * args.head_dim
        for name in self.norm_names:
            setattr(self, name, param((args.hidden_size,), dtype))
        self.wqkv = param((qkv_out, args.hidden_size), dtype)
        self.bqkv = param((qkv_out,), dtype) if args.attention_bias or args.qkv_bias else None
        self.wo = param((args.hidden_size, n_heads * args.head_dim), dtype)
        self.bo = param((args.hidden_size,), dtype) if args.attention_bias else None
        # Qwen3/Gemma 3: each head's q and k normalised over head_dim before rotary.
        self.q_norm = param((args.head_dim,), dtype) if args.qk_norm else None
        self.k_norm = param((args.head_dim,), dtype) if args.qk_norm else None
        self.init_mlp(args, dtype)

    def init_mlp(self, args: ModelArgs, dtype: torch.dtype) -> None:
        """The feed-forward weights; a subclass with another MLP (``mixtral``) overrides this and ``mlp``."""
        self.w_gate_up = param((2 * args.intermediate_size, args.hidden_size), dtype)
        self.b_gate_up = param((2 * args.intermediate_size,), dtype) if args.mlp_bias else None
        self.w_down = param((args.hidden_size, args.intermediate_size), dtype)
        self.b_down = param((args.hidden_size,), dtype) if args.mlp_bias else None

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """This layer's RMSNorm (Gemma's scales by ``1 + weight``)."""
        return rms_norm(x, weight, self.eps)

    def lora_projections(self) -> frozenset[str]:
        """The projections a LoRA adapter may adapt here (``models.lora``): those whose method is
        this class's (a family that overrides one, such as an expert MLP, adapts the rest)."""
        cls = type(self)
        attention = cls.qkv is DecoderLayer.qkv and cls.attn_out is DecoderLayer.attn_out
        mlp = cls.mlp is DecoderLayer.mlp
        return frozenset(p for p in PROJECTIONS if (p in ATTENTION_PROJECTIONS and attention) or
                         (p not in ATTENTION_PROJECTIONS and mlp))  # fmt: skip

    def qkv(
        self, x: torch.Tensor, lora: LayerLora | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[B, T, hidden] -> q [B, H, T, D], k and v [B, KVH, T, D] (q/k normed where the model
        has q/k norms; rotary is the caller's). ``lora``: the adapted lines' low-rank updates."""
        b, t, _ = x.shape
        h = self.norm(x, self.input_norm)
        qkv = linear(h, self.wqkv, self.bqkv)
        if lora is not None:
            qkv = add_lora(qkv, h, lora, "qkv")
        qkv = qkv.view(b, t, self.n_heads + 2 * self.n_kv_heads, self.head_dim)
        q, k, v = qkv.split([self.n_heads, self.n_kv_heads, self.n_kv_heads], dim=2)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.norm(q, self.q_norm), self.norm(k, self.k_norm)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def attn_out(self, attn: torch.Tensor, lora: LayerLora | None = None) -> torch.Tensor:
        """[B, H, T, D] -> [B, T, hidden] (partial sum under tensor parallelism)."""
        b, _, t, _ = attn.shape
        flat = attn.transpose(1, 2).reshape(b, t, -1)
        out = linear(flat, self.wo, self.bo)
        return out if lora is None else add_lora(out, flat, lora, "o")

    def mlp(self, x: torch.Tensor, lora: LayerLora | None = None) -> torch.Tensor:
        h = self.norm(x, self.post_norm)
        gate_up = linear(h, self.w_gate_up, self.b_gate_up)
        if lora is not None:
            gate_up = add_lora(gate_up, h, lora, "gate_up")
        gate, up = gate_up.chunk(2, dim=-1)
        act = ACTIVATIONS[self.hidden_act](gate) * up
        out = linear(act, self.w_down, self.b_down)
        return out if lora is None else add_lora(out, act, lora, "down")

    # A family's own attn_out or mlp (Gemma 3, an expert MLP) takes no adapter: those projections are
    # not in its lora_projections, so no slot holds weights for them and they are called plainly.
    def _attn_out(self, attn: torch.Tensor, lora: LayerLora) -> torch.Tensor:
        return self.attn_out(attn, lora) if "o" in lora.weights else self.attn_out(attn)

    def _mlp(self, x: torch.Tensor, lora: LayerLora) -> torch.Tensor:
        return self.mlp(x, lora) if "gate_up" in lora.weights or "down" in lora.weights else self.mlp(x)

    def prefill_step(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[n, T, hidden] -> (next hidden, k [n, KVH, T, D], v [n, KVH, T, D])."""
        q, k, v = self.qkv(x)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        x = x + self.attn_out(attn)
        return x + self.mlp(x), k, v

    def decode_step(
        self, x: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor, step: DecodeInputs
    ) -> torch.Tensor:
        """[B, 1, hidden] -> next hidden; writes this step's K/V into ``k_layer``/``v_layer``
        (``[n_rows, KVH, n_positions, D]``) at ``step.positions`` of ``step.rows``."""
        q, k, v = self.qkv(x)
        q, k = apply_rotary(q, step.cos, step.sin), apply_rotary(k, step.cos, step.sin)
        write_step(k_layer, v_layer, step.rows, step.positions, k[:, :, 0], v[:, :, 0])
        if step.groups:
            attn = torch.empty_like(q)
            for g in step.groups:
                k_all, v_all = k_layer[g.rows, :, : g.attn_len], v_layer[g.rows, :, : g.attn_len]
                attn[g.index] = grouped_decode_attention(q[g.index], k_all, v_all, g.mask, step.scale)
        else:
            rows = step.row_slice if step.row_slice is not None else step.rows
            k_all, v_all = k_layer[rows, :, : step.attn_len], v_layer[rows, :, : step.attn_len]
            attn = grouped_decode_attention(q, k_all, v_all, step.mask, step.scale)
        x = x + self.attn_out(attn)
        return x + self.mlp(x)

    def extend_step(
        self,
        x: torch.Tensor,
        k_layer: torch.Tensor,
        v_layer: torch.Tensor,
        step: ExtendInputs,
        lora: LayerLora | None = None,
    ) -> torch.Tensor:
        """[n, T, hidden] -> next hidden; writes the chunk's K/V into the cache first, then attends
        over the row's first ``attn_len`` positions (cached prefix + this chunk). ``lora``: the
        adapted lines' updates (the eager path of a batch with adapters)."""
        q, k, v = self.qkv(x) if lora is None else self.qkv(x, lora)
        q, k = apply_rotary(q, step.cos, step.sin), apply_rotary(k, step.cos, step.sin)
        k_new, v_new = k.transpose(1, 2)[step.valid], v.transpose(1, 2)[step.valid]
        write_step(k_layer, v_layer, step.write_rows, step.write_positions, k_new, v_new)
        rows = step.row_slice if step.row_slice is not None else step.rows
        k_all, v_all = k_layer[rows, :, : step.attn_len], v_layer[rows, :, : step.attn_len]
        attn = F.scaled_dot_product_attention(
            q, k_all, v_all, attn_mask=step.mask, scale=step.scale, enable_gqa=True
        )
        if lora is None:  # the common path, as before adapters
            x = x + self.attn_out(attn)
            return x + self.mlp(x)
        x = x + self._attn_out(attn, lora)
        return x + self._mlp(x, lora)


class LlamaForCausalLM(nn.Module):
    """Llama/Mistral weights plus ``prefill`` and ``decode`` over an external KV cache.

    Invariant: the model never owns cache state; given the same cache contents and inputs it
    returns the same logits whatever other rows hold. Layer ``i`` attends with
    ``attention_kinds[layer_kind[i]]``.
    """

    layer_cls: ClassVar[type[DecoderLayer]] = DecoderLayer  # Mixtral swaps in its MoE layer

    def __init__(self, args: ModelArgs, n_positions: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.args, self.dtype, self.n_positions = args, dtype, n_positions
        self.embed = nn.Parameter(
            torch.zeros(args.vocab_size, args.hidden_size, dtype=dtype), requires_grad=False
        )
        self.layers = nn.ModuleList(self.make_layer(i) for i in range(args.n_layers))
        self.norm = nn.Parameter(torch.zeros(args.hidden_size, dtype=dtype), requires_grad=False)
        self.lm_head = (
            self.embed
            if args.tie_word_embeddings
            else nn.Parameter(
                torch.zeros(args.vocab_size, args.hidden_size, dtype=dtype), requires_grad=False
            )
        )
        self.rotary = Rotary(args.rope, args.head_dim, args.max_position_embeddings, n_positions)
        self.attention_kinds, self.layer_kind = self._attention_kinds()
        self.scale = args.attn_scale or args.head_dim**-0.5

    def make_layer(self, index: int) -> DecoderLayer:
        """Layer ``index`` (Qwen3-MoE mixes dense and expert layers)."""
        a = self.args
        return self.layer_cls(a, a.n_heads, a.n_kv_heads, self.dtype)

    def _attention_kinds(self) -> tuple[tuple[AttentionKind, ...], tuple[int, ...]]:
        a = self.args
        local = self.rotary
        if a.local_rope is not None:
            local = Rotary(a.local_rope, a.head_dim, a.max_position_embeddings, self.n_positions)
        kinds: list[AttentionKind] = []
        layer_kind = []
        for i in range(a.n_layers):
            window = a.window(i)
            kind = AttentionKind(window, self.rotary if window is None else local)
            if kind not in kinds:
                kinds.append(kind)
            layer_kind.append(kinds.index(kind))
        return tuple(kinds), tuple(layer_kind)

    def without_window(self) -> LlamaForCausalLM:
        """The same weights attending over every earlier position in every layer (what an engine
        that ignores the config's sliding window computes: NxD Inference's Mixtral)."""
        plain = copy.copy(self)
        plain.args = dataclasses.replace(self.args, sliding_window=None, layer_windows=())
        plain.attention_kinds, plain.layer_kind = plain._attention_kinds()
        return plain

    def make_cache(self, n_rows: int, n_positions: int) -> KVCache:
        """The KV cache this model decodes against (a tensor-parallel model returns one per rank)."""
        a = self.args
        return KVCache(a.n_layers, n_rows, a.n_kv_heads, n_positions, a.head_dim, dtype=self.dtype)

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token embeddings, scaled where the family scales them (Gemma, in the model's dtype)."""
        x = F.embedding(tokens, self.embed)
        if self.args.embed_scale is not None:
            x = x * torch.tensor(self.args.embed_scale, dtype=x.dtype)
        return x

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden, self.norm, self.args.rms_norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return soft_cap(linear(self.final_norm(hidden), self.lm_head).float(), self.args.final_softcap)

    @property
    def supports_extend(self) -> bool:
        """Whether ``extend`` applies: every layer has ``extend_step`` (a tensor-parallel model's
        sharded layers do not), and the rope tables do not depend on the whole sequence's length
        (``dynamic`` does, so a prompt prefilled in chunks would be rotated differently)."""
        layers_extend = all(isinstance(layer, DecoderLayer) for layer in self.layers)
        return layers_extend and self.rotary.spec.kind != "dynamic"

    def window_mask(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """Causal (and sliding-window) visibility, True where query at q_pos may see key at k_pos;
        for a model whose layers share one window (the compiled graphs' only kind)."""
        return causal_mask(q_pos, k_pos, self.args.sliding_window)

    @torch.inference_mode()
    def prefill(
        self, tokens: torch.Tensor, lengths: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Encode right-padded prompts ``tokens`` [n, T], one prompt per row.

        Returns the last real position's logits [n, vocab] (fp32) and keys/values
        [n_layers, n, KVH, T, D] (positions >= a prompt's length are padding).
        """
        n, t = tokens.shape
        positions = torch.arange(t)
        inputs = [
            (
                *kind.rotary.lookup(positions.expand(n, t), seq_lens=lengths),
                causal_mask(positions[:, None], positions[None, :], kind.window),
            )
            for kind in self.attention_kinds
        ]
        last = (torch.arange(n), torch.tensor(lengths) - 1)
        return self._encode(tokens, inputs, last)

    @torch.inference_mode()
    def prefill_at(
        self, tokens: torch.Tensor, positions: torch.Tensor, last: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Encode one row ``tokens`` [1, T] whose rotary positions are ``positions`` [T] while attention
        stays causal by index, and return the logits of index ``last`` with the keys/values of every
        index: a compiled graph's right-padded context encoding, whose padding carries made-up
        positions (NxD Inference's contract model reproduces what such padding writes)."""
        index = torch.arange(tokens.shape[1])
        inputs = [
            (
                *kind.rotary.lookup(positions[None, :]),
                causal_mask(index[:, None], index[None, :], kind.window),
            )
            for kind in self.attention_kinds
        ]
        return self._encode(tokens, inputs, (torch.tensor([0]), torch.tensor([last])))

    @torch.inference_mode()
    def prefill_packed(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        segments: torch.Tensor,
        last: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Encode several prompts per row: ``positions`` restart at 0 for each prompt and a token
        sees only earlier tokens of its own ``segments`` id (block-diagonal causal attention).

        ``last`` = (row indices, column indices) of each prompt's final token; logits come back in
        that order. Not for ``dynamic`` rope, whose tables depend on each sequence's length.
        """
        same = segments[:, :, None] == segments[:, None, :]
        inputs = []
        for kind in self.attention_kinds:
            visible = causal_mask(positions[:, :, None], positions[:, None, :], kind.window)
            inputs.append((*kind.rotary.lookup(positions), (visible & same).unsqueeze(1)))
        return self._encode(tokens, inputs, last)

    def _encode(
        self,
        tokens: torch.Tensor,
        inputs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
        last: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``inputs``: (cos, sin, mask) per attention kind."""
        x = self.embed_tokens(tokens)
        keys, values = [], []
        for layer, kind in zip(self.layers, self.layer_kind, strict=True):
            cos, sin, mask = inputs[kind]
            x, k, v = layer.prefill_step(x, cos, sin, mask, self.scale)
            keys.append(k)
            values.append(v)
        return self.logits(x[last]), torch.stack(keys), torch.stack(values)

    @torch.inference_mode()
    def decode(
        self,
        tokens: torch.Tensor,
        rows: torch.Tensor,
        positions: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        attn_len: int,
        attn_lens: list[int] | None = None,
    ) -> torch.Tensor:
        """One token per row: writes its K/V at ``positions`` of ``rows`` and returns logits [B, vocab].

        ``k_cache``/``v_cache`` are ``[n_layers, n_rows, KVH, n_positions, D]`` (``make_cache().k``/``.v``:
        indexed by layer, whatever a layer holds); attention reads the first ``attn_len`` positions
        (>= every position + 1), or, with ``attn_lens`` (one per row, each >= its position + 1), each
        group of rows sharing a length reads only that many.
        """
        b = tokens.shape[0]
        row_slice = contiguous_rows(rows)
        one_slice = row_slice is not None
        steps = []
        for kind in self.attention_kinds:
            cos, sin = kind.rotary.lookup(positions[:, None], seq_lens=(positions + 1).tolist())
            mask = causal_mask(positions[:, None], torch.arange(attn_len)[None, :], kind.window)
            groups = (
                self._attention_groups(rows, positions, attn_lens, one_slice, kind.window)
                if attn_lens
                else ()
            )
            mask = mask.view(b, 1, 1, attn_len)
            steps.append(
                DecodeInputs(rows, positions, cos, sin, mask, attn_len, self.scale, row_slice, groups)
            )
        x = self.embed_tokens(tokens[:, None])
        for i, layer in enumerate(self.layers):
            x = layer.decode_step(x, k_cache[i], v_cache[i], steps[self.layer_kind[i]])
        return self.logits(x[:, 0])

    def _attention_groups(
        self,
        rows: torch.Tensor,
        positions: torch.Tensor,
        attn_lens: list[int],
        one_slice: bool,
        window: int | None = None,
    ) -> tuple[AttentionGroup, ...]:
        """Rows grouped by length bucket, or none (one attention over ``max(attn_lens)``). When the
        rows are one slice of the cache, that one attention reads it in place, while groups gather
        (copy) their rows; so groups are used there only where they read under half as much.
        ``window``: the sliding window of the layers these groups serve (None: full attention)."""
        if len(set(attn_lens)) < 2:
            return ()
        if one_slice and 2 * sum(attn_lens) >= len(attn_lens) * max(attn_lens):
            return ()
        groups = []
        lens = torch.tensor(attn_lens)
        for length in sorted(set(attn_lens)):
            index = (lens == length).nonzero()[:, 0]
            pos = positions[index]
            mask = causal_mask(pos[:, None], torch.arange(length)[None, :], window).view(-1, 1, 1, length)
            g_rows = rows[index]
            groups.append(AttentionGroup(index, contiguous_rows(g_rows) or g_rows, mask, length))
        return tuple(groups)

    @torch.inference_mode()
    def extend(
        self,
        tokens: torch.Tensor,
        rows: torch.Tensor,
        starts: torch.Tensor,
        lengths: list[int],
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        attn_len: int,
        lora: LoraBatch | None = None,
        last: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Append right-padded chunks ``tokens`` [n, T] to ``rows``, which hold ``starts`` positions.

        Row i's chunk fills positions ``starts[i] .. starts[i] + lengths[i] - 1``, attending causally
        over its cached prefix and itself (the sliding window respected); returns the logits of each
        chunk's last token [n, vocab], or with ``last`` those of each chunk's last ``last[i]`` tokens
        in order, ``[sum(last), vocab]`` (a speculative decode's verification).
        ``attn_len`` >= every ``starts[i] + lengths[i]``. ``lora``: which lines run with which
        resident adapter (``models.lora``; None: none).
        """
        n, t = tokens.shape
        lengths_t = torch.tensor(lengths, dtype=torch.long)
        ends = starts + lengths_t
        valid = torch.arange(t)[None, :] < lengths_t[:, None]
        positions = torch.where(valid, starts[:, None] + torch.arange(t)[None, :], (ends - 1)[:, None])
        writes = (rows.repeat_interleave(lengths_t), positions[valid])
        steps = []
        for kind in self.attention_kinds:
            cos, sin = kind.rotary.lookup(positions, seq_lens=ends.tolist())
            mask = causal_mask(positions[:, :, None], torch.arange(attn_len)[None, None, :], kind.window)
            common = (cos, sin, mask.unsqueeze(1), attn_len, self.scale, contiguous_rows(rows))
            steps.append(ExtendInputs(rows, valid, *writes, *common))
        x = self.embed_tokens(tokens)
        for i, layer in enumerate(self.layers):
            step = steps[self.layer_kind[i]]
            if lora is None:  # the common path: not a single extra call
                x = layer.extend_step(x, k_cache[i], v_cache[i], step)
            else:
                x = layer.extend_step(x, k_cache[i], v_cache[i], step, lora.layer(i))
        if last is None:
            return self.logits(x[torch.arange(n), lengths_t - 1])
        # Only the wanted positions go through the final norm and the vocabulary projection.
        counts = torch.tensor(list(last), dtype=torch.long)
        lines = torch.arange(n).repeat_interleave(counts)
        offsets = torch.arange(len(lines)) - (torch.cumsum(counts, 0) - counts).repeat_interleave(counts)
        return self.logits(x[lines, (lengths_t - counts).repeat_interleave(counts) + offsets])

    def lora_projections(self) -> frozenset[str]:
        """The projections an adapter may adapt in every layer (none where a layer cannot extend)."""
        if not self.supports_extend:
            return frozenset()
        return frozenset.intersection(*(layer.lora_projections() for layer in self.layers))
