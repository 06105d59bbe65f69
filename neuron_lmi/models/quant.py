"""Weight-only int8/int4 linear weights for the CPU engine, and the one ``linear`` every layer calls.

A weight is either a dense tensor ``[out, in]`` (``F.linear``) or a :class:`QuantizedLinear` holding
packed codes for one of torch's CPU kernels::

    method  codes                                 scales                          kernel (aten)
    int8    int8 [N, K], symmetric per row        [N]                             _weight_int8pack_mm
    int4    4-bit [N, K] in groups of 32 along K  (scale, zero) [K/32, N, 2]      _weight_int4pack_mm_for_cpu
            w = (q - 8) * scale + zero, q in 0..15 (asymmetric: GGUF Q4_1's q*d + m is zero = m + 8d)

:class:`QuantizedTensor` is the kernel-free form (codes + per-group scale/zero) that quantizers and
the GGUF reader produce; it concatenates and permutes by rows like a weight, so the loader fuses
q|k|v and gate|up the same way for both. Quantizing a model is a transform applied after loading
(``neuron_lmi.models.quantize``), never a second copy of the model code.

Activations: torch 2.13's fp32 paths of both kernels are scalar loops (5-25x slower than their bf16
paths, measured on AVX-512), so a quantized linear computes in bf16 and hands back the caller's dtype.
Both kernels are matrix-vector loops, fast for decode but linear in the number of input rows, so
from ``gemm_min_rows`` rows on (prefill) the weight is dequantized to bf16 for one GEMM instead.
The compiled decode traces the kernels whatever the row count (``tracing_packed_kernels``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

INT4_GROUP_SIZES = (32, 64, 128, 256)  # what _weight_int4pack_mm_for_cpu accepts
COMPUTE_DTYPE = torch.bfloat16
_tracing_kernels = False
# (the weights' dtype, the kernel) while a graph is traced with packed GEMMs: ``dense_linear_kernel``.
_dense_kernel: tuple[torch.dtype, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] | None = None


@contextmanager
def tracing_packed_kernels() -> Iterator[None]:
    """While tracing a graph whose number of input rows is dynamic (the compiled decode), every
    ``QuantizedLinear`` runs its packed kernel instead of choosing by row count: a branch on a
    symbolic size would pin the graph to one side of ``gemm_min_rows``."""
    global _tracing_kernels
    previous, _tracing_kernels = _tracing_kernels, True
    try:
        yield
    finally:
        _tracing_kernels = previous


@contextmanager
def dense_linear_kernel(
    kernel: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], dtype: torch.dtype
) -> Iterator[None]:
    """While tracing a graph, ``linear`` multiplies 2-D dense weights of ``dtype`` with
    ``kernel(x, weight)`` instead of ``F.linear`` (``packed_linear.tracing_packed_linears``)."""
    global _dense_kernel
    previous, _dense_kernel = _dense_kernel, (dtype, kernel)
    try:
        yield
    finally:
        _dense_kernel = previous


@dataclass(frozen=True)
class QuantizedTensor:
    """A ``[N, K]`` weight as codes and per-group scales: ``w[n, k] = (codes - offset) * scale + zero``
    with ``g = k // group_size`` indexing ``scale``/``zero`` (``[N, K / group_size]``, fp32).

    ``bits`` 4: codes uint8 in 0..15, offset 8, ``zero`` given. ``bits`` 8: codes int8, offset 0,
    ``zero`` None (symmetric). Rows are independent, so row concatenation and permutation are exact.
    """

    bits: int
    group_size: int
    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None = None

    def __post_init__(self) -> None:
        n, k = self.codes.shape
        if self.bits not in (4, 8) or k % self.group_size:
            raise ValueError(f"bits={self.bits}, group_size={self.group_size} do not fit a [{n}, {k}] weight")
        groups = (n, k // self.group_size)
        if tuple(self.scale.shape) != groups or (self.zero is not None and tuple(self.zero.shape) != groups):
            raise ValueError(f"scale/zero must be {groups} for codes {(n, k)}, got {tuple(self.scale.shape)}")
        if (self.bits == 4) != (self.zero is not None):
            raise ValueError("4-bit codes need a zero per group; 8-bit codes are symmetric (no zero)")

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.codes.shape
        q = self.codes.float().view(n, -1, self.group_size)
        if self.zero is None:
            w = q * self.scale[..., None]
        else:
            w = (q - 8) * self.scale[..., None] + self.zero[..., None]
        return w.view(n, k).to(dtype)

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> QuantizedTensor:
        """The same weight with ``fn`` (a permutation or selection of rows) applied to every part."""
        zero = None if self.zero is None else fn(self.zero).contiguous()
        return QuantizedTensor(self.bits, self.group_size, fn(self.codes).contiguous(), fn(self.scale), zero)


def cat_rows(parts: Sequence[torch.Tensor | QuantizedTensor]) -> torch.Tensor | QuantizedTensor:
    """Stack weights along rows (fused q|k|v, gate|up). Quantized parts of one format stay quantized;
    a mix (a GGUF file with Q6_K values beside Q4_1 keys, say) is dequantized and re-quantized to int8."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(parts)  # type: ignore[arg-type]
    first = parts[0]
    same = all(
        isinstance(p, QuantizedTensor) and (p.bits, p.group_size) == (first.bits, first.group_size)
        for p in parts
    )
    if same:
        qs: list[QuantizedTensor] = list(parts)  # type: ignore[arg-type]
        zero = None if first.zero is None else torch.cat([q.zero for q in qs])  # type: ignore[misc]
        codes, scale = torch.cat([q.codes for q in qs]), torch.cat([q.scale for q in qs])
        return QuantizedTensor(first.bits, first.group_size, codes, scale, zero)
    dense = torch.cat([p.dequantize() if isinstance(p, QuantizedTensor) else p.float() for p in parts])
    return quantize_int8(dense)


