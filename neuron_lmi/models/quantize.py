"""``option.quantize`` on the CPU engine: weight-only int8/int4 as a transform of a loaded model.

Like ``parallel.tp_model.apply_tensor_parallel`` (and after it, so every rank's shard is quantized),
:func:`quantize_model` swaps weights in place and leaves the model code alone: each weight a layer
names in ``linear_weights`` becomes a ``QuantizedLinear`` (a 3-D expert stack becomes one per expert)
and so does ``lm_head``. Embedding lookups, norms, biases and the MoE router stay dense.

    method  layers                               lm_head
    int8    int8 per output row                  int8 per output row
    int4    int4, groups of 32 along K, min/max  int8 per output row (as llama.cpp's Q4 files keep
                                                 their output/embedding tensor in Q6_K/Q8_0)

Weights already quantized at load are kept as they are (with int4, the engine builder loads a GGUF
file's Q4_0/Q4_1 codes straight into ``Int4Linear`` modules, and Q8_0 ones as int8 per row); a weight
whose shape no CPU kernel takes (``quant.kernel_fits``) stays dense.
"""

from __future__ import annotations

import torch
from torch import nn

from neuron_lmi.models.quant import (
    Int4Linear,
    Int8Linear,
    QuantizedLinear,
    kernel_fits,
    quantize_int4,
    quantize_int8,
    replace_weight,
)

METHODS = ("int8", "int4")
HEAD_METHOD = {"int8": "int8", "int4": "int8"}


def quantize_weight(weight: torch.Tensor, method: str) -> QuantizedLinear | None:
    """``weight`` [out, in] as ``method``'s kernel holder, int8 where int4 does not fit, or None."""
    n, k = weight.shape
    if method == "int4" and kernel_fits(4, n, k):
        return Int4Linear(quantize_int4(weight))
    if kernel_fits(8, n, k):
        return Int8Linear(quantize_int8(weight))
    return None


def _quantize_attr(owner: nn.Module, name: str, method: str) -> None:
    weight = getattr(owner, name)
    if not isinstance(weight, torch.Tensor):  # quantized already (at load, or a second call)
        return
    if weight.dim() == 3:  # one matrix per expert
        experts = [quantize_weight(w, method) for w in weight]
        if all(e is not None for e in experts):
            replace_weight(owner, name, nn.ModuleList(experts))
        return
    quantized = quantize_weight(weight, method)
    if quantized is not None:
        replace_weight(owner, name, quantized)


@torch.no_grad()
def quantize_model(model: nn.Module, method: str) -> nn.Module:
    """Quantize ``model``'s matmul weights in place with ``method`` (``int8`` or ``int4``); returns it."""
    if method not in METHODS:
        raise ValueError(
            f"quantize={method!r} is not supported on the CPU engine (use {' or '.join(METHODS)}; "
            "fp8 and static_int8 are Neuron-only)"
        )
    for module in list(model.modules()):
        for name in getattr(type(module), "linear_weights", ()):
            _quantize_attr(module, name, method)
    _quantize_attr(model, "lm_head", HEAD_METHOD[method])
    return model
