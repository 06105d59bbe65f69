"""What one step's attention needs, shared by every layer of the Llama-family model
(``llama.LlamaForCausalLM``): the causal/sliding-window mask, the per-step inputs of decode and
extend, the attention kinds (layers sharing a window and rotary table) and the decode attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from neuron_lmi.models.rope import Rotary


def causal_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """True where a query at ``q_pos`` may see a key at ``k_pos``: causal, and within ``window``
    positions of the query (itself included) when one is given."""
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask


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


@dataclass(frozen=True, slots=True)
class AttentionKind:
    """What the layers of one kind share: their sliding window (None: full attention) and rotary
    table. Llama/Mistral have one kind; Gemma 3 two (windowed local layers, full global ones)."""

    window: int | None
    rotary: Rotary


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


def contiguous_rows(rows: torch.Tensor) -> slice | None:
    """A slice when ``rows`` is an ascending run (the common case: rows are handed out lowest first)."""
    first, n = int(rows[0]), rows.shape[0]
    if int(rows[-1]) - first + 1 == n and bool((rows[1:] > rows[:-1]).all()):
        return slice(first, first + n)
    return None
