"""Rotary position embeddings with the scaling types Llama/Mistral checkpoints use.

Frequencies follow the published formulas (linear: Chen et al. 2023; dynamic NTK: bloc97;
llama3: Meta's Llama 3.1 release; yarn: Peng et al. 2023). ``dynamic`` depends on the sequence
length, so its tables are computed per sequence from that sequence's current length, which is
what a single-sequence Hugging Face ``generate`` does and keeps the result batch-invariant.
"""

from __future__ import annotations

import math

import torch

from neuron_lmi.models.args import RopeSpec


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    return 1.0 / (theta**exponents)


def _llama3_inv_freq(inv_freq: torch.Tensor, spec: RopeSpec, max_pos: int) -> torch.Tensor:
    original = spec.original_max_position_embeddings or max_pos
    low_wavelen = original / spec.low_freq_factor
    high_wavelen = original / spec.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / spec.factor, inv_freq)
    smooth = (original / wavelen - spec.low_freq_factor) / (spec.high_freq_factor - spec.low_freq_factor)
    smoothed = (1 - smooth) * scaled / spec.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(spec: RopeSpec, dim: int, max_pos: int) -> tuple[torch.Tensor, float]:
    original = spec.original_max_position_embeddings or max_pos
    factor = spec.factor
    attention = spec.attention_factor
    if attention is None:
        attention = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(spec.theta))

    low = max(math.floor(correction_dim(spec.beta_fast)), 0)
    high = min(math.ceil(correction_dim(spec.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = (torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)
    extrapolation_weight = 1 - ramp.clamp(0, 1)
    pos_freqs = spec.theta ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    extrapolated = 1.0 / pos_freqs
    interpolated = 1.0 / (factor * pos_freqs)
    inv = interpolated * (1 - extrapolation_weight) + extrapolated * extrapolation_weight
    return inv, float(attention)


class Rotary:
    """Cos/sin tables for positions ``0 .. n_positions-1`` and their lookup per token."""

    def __init__(self, spec: RopeSpec, head_dim: int, max_position_embeddings: int, n_positions: int) -> None:
        self.spec = spec
        self.dim = head_dim
        self.max_pos = max_position_embeddings
        self.scaling = 1.0
        inv = _base_inv_freq(spec.theta, head_dim)
        if spec.kind == "linear":
            inv = inv / spec.factor
        elif spec.kind == "llama3":
            inv = _llama3_inv_freq(inv, spec, max_position_embeddings)
        elif spec.kind == "yarn":
            inv, self.scaling = _yarn_inv_freq(spec, head_dim, max_position_embeddings)
        self.inv_freq = inv
        self.cos, self.sin = self._table(inv, torch.arange(n_positions))

    def _table(self, inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.scaling, emb.sin() * self.scaling

    def _dynamic_inv_freq(self, seq_len: int) -> torch.Tensor:
        base = self.spec.theta * ((self.spec.factor * seq_len / self.max_pos) - (self.spec.factor - 1)) ** (
            self.dim / (self.dim - 2)
        )
        return _base_inv_freq(base, self.dim)

    def lookup(
        self, positions: torch.Tensor, seq_lens: list[int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for ``positions`` (any shape, batch first); ``seq_lens`` per batch row for ``dynamic``."""
        cos, sin = self.cos[positions], self.sin[positions]
        if self.spec.kind != "dynamic" or seq_lens is None:
            return cos, sin
        cos, sin = cos.clone(), sin.clone()
        for i, seq_len in enumerate(seq_lens):
            if seq_len > self.max_pos:
                cos[i], sin[i] = self._table(self._dynamic_inv_freq(seq_len), positions[i])
        return cos, sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x``: [..., heads, T, head_dim]; ``cos``/``sin``: [..., T, head_dim] broadcast over heads."""
    cos = cos.unsqueeze(-3).to(x.dtype)
    sin = sin.unsqueeze(-3).to(x.dtype)
    return x * cos + rotate_half(x) * sin
