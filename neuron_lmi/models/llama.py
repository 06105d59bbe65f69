"""Llama and Mistral decoder in plain torch, driven by an external static KV cache.

The model holds weights only. Prefill returns every layer's keys and values so the runner can
insert them into a ``cache_api`` row; decode writes one position per row into the cache tensors it
is given (``cache_api.write_step``) and attends over the first ``attn_len`` positions; extend does
the same for a chunk of T tokens per row, appended after what the row already holds (chunked
prefill, prefix reuse). Weights are fused (q|k|v and gate|up) so a layer costs three matmuls and
one attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from cache_api import KVCache, write_step
from neuron_lmi.models.args import ModelArgs
from neuron_lmi.models.quant import linear
from neuron_lmi.models.rope import Rotary, apply_rotary


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Variance in fp32 as the reference does, so bf16 runs stay close to it.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def param(shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
    """A zero-filled frozen weight, filled later by ``weights.load_hf_weights``."""
    return nn.Parameter(torch.zeros(*shape, dtype=dtype), requires_grad=False)


@dataclass(frozen=True, slots=True)
class DecodeInputs:
    """What every layer of one decode step shares: rows, their positions, rotary tables and masks."""

    rows: torch.Tensor  # [B] KV-cache rows
    positions: torch.Tensor  # [B] position written this step
    cos: torch.Tensor
    sin: torch.Tensor
    mask: torch.Tensor  # [B, 1, 1, attn_len] bool
    attn_len: int
    scale: float
    row_slice: slice | None  # ``rows`` as a slice when they are an ascending run
    groups: tuple[AttentionGroup, ...] = ()  # attention per length bucket (empty: one over attn_len)


@dataclass(frozen=True, slots=True)
class AttentionGroup:
    """Decode rows that attend over the same shorter length: one long row does not make every
    other row read ``attn_len`` positions (``DecoderLayer`` uses these; other layers may ignore them
    and attend over ``DecodeInputs.attn_len``, which covers every row)."""

    index: torch.Tensor  # [b] positions of these rows in the batch
    rows: torch.Tensor | slice
    mask: torch.Tensor  # [b, 1, 1, attn_len] bool
    attn_len: int


@dataclass(frozen=True, slots=True)
class ExtendInputs:
    """What every layer of one extend step shares: each row gets a chunk of up to T tokens.

    ``valid`` marks the real tokens of the right-padded chunks; their K/V are written at
    ``write_rows``/``write_positions`` (in ``valid``'s row-major order). Padding queries repeat a
    row's last real position, so they stay in range and are simply dropped.
    """

    rows: torch.Tensor  # [n] KV-cache rows
    valid: torch.Tensor  # [n, T] bool
    write_rows: torch.Tensor  # [N real tokens]
    write_positions: torch.Tensor  # [N real tokens]
    cos: torch.Tensor
    sin: torch.Tensor
    mask: torch.Tensor  # [n, 1, T, attn_len] bool: causal over prefix + chunk, sliding window
    attn_len: int
    scale: float
    row_slice: slice | None


class DecoderLayer(nn.Module):
    """One pre-norm block. Head counts are attributes so a tensor-parallel shard can hold fewer.

    ``prefill_step``/``decode_step`` are the whole block; the model loops over them, so a layer
    with the same two methods (``parallel.tp_model.ShardedDecoderLayer``) can stand in for it.
    Every matmul goes through ``quant.linear``, so a weight named in ``linear_weights`` may be a
    dense tensor or a ``QuantizedLinear`` (``models.quantize.quantize_model``).
    """

    # The [out, in] matmul weights (a 3-D one is one matrix per expert); biases and norms stay dense.
    linear_weights: ClassVar[tuple[str, ...]] = ("wqkv", "wo", "w_gate_up", "w_down")

    def __init__(self, args: ModelArgs, n_heads: int, n_kv_heads: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, args.head_dim
        self.eps = args.rms_norm_eps
        qkv_out = (n_heads + 2 * n_kv_heads) * args.head_dim
        self.input_norm = param((args.hidden_size,), dtype)
        self.post_norm = param((args.hidden_size,), dtype)
        self.wqkv = param((qkv_out, args.hidden_size), dtype)
        self.bqkv = param((qkv_out,), dtype) if args.attention_bias else None
        self.wo = param((args.hidden_size, n_heads * args.head_dim), dtype)
        self.bo = param((args.hidden_size,), dtype) if args.attention_bias else None
        self.init_mlp(args, dtype)

    def init_mlp(self, args: ModelArgs, dtype: torch.dtype) -> None:
        """The feed-forward weights; a subclass with another MLP (``mixtral``) overrides this and ``mlp``."""
        self.w_gate_up = param((2 * args.intermediate_size, args.hidden_size), dtype)
        self.b_gate_up = param((2 * args.intermediate_size,), dtype) if args.mlp_bias else None
        self.w_down = param((args.hidden_size, args.intermediate_size), dtype)
        self.b_down = param((args.hidden_size,), dtype) if args.mlp_bias else None

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[B, T, hidden] -> q [B, H, T, D], k and v [B, KVH, T, D]."""
        b, t, _ = x.shape
        h = rms_norm(x, self.input_norm, self.eps)
        qkv = linear(h, self.wqkv, self.bqkv).view(b, t, self.n_heads + 2 * self.n_kv_heads, self.head_dim)
        q, k, v = qkv.split([self.n_heads, self.n_kv_heads, self.n_kv_heads], dim=2)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def attn_out(self, attn: torch.Tensor) -> torch.Tensor:
        """[B, H, T, D] -> [B, T, hidden] (partial sum under tensor parallelism)."""
        b, _, t, _ = attn.shape
        return linear(attn.transpose(1, 2).reshape(b, t, -1), self.wo, self.bo)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        h = rms_norm(x, self.post_norm, self.eps)
        gate, up = linear(h, self.w_gate_up, self.b_gate_up).chunk(2, dim=-1)
        return linear(F.silu(gate) * up, self.w_down, self.b_down)

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
        self, x: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor, step: ExtendInputs
    ) -> torch.Tensor:
        """[n, T, hidden] -> next hidden; writes the chunk's K/V into the cache first, then attends
        over the row's first ``attn_len`` positions (cached prefix + this chunk)."""
        q, k, v = self.qkv(x)
        q, k = apply_rotary(q, step.cos, step.sin), apply_rotary(k, step.cos, step.sin)
        k_new, v_new = k.transpose(1, 2)[step.valid], v.transpose(1, 2)[step.valid]
        write_step(k_layer, v_layer, step.write_rows, step.write_positions, k_new, v_new)
        rows = step.row_slice if step.row_slice is not None else step.rows
        k_all, v_all = k_layer[rows, :, : step.attn_len], v_layer[rows, :, : step.attn_len]
        attn = F.scaled_dot_product_attention(
            q, k_all, v_all, attn_mask=step.mask, scale=step.scale, enable_gqa=True
        )
        x = x + self.attn_out(attn)
        return x + self.mlp(x)


