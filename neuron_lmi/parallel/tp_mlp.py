"""How each layer's MLP splits over tensor-parallel ranks; ``tp_model`` looks it up by layer class.

Both kinds are Megatron's column/row split of the intermediate dimension ``I``: rank ``r`` holds
rows ``[r*ceil(I/tp), (r+1)*ceil(I/tp))`` of gate and up (zero-padded past ``I``, as the library
pads) and the same columns of down, so its output is a partial sum and the ranks' sum (the
all-reduce) is the whole MLP::

    dense (Llama/Mistral)   gate|up rows of the slice ─ silu·up ─ down columns of the slice ─ Σ ranks
    sparse MoE (Mixtral)    router replicated on every rank (all ranks pick the same experts);
                            every expert split as above: w1|w3 rows, w2 columns ─ Σ ranks

The MoE split is NxD Inference's default (tensor parallelism inside every expert, no expert
parallelism): ``neuronx_distributed.modules.moe`` builds experts from
``ExpertFusedColumnParallelLinear`` (gate_up) and ``ExpertFusedRowParallelLinear`` (down).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from neuron_lmi.models.llama import DecoderLayer
from neuron_lmi.models.mixtral import MixtralDecoderLayer


@dataclass(frozen=True, slots=True)
class MlpSlice:
    """Rank ``rank``'s rows ``[lo, hi)`` of the intermediate dimension, padded to ``size`` rows."""

    rank: int
    lo: int
    hi: int
    size: int


def mlp_slice(intermediate_size: int, tp_degree: int, rank: int) -> MlpSlice:
    size = math.ceil(intermediate_size / tp_degree)
    lo = min(rank * size, intermediate_size)
    return MlpSlice(rank, lo, min(lo + size, intermediate_size), size)


def take_rows(t: torch.Tensor, s: MlpSlice) -> torch.Tensor:
    """``t[s.lo:s.hi]`` zero-padded to ``s.size`` rows (the library pads the MLP the same way)."""
    out = t.new_zeros(s.size, *t.shape[1:])
    out[: s.hi - s.lo] = t[s.lo : s.hi]
    return out


def _gate_up_rows(fused: torch.Tensor, s: MlpSlice) -> torch.Tensor:
    gate, up = fused.chunk(2)
    return torch.cat([take_rows(gate, s), take_rows(up, s)])


@torch.no_grad()
def shard_dense_mlp(src: DecoderLayer, dst: DecoderLayer, s: MlpSlice) -> None:
    dst.w_gate_up.copy_(_gate_up_rows(src.w_gate_up, s))
    dst.w_down.copy_(take_rows(src.w_down.t(), s).t())
    if src.b_gate_up is not None and dst.b_gate_up is not None:
        dst.b_gate_up.copy_(_gate_up_rows(src.b_gate_up, s))
    # The output bias is added once after the all-reduce: rank 0 carries it, the others zero.
    if src.b_down is not None and dst.b_down is not None and s.rank == 0:
        dst.b_down.copy_(src.b_down)


@torch.no_grad()
def shard_moe_mlp(src: MixtralDecoderLayer, dst: MixtralDecoderLayer, s: MlpSlice) -> None:
    dst.router = src.router  # replicated: shared, not copied
    for e in range(src.experts_gate_up.shape[0]):
        dst.experts_gate_up[e].copy_(_gate_up_rows(src.experts_gate_up[e], s))
        dst.experts_down[e].copy_(take_rows(src.experts_down[e].t(), s).t())


# Layer class -> how its MLP weights split. Register a new MLP kind here, not as a branch.
MLP_SHARDERS: dict[type[DecoderLayer], Callable[..., None]] = {
    DecoderLayer: shard_dense_mlp,
    MixtralDecoderLayer: shard_moe_mlp,
}
