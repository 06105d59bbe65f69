"""Dense matmul weights pre-packed for oneDNN: the CPU engine's serving default.

``F.linear`` reads an ``[out, in]`` weight in its stored row-major layout and re-blocks it on every
call; oneDNN's packed (blocked) layout is made once at load, and each call runs the GEMM kernel on
it directly. In the whole SmolLM2 decode step that paid in bf16 and not in fp32
(docs/measurements.md), so only bf16 is packed here (fp32's compiled graphs multiply on packs of
their own: ``models.packed_linear``).
:func:`pack_model` is a transform applied after loading, like ``quantize.quantize_model``: every
dense 2-D weight a layer names in ``linear_weights``, and ``lm_head``, becomes a
:class:`PackedLinear`; ``quant.linear`` calls it like any weight module.
In bf16 packed results matched ``F.linear`` bit for bit on these shapes (the same oneDNN kernel
behind both); ``CpuEngineOptions.pack_weights=False`` keeps plain tensors.
"""

from __future__ import annotations

import torch
from torch import nn

from neuron_lmi.models.quant import replace_weight

PACK_ROWS_HINT = 32  # oneDNN picks its blocked layout for this many input rows; any count works


def packing_pays(dtype: torch.dtype) -> bool:
    """Whether packing is used for ``dtype`` on this host: bf16 where oneDNN runs it natively."""
    if dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return False
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedLinear(nn.Module):
    """``x @ weight.T`` with ``weight`` held in oneDNN's blocked layout (no bias: ``quant.linear``
    adds it, as for the quantized weights)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        if weight.dim() != 2:
            raise ValueError(f"PackedLinear takes a 2-D [out, in] weight, got {tuple(weight.shape)}")
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_ROWS_HINT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")

    def dequantize(self) -> torch.Tensor:
        """The weight as a plain ``[out, in]`` tensor (what ``quant`` modules also offer)."""
        return self.packed.to_dense()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, dtype={self.dtype}"


def _pack_attr(owner: nn.Module, name: str) -> int:
    weight = getattr(owner, name)
    # Quantized weights are modules already; a 3-D expert stack is indexed per expert by the MoE.
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return 0
    replace_weight(owner, name, PackedLinear(weight))
    return 1


@torch.no_grad()
def pack_model(model: nn.Module) -> int:
    """Pack ``model``'s dense matmul weights in place; returns how many were packed (0 unless
    :func:`packing_pays` for the model's dtype). ``lm_head`` tied to the embedding gets its own packed
    copy (the lookup needs the plain table): vocab x hidden more memory, for the widest matmul."""
    dtype = getattr(model, "dtype", torch.float32)
    if not packing_pays(dtype):
        return 0
    count = 0
    for module in list(model.modules()):
        for name in getattr(type(module), "linear_weights", ()):
            count += _pack_attr(module, name)
    if hasattr(model, "lm_head"):
        count += _pack_attr(model, "lm_head")
    return count
