"""``neuron_lmi::mkl_linear`` and ``neuron_lmi::onednn_linear``: ``F.linear``'s result on packed
weights, one pack per weight storage and library (never a dead weight's pack for a new one at the
same address), traced into graphs by ``tracing_packed_linears`` and run inside an AOTInductor package
on packs made in this process; the native kernels here (this host has a compiler), the Python ones in
a subprocess; which library a host gets."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from neuron_lmi.models import ops, packed_linear
from neuron_lmi.models.quant import linear
from tests.models.conftest import run_with_python_kernels

LIBRARIES = [
    pytest.param(name, marks=pytest.mark.skipif(not packed_linear.available(name), reason=f"no {name} here"))
    for name in packed_linear.LIBRARIES
]


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.fixture(autouse=True, scope="module")
def registered_kernel() -> None:
    assert ops.kernels() == "native"  # built with this host's compiler (or taken from its cache)


def test_the_python_kernels_where_the_native_ones_are_off() -> None:
    """The fallback where no compiler builds ``packed_linear.cpp`` (here forced by the environment)."""
    script = (
        "import torch, torch.nn.functional as F\n"
        "from neuron_lmi.models import packed_linear as pl\n"
        "from neuron_lmi.models import ops\n"
        "assert ops.kernels() == 'python'\n"
        "w, x = torch.randn(64, 64), torch.randn(2, 3, 64)\n"
        "libraries = [l for l in pl.LIBRARIES if pl.available(l)]\n"
        "for weight in (w, w, w.t(), w):\n"
        "    want = F.linear(x, weight)\n"
        "    for library in libraries:\n"
        "        got = pl.linear_op(library)(x, weight)\n"
        "        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)\n"
        "# one storage: the transposed view replaced each library's pack\n"
        "assert pl.cached_packs() == len(libraries), pl.cached_packs()\n"
        "del w, weight\n"
        "assert pl.cached_packs() == 0\n"
        "print('python kernels ok')\n"
    )
    assert "python kernels ok" in run_with_python_kernels(script)


@pytest.mark.parametrize("library", LIBRARIES)
@pytest.mark.parametrize("shape", [(1, 64), (3, 64), (16, 64), (33, 64), (2, 5, 64), (300, 64)])
def test_equals_f_linear_for_any_row_count(library: str, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    op = packed_linear.linear_op(library)
    weight, x = torch.randn(48, 64), torch.randn(*shape)
    got = op(x, weight)
    assert got.shape == (*shape[:-1], 48)
    close(got, F.linear(x, weight))
    # Non-contiguous rows are copied, not misread.
    wide = torch.randn(*shape[:-1], 128)[..., ::2]
    close(op(wide, weight), F.linear(wide, weight))


@pytest.mark.skipif(not packed_linear.available("onednn"), reason="no oneDNN here")
def test_onednn_takes_bf16_weights_and_tracing_refuses_what_a_library_cannot_pack() -> None:
    """oneDNN packs bf16 where it runs bf16 (AVX-512 BW/VL/DQ, AVX-NE-CONVERT); on an AVX2-only CPU
    it does not, and tracing refuses it there as it refuses MKL's bf16 everywhere."""
    with pytest.raises(ValueError, match=r"neuron_lmi::mkl_linear takes torch\.float32 weights"):
        packed_linear.tracing_packed_linears("mkl", torch.bfloat16)
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert packed_linear.dtypes("onednn") == (torch.float32,)
        with pytest.raises(ValueError, match=r"neuron_lmi::onednn_linear takes torch\.float32 weights"):
            packed_linear.tracing_packed_linears("onednn", torch.bfloat16)
        return
    torch.manual_seed(3)
    weight, x = torch.randn(48, 64).bfloat16(), torch.randn(5, 64).bfloat16()
    got = packed_linear.linear_op("onednn")(x, weight)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, F.linear(x, weight), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("library", LIBRARIES)