def quantize_int8(weight: torch.Tensor) -> QuantizedTensor:
    """Symmetric int8, one scale per output row (round to nearest, absmax / 127)."""
    w = weight.float()
    scale = (w.abs().amax(dim=1, keepdim=True) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    codes = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
    return QuantizedTensor(8, w.shape[1], codes, scale)


def quantize_int4(weight: torch.Tensor, group_size: int = 32) -> QuantizedTensor:
    """Asymmetric 4-bit in groups of ``group_size`` along K: min..max of a group onto codes 0..15."""
    n, k = weight.shape
    w = weight.float().view(n, k // group_size, group_size)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    scale = ((hi - lo) / 15).clamp(min=torch.finfo(torch.float32).tiny)
    codes = torch.round((w - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
    return QuantizedTensor(4, group_size, codes.view(n, k), scale, lo + 8 * scale)


class QuantizedLinear(nn.Module):
    """A packed ``[out_features, in_features]`` weight; ``forward(x)`` is ``x @ w.T`` in bf16, returned
    in ``x``'s dtype: the packed kernel below ``gemm_min_rows`` input rows, a dequantized bf16 GEMM
    from there on. Buffers only (no parameters), so ``state_dict``, ``torch.compile`` and export see
    the codes as constants."""

    # torch's packed kernels are matrix-vector loops whose time grows with every input row (at 64
    # rows 6-8x a bf16 GEMM); from this many rows on (prefill, large decode batches) dequantizing the
    # weight and running one GEMM is cheaper (the crossover measured on SmolLM2's shapes:
    # docs/measurements.md); below it the compiled step (up to ``gemm_min_rows - 1`` rows) covers a
    # full 32-row batch.
    gemm_min_rows = 40

    def __init__(self, out_features: int, in_features: int) -> None:
        super().__init__()
        self.out_features, self.in_features = out_features, in_features

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dequantize(self) -> torch.Tensor:
        """The weight in bf16, ``[out_features, in_features]``."""
        raise NotImplementedError

    def _gemm(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantize())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Python checks instead of no-op reshape/to calls: ~120 linears run per decoded token.
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        x2 = x2 if x2.dtype == COMPUTE_DTYPE else x2.to(COMPUTE_DTYPE)
        y = self._mm(x2) if _tracing_kernels or x2.shape[0] < self.gemm_min_rows else self._gemm(x2)
        if x.dim() != 2:
            y = y.view(*x.shape[:-1], self.out_features)
        return y if x.dtype == COMPUTE_DTYPE else y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"out_features={self.out_features}, in_features={self.in_features}"


class Int8Linear(QuantizedLinear):
    """int8 codes with one scale per output row (``aten._weight_int8pack_mm``)."""

    def __init__(self, q: QuantizedTensor) -> None:
        if q.bits != 8 or q.group_size != q.shape[1]:
            raise ValueError(f"Int8Linear needs per-row int8 codes, got bits={q.bits} group={q.group_size}")
        super().__init__(*q.shape)
        self.register_buffer("codes", q.codes.contiguous())
        self.register_buffer("scales", q.scale[:, 0].to(COMPUTE_DTYPE).contiguous())

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.codes, self.scales)

    def dequantize(self) -> torch.Tensor:
        return self.codes.to(COMPUTE_DTYPE) * self.scales[:, None]


class Int4Linear(QuantizedLinear):
    """4-bit groupwise codes with scale and zero per group (``aten._weight_int4pack_mm_for_cpu``).

    For the GEMM path the codes are read back from the kernel's own blocked layout (no second copy)
    and dequantized in it, where the per-group scales broadcast along a contiguous 64-row axis
    (broadcasting along 32-wide groups instead is 4-5x slower); ``N % 64 != 0`` or a layout this
    torch does not share keeps plain nibbles instead.
    """

    gemm_min_rows = 48  # dequantizing costs more than for int8

    def __init__(self, q: QuantizedTensor) -> None:
        if q.bits != 4 or q.group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"Int4Linear needs 4-bit codes, groups of 32..256; got {q.bits}/{q.group_size}")
        super().__init__(*q.shape)
        n, k = q.shape
        g = k // q.group_size
        self.group_size = q.group_size
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.codes.to(torch.int32), 1)
        self.register_buffer("packed", packed)
        scale_zero = torch.stack([q.scale.t(), q.zero.t()], dim=-1)  # type: ignore[union-attr]
        self.register_buffer("scale_zero", scale_zero.to(COMPUTE_DTYPE).contiguous())
        # Dequantized w = q * scale + (zero - 8 * scale): one fused multiply-add per element.
        scale, offset = q.scale, q.zero - 8 * q.scale  # type: ignore[operator]
        blocks = _blocked_codes(packed, n, k) if n % 64 == 0 else None
        self.blocked = blocks is not None and torch.equal(blocks.transpose(1, 2).reshape(n, k), q.codes)
        if self.blocked:  # [n / 64, G, 1, 64], matching the codes' [n / 64, G, group, 64]
            scale, offset = (t.view(n // 64, 64, g).transpose(1, 2)[:, :, None] for t in (scale, offset))
        else:
            scale, offset = scale[..., None], offset[..., None]  # [n, G, 1]
            codes = q.codes.view(n, -1, 2)
            self.register_buffer("nibbles", codes[..., 0] | (codes[..., 1] << 4))
        self.register_buffer("scale_groups", scale.to(COMPUTE_DTYPE).contiguous())
        self.register_buffer("offset_groups", offset.to(COMPUTE_DTYPE).contiguous())

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group_size, self.scale_zero)

    def _weight(self) -> torch.Tensor:
        """bf16 weight in the stored layout: blocked [n / 64, G, group, 64] or plain [n, G, group]."""
        n, k, gs = self.out_features, self.in_features, self.group_size
        if self.blocked:
            codes = _blocked_codes(self.packed, n, k).view(n // 64, k // gs, gs, 64)
        else:
            codes = torch.stack([self.nibbles & 15, self.nibbles >> 4], dim=-1).view(n, k // gs, gs)
        return torch.addcmul(self.offset_groups, codes.to(COMPUTE_DTYPE), self.scale_groups)

    def _gemm(self, x: torch.Tensor) -> torch.Tensor:
        n, k = self.out_features, self.in_features
        if not self.blocked:
            return F.linear(x, self._weight().view(n, k))
        y = torch.matmul(x, self._weight().view(n // 64, k, 64))  # [n / 64, rows, 64]
        return y.transpose(0, 1).reshape(x.shape[0], n)

    def dequantize(self) -> torch.Tensor:
        n, k = self.out_features, self.in_features
        w = self._weight()
        return w.view(n // 64, k, 64).transpose(1, 2).reshape(n, k) if self.blocked else w.view(n, k)


def _blocked_codes(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """uint8 codes [n / 64, k, 64] (transposed 64-row blocks) from ``_convert_weight_to_int4pack_for_cpu``
    for n % 64 == 0 (torch 2.13, x86): blocks of 64 rows stored k-major, one byte per k holding row r
    (low nibble) and row r + 32 (high nibble). ``Int4Linear`` checks it against the codes first."""
    blocks = packed.view(n // 64, k, 32)
    return torch.cat([blocks & 15, blocks >> 4], dim=-1)


def kernel_fits(bits: int, out_features: int, in_features: int, group_size: int = 32) -> bool:
    """Whether torch's CPU kernel takes this shape: int4 needs N % 16 == 0 and whole groups of
    32..256; int8 needs K % 32 == 0 (other K crash or return NaN in torch 2.13)."""
    if bits == 4:
        return out_features % 16 == 0 and group_size in INT4_GROUP_SIZES and in_features % group_size == 0
    return in_features % 32 == 0


def to_linear(q: QuantizedTensor) -> QuantizedLinear | torch.Tensor:
    """The kernel holder for ``q``; int8 codes in groups (GGUF Q8_0) are re-quantized per row, and a
    shape no kernel takes stays a dense fp32 tensor."""
    n, k = q.shape
    if q.bits == 4 and kernel_fits(4, n, k, q.group_size):
        return Int4Linear(q)
    if q.bits == 8 and q.group_size == k and kernel_fits(8, n, k):
        return Int8Linear(q)
    if kernel_fits(8, n, k):
        return Int8Linear(quantize_int8(q.dequantize()))
    return q.dequantize()


def matmul_weight_slots(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """``(owner, attribute)`` of every matmul weight: each module's ``linear_weights``, then
    ``lm_head``."""
    slots = [(m, name) for m in model.modules() for name in getattr(type(m), "linear_weights", ())]
    return [*slots, (model, "lm_head")]


def replace_weight(owner: nn.Module, name: str, module: nn.Module) -> None:
    """Put ``module`` where parameter ``name`` was (nn.Module refuses to assign over a parameter)."""
    delattr(owner, name)
    setattr(owner, name, module)


def linear(
    x: torch.Tensor, weight: torch.Tensor | nn.Module, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ weight.T + bias`` for a dense weight or a :class:`QuantizedLinear`; every layer calls this."""
    if isinstance(weight, torch.Tensor):
        if _dense_kernel is None or weight.dtype != _dense_kernel[0] or weight.dim() != 2:
            return F.linear(x, weight, bias)
        y = _dense_kernel[1](x, weight)
    else:
        y = weight(x)
    return y if bias is None else y + bias
