"""``torch.ops.neuron_lmi.lora_delta``: a projection's output plus each line's LoRA update, for a
batch whose lines use different adapters (``models.lora``).

``y`` ``[lines, ..., out]`` is the base projection of ``x`` ``[lines, ..., in]``; ``slots`` int64
``[lines]`` names each line's adapter slot (-1: the base model alone); ``a`` ``[slots, R, in]`` (A)
and ``b`` ``[slots, R, out]`` (B transposed, so the kernel's second product runs along the output)
hold every slot's adapter, zero-padded to the rank room ``R``. The result is ``y`` with
``(x[l] a[s]^T) b[s]`` added to every line ``l`` of slot ``s``: one matmul pair per slot
present, over that slot's lines together (a run of consecutive lines is read in place), nothing
for a line of the base model.

One op in the eager model and in the compiled step graph, so both compute the same update and the
compiled graph takes the adapters as inputs (its base weights stay frozen constants; the slots are
rewritten in place when an adapter moves in). The C++ kernel (``lora_delta.cpp``) does in one call
what the Python kernel does op by op; Inductor calls it as an extern kernel.
"""

from __future__ import annotations

import torch

_library = torch.library.Library("neuron_lmi", "FRAGMENT")
_library.define("lora_delta(Tensor y, Tensor x, Tensor slots, Tensor a, Tensor b) -> Tensor")


@torch.library.register_fake("neuron_lmi::lora_delta", lib=_library)
def _delta_shape(
    y: torch.Tensor, x: torch.Tensor, slots: torch.Tensor, a: torch.Tensor, b: torch.Tensor
) -> torch.Tensor:
    return torch.empty_like(y, memory_format=torch.contiguous_format)


def reference(
    y: torch.Tensor, x: torch.Tensor, slots: torch.Tensor, a: torch.Tensor, b: torch.Tensor
) -> torch.Tensor:
    """What the op computes, op by op in torch: the Python kernel."""
    out = y.contiguous().clone()
    for slot in torch.unique(slots).tolist():
        if slot < 0:
            continue
        lines = torch.nonzero(slots == slot).flatten()
        delta = (x.index_select(0, lines) @ a[slot].T) @ b[slot]
        out.index_add_(0, lines, delta.to(out.dtype))
    return out


def register_python_kernels() -> None:
    """``reference`` as the op's kernel, where the native one did not build (``ops.kernels``)."""
    _library.impl("lora_delta", reference, "CPU")