def test_one_pack_per_weight_and_a_dead_weights_pack_is_never_reused(library: str) -> None:
    torch.manual_seed(1)
    op = packed_linear.linear_op(library)
    x = torch.randn(4, 64)
    first = torch.randn(32, 64)
    before = packed_linear.cached_packs()
    op(x, first)
    op(x, first)
    assert packed_linear.cached_packs() == before + 1
    second = torch.randn(32, 64)
    close(op(x, second), F.linear(x, second))
    assert packed_linear.cached_packs() == before + 2
    # Free the first weight; the allocator usually hands its address to the next one of its size,
    # whose product must come from its own values.
    address = first.data_ptr()
    del first
    gc.collect()
    assert packed_linear.cached_packs() == before + 1
    candidates = [torch.randn(32, 64) for _ in range(8)]
    reused = [w for w in candidates if w.data_ptr() == address]
    for weight in reused or candidates[:1]:
        close(op(x, weight), F.linear(x, weight))
    # A transposed view of a square weight has its address and shape, not its values' layout.
    square = torch.randn(64, 64)
    close(op(x, square), F.linear(x, square))
    close(op(x, square.t()), F.linear(x, square.t()))


def test_one_weight_has_a_pack_per_library() -> None:
    libraries = [library for library in packed_linear.LIBRARIES if packed_linear.available(library)]
    weight, x = torch.randn(40, 64), torch.randn(3, 64)
    before = packed_linear.cached_packs()
    for library in libraries:
        close(packed_linear.linear_op(library)(x, weight), F.linear(x, weight))
    assert packed_linear.cached_packs() == before + len(libraries)


def test_the_host_library_is_mkl_on_intel_and_onednn_elsewhere(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(packed_linear.LIBRARY_ENV, raising=False)
    both = packed_linear.available("mkl") and packed_linear.available("onednn")
    if both:
        assert packed_linear.host_library("GenuineIntel") == "mkl"
        assert packed_linear.host_library("AuthenticAMD") == "onednn"
        assert packed_linear.host_library("") == "onednn"
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\n")
    assert packed_linear.cpu_vendor(cpuinfo) == "AuthenticAMD"
    assert packed_linear.cpu_vendor(tmp_path / "missing") == ""
    # The environment overrides the vendor rule, and a library this build lacks is a clear error.
    monkeypatch.setenv(packed_linear.LIBRARY_ENV, "mkl")
    if packed_linear.available("mkl"):
        assert packed_linear.host_library("AuthenticAMD") == "mkl"
    monkeypatch.setenv(packed_linear.LIBRARY_ENV, "aten")
    assert packed_linear.host_library("GenuineIntel") is None
    monkeypatch.setenv(packed_linear.LIBRARY_ENV, "blas")
    with pytest.raises(ValueError, match="NEURON_LMI_PACKED_GEMM='blas'"):
        packed_linear.host_library()


class TwoLinears(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Parameter(torch.randn(96, 64) / 8, requires_grad=False)
        self.down = nn.Parameter(torch.randn(64, 96) / 10, requires_grad=False)
        self.head = nn.Parameter(torch.randn(64, 64, dtype=torch.bfloat16), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = linear(F.silu(linear(x, self.up)), self.down)
        return h + linear(h.bfloat16(), self.head).float()  # bf16 weights keep F.linear


@pytest.mark.slow
@pytest.mark.parametrize("library", LIBRARIES)
def test_a_traced_graph_calls_the_op_and_its_package_packs_its_own_weights(
    library: str, tmp_path: Path
) -> None:
    torch.manual_seed(2)
    op = getattr(torch.ops.neuron_lmi, f"{library}_linear").default
    module = TwoLinears().eval()
    example = torch.randn(3, 64)
    dynamic = ({0: torch.export.Dim("rows", min=1, max=16)},)
    with torch.no_grad(), packed_linear.tracing_packed_linears(library, torch.float32):
        program = torch.export.export(module, (example,), dynamic_shapes=dynamic, strict=False)
    targets = [node.target for node in program.graph.nodes if node.op == "call_function"]
    assert targets.count(op) == 2  # up and down; the bf16 head keeps F.linear
    with packed_linear.tracing_packed_linears(None), torch.no_grad():  # no library: untouched
        plain = torch.export.export(module, (example,), dynamic_shapes=dynamic, strict=False)
    assert op not in [n.target for n in plain.graph.nodes]

    path = torch._inductor.aoti_compile_and_package(
        program, package_path=str(tmp_path / "two.pt2"), inductor_configs={"freezing": True}
    )
    package = torch._inductor.aoti_load_package(path)
    before = packed_linear.cached_packs()
    for rows in (1, 5, 16):
        x = torch.randn(rows, 64)
        with torch.no_grad():
            torch.testing.assert_close(package(x), module(x), rtol=1e-4, atol=1e-4)
    # The package's frozen copies of up and down were packed here, once each, on the first call.
    assert packed_linear.cached_packs() == before + 2