def grouped_decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """One query per row against a cache slice, without expanding KV heads.

    q: [B, H, 1, D]; k, v: [B, KVH, L, D] (views into the cache: strided, never copied);
    mask: [B, 1, 1, L] bool (True = attend). torch's fused CPU kernel reads the strided slices in
    place; the matmul/softmax form copied K and V every layer, and was 2-6x slower in bf16 and at
    batch 1 (SmolLM2's shapes on AVX-512), about even in fp32 at batch 32.
    """
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


class LlamaForCausalLM(nn.Module):
    """Llama/Mistral weights plus ``prefill`` and ``decode`` over an external KV cache.

    Invariant: the model never owns cache state; given the same cache contents and inputs it
    returns the same logits whatever other rows hold.
    """

    layer_cls: ClassVar[type[DecoderLayer]] = DecoderLayer  # Mixtral swaps in its MoE layer

    def __init__(self, args: ModelArgs, n_positions: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.args, self.dtype, self.n_positions = args, dtype, n_positions
        self.embed = nn.Parameter(
            torch.zeros(args.vocab_size, args.hidden_size, dtype=dtype), requires_grad=False
        )
        self.layers = nn.ModuleList(
            self.layer_cls(args, args.n_heads, args.n_kv_heads, dtype) for _ in range(args.n_layers)
        )
        self.norm = nn.Parameter(torch.zeros(args.hidden_size, dtype=dtype), requires_grad=False)
        self.lm_head = (
            self.embed
            if args.tie_word_embeddings
            else nn.Parameter(
                torch.zeros(args.vocab_size, args.hidden_size, dtype=dtype), requires_grad=False
            )
        )
        self.rotary = Rotary(args.rope, args.head_dim, args.max_position_embeddings, n_positions)
        self.scale = args.head_dim**-0.5

    def make_cache(self, n_rows: int, n_positions: int) -> KVCache:
        """The KV cache this model decodes against (a tensor-parallel model returns one per rank)."""
        a = self.args
        return KVCache(a.n_layers, n_rows, a.n_kv_heads, n_positions, a.head_dim, dtype=self.dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(rms_norm(hidden, self.norm, self.args.rms_norm_eps), self.lm_head).float()

    @property
    def supports_extend(self) -> bool:
        """Whether ``extend`` applies: every layer has ``extend_step`` (a tensor-parallel model's
        sharded layers do not), and the rope tables do not depend on the whole sequence's length
        (``dynamic`` does, so a prompt prefilled in chunks would be rotated differently)."""
        layers_extend = all(isinstance(layer, DecoderLayer) for layer in self.layers)
        return layers_extend and self.rotary.spec.kind != "dynamic"

    def window_mask(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """Causal (and sliding-window) visibility, True where query at q_pos may see key at k_pos."""
        mask = k_pos <= q_pos
        if self.args.sliding_window is not None:
            mask &= k_pos > q_pos - self.args.sliding_window
        return mask

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
        cos, sin = self.rotary.lookup(positions.expand(n, t), seq_lens=lengths)
        mask = self.window_mask(positions[:, None], positions[None, :])
        last = (torch.arange(n), torch.tensor(lengths) - 1)
        return self._encode(tokens, cos, sin, mask, last)

    @torch.inference_mode()
    def prefill_at(
        self, tokens: torch.Tensor, positions: torch.Tensor, last: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Encode one row ``tokens`` [1, T] whose rotary positions are ``positions`` [T] while attention
        stays causal by index, and return the logits of index ``last`` with the keys/values of every
        index: a compiled graph's right-padded context encoding, whose padding carries made-up
        positions (NxD Inference's contract model reproduces what such padding writes)."""
        index = torch.arange(tokens.shape[1])
        cos, sin = self.rotary.lookup(positions[None, :])
        mask = self.window_mask(index[:, None], index[None, :])
        return self._encode(tokens, cos, sin, mask, (torch.tensor([0]), torch.tensor([last])))

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
        cos, sin = self.rotary.lookup(positions)
        same = segments[:, :, None] == segments[:, None, :]
        mask = (self.window_mask(positions[:, :, None], positions[:, None, :]) & same).unsqueeze(1)
        return self._encode(tokens, cos, sin, mask, last)

    def _encode(
        self,
        tokens: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        last: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = F.embedding(tokens, self.embed)
        keys, values = [], []
        for layer in self.layers:
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
        cos, sin = self.rotary.lookup(positions[:, None], seq_lens=(positions + 1).tolist())
        mask = self.window_mask(positions[:, None], torch.arange(attn_len)[None, :]).view(b, 1, 1, attn_len)
        row_slice = _contiguous(rows)
        one_slice = row_slice is not None
        groups = self._attention_groups(rows, positions, attn_lens, one_slice) if attn_lens else ()
        step = DecodeInputs(rows, positions, cos, sin, mask, attn_len, self.scale, row_slice, groups)
        x = F.embedding(tokens[:, None], self.embed)
        for i, layer in enumerate(self.layers):
            x = layer.decode_step(x, k_cache[i], v_cache[i], step)
        return self.logits(x[:, 0])

    def _attention_groups(
        self, rows: torch.Tensor, positions: torch.Tensor, attn_lens: list[int], one_slice: bool
    ) -> tuple[AttentionGroup, ...]:
        """Rows grouped by length bucket, or none (one attention over ``max(attn_lens)``). When the
        rows are one slice of the cache, that one attention reads it in place, while groups gather
        (copy) their rows; so groups are used there only where they read under half as much."""
        if len(set(attn_lens)) < 2:
            return ()
        if one_slice and 2 * sum(attn_lens) >= len(attn_lens) * max(attn_lens):
            return ()
        groups = []
        lens = torch.tensor(attn_lens)
        for length in sorted(set(attn_lens)):
            index = (lens == length).nonzero()[:, 0]
            pos = positions[index]
            mask = self.window_mask(pos[:, None], torch.arange(length)[None, :]).view(-1, 1, 1, length)
            g_rows = rows[index]
            groups.append(AttentionGroup(index, _contiguous(g_rows) or g_rows, mask, length))
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
    ) -> torch.Tensor:
        """Append right-padded chunks ``tokens`` [n, T] to ``rows``, which hold ``starts`` positions.

        Row i's chunk fills positions ``starts[i] .. starts[i] + lengths[i] - 1``, attending causally
        over its cached prefix and itself (the sliding window respected); returns the logits of each
        chunk's last token [n, vocab]. ``attn_len`` >= every ``starts[i] + lengths[i]``.
        """
        n, t = tokens.shape
        lengths_t = torch.tensor(lengths, dtype=torch.long)
        ends = starts + lengths_t
        valid = torch.arange(t)[None, :] < lengths_t[:, None]
        positions = torch.where(valid, starts[:, None] + torch.arange(t)[None, :], (ends - 1)[:, None])
        cos, sin = self.rotary.lookup(positions, seq_lens=ends.tolist())
        mask = self.window_mask(positions[:, :, None], torch.arange(attn_len)[None, None, :]).unsqueeze(1)
        step = ExtendInputs(
            rows, valid, rows.repeat_interleave(lengths_t), positions[valid], cos, sin, mask,
            attn_len, self.scale, _contiguous(rows),
        )  # fmt: skip
        x = F.embedding(tokens, self.embed)
        for i, layer in enumerate(self.layers):
            x = layer.extend_step(x, k_cache[i], v_cache[i], step)
        return self.logits(x[torch.arange(n), lengths_t - 1])


def _contiguous(rows: torch.Tensor) -> slice | None:
    """A slice when ``rows`` is an ascending run (the common case: rows are handed out lowest first)."""
    first, n = int(rows[0]), rows.shape[0]
    if int(rows[-1]) - first + 1 == n and bool((rows[1:] > rows[:-1]).all()):
        return slice(first, first + n)
    return None
