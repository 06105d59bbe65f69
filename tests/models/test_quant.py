"""Weight-only quantization: formats, torch's packed CPU kernels, GGUF block codes, the model transform.

Tolerances (quantized paths only; the fp32 parity tests are untouched):
* a quantizer's round-trip error is at most half a step (``scale / 2``) per element;
* a kernel's output equals ``x @ dequantized.T`` up to bf16 rounding (its compute dtype): 2% of
  the output's largest magnitude;
* a GGUF file's kept codes dequantize to exactly the dense loader's values.
Model-level quality bounds are in ``test_quant_quality.py``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from neuron_lmi.models.gguf_loader import _BLOCK_FORMATS, read_gguf
from neuron_lmi.models.quant import (
    Int4Linear,
    Int8Linear,
    QuantizedLinear,
    QuantizedTensor,
    cat_rows,
    linear,
    quantize_int4,
    quantize_int8,
    to_linear,
)
from neuron_lmi.models.quantize import quantize_weight


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


def test_int8_round_trip_within_half_a_step() -> None:
    w = _weight(48, 96)
    q = quantize_int8(w)
    assert q.codes.dtype == torch.int8 and q.scale.shape == (48, 1)
    assert ((q.dequantize() - w).abs() <= q.scale / 2 + 1e-6).all()


def test_int4_round_trip_within_half_a_step() -> None:
    w = _weight(32, 128)
    q = quantize_int4(w, group_size=32)
    assert q.codes.dtype == torch.uint8 and int(q.codes.max()) <= 15 and q.scale.shape == (32, 4)
    err = (q.dequantize() - w).view(32, 4, 32).abs()
    assert (err <= q.scale[..., None] / 2 + 1e-6).all()


KERNELS = {"int8": (quantize_int8, Int8Linear), "int4": (quantize_int4, Int4Linear)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("method", sorted(KERNELS))
@pytest.mark.parametrize(("rows", "out"), [(3, 64), (64, 64), (3, 48), (64, 48)])
def test_kernel_matches_dequantized_matmul(method: str, dtype: torch.dtype, rows: int, out: int) -> None:
    """Few rows run the packed kernel, many a dequantized GEMM (int4 from the kernel's blocked
    layout when N % 64 == 0 on an AVX-512 build, whose blocks are 64 wide; else, an AVX2-only CPU's
    packs included, from plain nibbles); all equal x @ w.T up to bf16 rounding."""
    quantize, kernel = KERNELS[method]
    q = quantize(_weight(out, 96))
    layer: QuantizedLinear = kernel(q)
    assert (rows >= layer.gemm_min_rows) == (rows == 64)
    if method == "int4":
        avx512 = str(torch.backends.cpu.get_cpu_capability()).startswith("AVX512")
        assert layer.blocked == (out % 64 == 0 and avx512)
    torch.testing.assert_close(layer.dequantize().float(), q.dequantize(), rtol=1e-2, atol=0.05)
    x = torch.randn(2, rows, 96, generator=torch.Generator().manual_seed(1)).to(dtype)
    ref = x.float() @ q.dequantize().T
    y = layer(x)
    assert y.shape == (2, rows, out) and y.dtype == dtype
    assert (y.float() - ref).abs().max() <= 0.02 * ref.abs().max()


def test_linear_dense_path_is_f_linear() -> None:
    w, b, x = _weight(8, 16), torch.randn(8), torch.randn(3, 16)
    torch.testing.assert_close(linear(x, w, b), torch.nn.functional.linear(x, w, b), rtol=0, atol=0)


def test_cat_rows_keeps_one_format_and_requantizes_a_mix() -> None:
    a, b = quantize_int4(_weight(32, 64, 1)), quantize_int4(_weight(16, 64, 2))
    fused = cat_rows([a, b])
    assert isinstance(fused, QuantizedTensor) and fused.bits == 4 and fused.shape == (48, 64)
    torch.testing.assert_close(fused.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    mixed = cat_rows([a, _weight(16, 64, 3)])
    assert isinstance(mixed, QuantizedTensor) and mixed.bits == 8 and mixed.group_size == 64


def test_map_rows_permutes_every_part() -> None:
    q = quantize_int4(_weight(32, 64))
    perm = torch.randperm(32, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(q.map_rows(lambda t: t[perm]).dequantize(), q.dequantize()[perm])


def test_shapes_no_kernel_takes_fall_back() -> None:
    assert isinstance(quantize_weight(_weight(100, 64), "int4"), Int8Linear)  # int4 needs N % 16 == 0
    assert quantize_weight(_weight(16, 40), "int8") is None  # int8 needs K % 32 == 0
    q8_blocks = QuantizedTensor(8, 32, torch.ones(16, 64, dtype=torch.int8), torch.ones(16, 2))
    assert isinstance(to_linear(q8_blocks), Int8Linear)  # GGUF Q8_0: re-quantized per row


def test_invalid_formats_are_rejected() -> None:
    with pytest.raises(ValueError, match="group_size"):
        QuantizedTensor(4, 48, torch.zeros(16, 64, dtype=torch.uint8), torch.ones(16, 1), torch.zeros(16, 1))
    with pytest.raises(ValueError, match="zero"):
        QuantizedTensor(4, 32, torch.zeros(16, 64, dtype=torch.uint8), torch.ones(16, 2))


# --- GGUF blocks ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_decode_like_gguf_py(kind: str) -> None:
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    w = np.random.default_rng(0).standard_normal((32, 96)).astype(np.float32)
    raw = gguf.quants.quantize(w, qtype)
    ours = _BLOCK_FORMATS[kind](raw).dequantize().numpy()
    np.testing.assert_array_equal(ours, gguf.quants.dequantize(raw, qtype))


def test_smollm2_kept_codes_are_the_dense_loaders_values(smollm2_gguf: Path) -> None:
    dense = read_gguf(smollm2_gguf).state_dict
    kept = read_gguf(smollm2_gguf, keep_quantized=True).state_dict
    assert dense.keys() == kept.keys()
    formats = set()
    for name, tensor in kept.items():
        if isinstance(tensor, QuantizedTensor):
            formats.add((tensor.bits, tensor.group_size))
            torch.testing.assert_close(tensor.dequantize(), dense[name], rtol=0, atol=0, msg=name)
    assert formats == {(4, 32), (8, 32)}  # Q4_1 layers, Q8_0 embedding


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_gguf_codes_go_into_the_model_unexpanded(kind: str, tiny_llama_dir: Path, tmp_path: Path) -> None:
    import gguf

    from neuron_lmi.models import build_model
    from neuron_lmi.models.loader import load_checkpoint
    from tests.models.test_loader import _write_gguf

    path = _write_gguf(
        load_checkpoint(tiny_llama_dir), tmp_path / "q.gguf", qtype=gguf.GGMLQuantizationType[kind]
    )
    dense = load_checkpoint(path)
    kept = load_checkpoint(path, keep_quantized=True)
    ref = build_model(dense.config, dense.state_dict, 64)
    model = build_model(kept.config, kept.state_dict, 64)
    expected = Int4Linear if kind == "Q4_1" else Int8Linear
    assert isinstance(model.layers[0].wqkv, expected) and isinstance(model.lm_head, expected)
    ids = torch.tensor([[5, 900, 31, 7000, 12]])
    want, _, _ = ref.prefill(ids, [5])
    got, _, _ = model.prefill(ids, [5])
    assert (got - want).abs().max() <= 0.05 * want.abs().max()  # bf16 matmuls (+ int8 re-quantization)
