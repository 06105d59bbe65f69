"""``torch.ops.neuron_lmi.draw_from_logits``: the sampler's draw, one token per row of logits.

A sampled row's token comes from softmax(logits) by inverse CDF, with one uniform number from the
request's own generator. Done as softmax, then a CDF, it writes the ``[B, vocab]`` probabilities and
reads them again: at 64 rows of a 49,152-token vocabulary that was most of the engine's host time per
step (docs/measurements.md). The C++ kernel (``token_draw.cpp``) takes the row's maximum, sums the
unnormalised weights ``exp(x - max)`` per block of 256 tokens, finds the block the draw lands in and
scans only that block's weights again; nothing of vocabulary size is written. Masked tokens (``-inf``)
weigh 0 and are never drawn. Its ``exp`` is a polynomial (relative error about 2e-7), so a draw that
lands within that of a token boundary may pick the neighbour the Python kernel would not; a seeded
request draws the same tokens run after run with either.

Inputs: ``logits`` fp32 ``[B, V]`` (temperature applied, filtered tokens ``-inf``), ``uniform`` fp32
``[B]`` in ``[0, 1)``. Output int64 ``[B]``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_library = torch.library.Library("neuron_lmi", "FRAGMENT")
_library.define("draw_from_logits(Tensor logits, Tensor uniform) -> Tensor")

DRAW_BLOCKS = (256, 128, 64, 32)  # block sizes of the two-level CDF (the first that divides vocab)


@torch.library.register_fake("neuron_lmi::draw_from_logits", lib=_library)
def _draw_shape(logits: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    return logits.new_empty(logits.shape[:1], dtype=torch.long)


def draw(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` ``[B, V]`` by inverse CDF at ``uniform`` ``[B]``: the Python
    kernel's draw.

    The CDF is two-level (sums of blocks of ``DRAW_BLOCKS[i]`` tokens, then a scan of the one block the
    draw lands in), which reads ``probs`` once instead of writing a ``[B, vocab]`` prefix sum.
    """
    u = uniform
    n, vocab = probs.shape
    block = next((b for b in DRAW_BLOCKS if vocab % b == 0 and vocab > b), 0)
    if not block:
        cdf = probs.cumsum(dim=-1)
        target = (1.0 - u)[:, None] * cdf[:, -1:]  # in (0, total]: never lands on a zero-mass token
        return torch.searchsorted(cdf, target).clamp_(max=vocab - 1)[:, 0]
    blocks = probs.view(n, vocab // block, block)
    cdf = blocks.sum(dim=-1).cumsum(dim=-1)  # [n, vocab / block]
    target = (1.0 - u)[:, None] * cdf[:, -1:]
    b = torch.searchsorted(cdf, target).clamp_(max=cdf.shape[1] - 1)  # [n, 1]: the block
    before = torch.where(b > 0, cdf.gather(1, (b - 1).clamp_(min=0)), torch.zeros_like(target))
    inner = blocks.gather(1, b[:, :, None].expand(n, 1, block))[:, 0].cumsum(dim=-1)  # [n, block]
    # Rounding between the block sums and the scan must not land on a zero-mass token at either end.
    rest = torch.minimum(target - before, inner[:, -1:]).clamp_(min=torch.finfo(probs.dtype).tiny)
    return (b * block + torch.searchsorted(inner, rest))[:, 0]


def reference(logits: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """What the op computes, in torch: softmax, then ``draw``. The Python kernel."""
    return draw(torch.softmax(logits, dim=-1), uniform)


def register_python_kernels() -> None:
    """``reference`` as the op's kernel, where the native one did not build (``ops.kernels``)."""
    _library.impl("draw_from_logits", reference, "CPU")


def draw_from_logits(logits: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One token per row of ``logits`` ``[B, V]`` (fp32), row i drawn with one uniform number from
    ``generators[i]`` (None: torch's default generator). The op's kernel is registered by
    ``ops.kernels`` (the sampler calls it)."""
    uniform = torch.cat([torch.rand(1, generator=g) for g in generators])
    return torch.ops.neuron_lmi.draw_from_logits(logits, uniform)
