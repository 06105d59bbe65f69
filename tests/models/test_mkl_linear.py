"""``neuron_lmi::mkl_linear``: ``F.linear``'s result on MKL-packed weights, one pack per weight
storage (never a dead weight's pack for a new one at the same address), traced into graphs by
``tracing_mkl_linears`` and run inside an AOTInductor package on packs made in this process; the
native kernel here (this host has a compiler), the Python one in a subprocess."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from neuron_lmi.models import mkl_linear
from neuron_lmi.models.quant import linear

pytestmark = pytest.mark.skipif(not mkl_linear.available(), reason="this torch build has no MKL packed GEMM")


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.fixture(autouse=True, scope="module")
def registered_kernel() -> None:
    assert mkl_linear.kernel() == "native"  # built with this host's compiler (or taken from its cache)


def test_the_python_kernel_where_the_native_one_is_off() -> None:
    """The fallback where no compiler builds ``mkl_linear.cpp`` (here forced by the environment)."""
    script = (
        "import torch, torch.nn.functional as F\n"
        "from neuron_lmi.models import mkl_linear\n"
        "assert mkl_linear.kernel() == 'python'\n"
        "w, x = torch.randn(64, 64), torch.randn(2, 3, 64)\n"
        "for weight in (w, w, w.t(), w):\n"
        "    want = F.linear(x, weight)\n"
        "    torch.testing.assert_close(mkl_linear.mkl_linear(x, weight), want, rtol=1e-5, atol=1e-5)\n"
        "assert mkl_linear.cached_packs() == 1  # one storage: the transposed view replaced its pack\n"
        "del w, weight\n"
        "assert mkl_linear.cached_packs() == 0\n"
        "print('python kernel ok')\n"
    )
    env = {**os.environ, mkl_linear.NATIVE_ENV: "0"}
    command = [sys.executable, "-c", script]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "python kernel ok" in done.stdout


@pytest.mark.parametrize("shape", [(1, 64), (3, 64), (16, 64), (33, 64), (2, 5, 64)])
def test_equals_f_linear_for_any_row_count(shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    weight, x = torch.randn(48, 64), torch.randn(*shape)
    got = mkl_linear.mkl_linear(x, weight)
    assert got.shape == (*shape[:-1], 48)
    close(got, F.linear(x, weight))
    # Non-contiguous rows are copied, not misread.
    wide = torch.randn(*shape[:-1], 128)[..., ::2]
    close(mkl_linear.mkl_linear(wide, weight), F.linear(wide, weight))


def test_one_pack_per_weight_and_a_dead_weights_pack_is_never_reused() -> None:
    torch.manual_seed(1)
    x = torch.randn(4, 64)
    first = torch.randn(32, 64)
    before = mkl_linear.cached_packs()
    mkl_linear.mkl_linear(x, first)
    mkl_linear.mkl_linear(x, first)
    assert mkl_linear.cached_packs() == before + 1
    second = torch.randn(32, 64)
    close(mkl_linear.mkl_linear(x, second), F.linear(x, second))
    assert mkl_linear.cached_packs() == before + 2
    # Free the first weight; the allocator usually hands its address to the next one of its size,
    # whose product must come from its own values.
    address = first.data_ptr()
    del first
    gc.collect()
    assert mkl_linear.cached_packs() == before + 1
    candidates = [torch.randn(32, 64) for _ in range(8)]
    reused = [w for w in candidates if w.data_ptr() == address]
    for weight in reused or candidates[:1]:
        close(mkl_linear.mkl_linear(x, weight), F.linear(x, weight))
    # A transposed view of a square weight has its address and shape, not its values' layout.
    square = torch.randn(64, 64)
    close(mkl_linear.mkl_linear(x, square), F.linear(x, square))
    close(mkl_linear.mkl_linear(x, square.t()), F.linear(x, square.t()))


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
def test_a_traced_graph_calls_the_op_and_its_package_packs_its_own_weights(tmp_path: Path) -> None:
    torch.manual_seed(2)
    module = TwoLinears().eval()
    example = torch.randn(3, 64)
    dynamic = ({0: torch.export.Dim("rows", min=1, max=16)},)
    with torch.no_grad(), mkl_linear.tracing_mkl_linears(torch.float32):
        program = torch.export.export(module, (example,), dynamic_shapes=dynamic, strict=False)
    targets = [node.target for node in program.graph.nodes if node.op == "call_function"]
    assert targets.count(torch.ops.neuron_lmi.mkl_linear.default) == 2
    with mkl_linear.tracing_mkl_linears(torch.bfloat16), torch.no_grad():  # bf16 graphs: untouched
        plain = torch.export.export(module, (example,), dynamic_shapes=dynamic, strict=False)
    assert torch.ops.neuron_lmi.mkl_linear.default not in [n.target for n in plain.graph.nodes]

    path = torch._inductor.aoti_compile_and_package(
        program, package_path=str(tmp_path / "two.pt2"), inductor_configs={"freezing": True}
    )
    package = torch._inductor.aoti_load_package(path)
    before = mkl_linear.cached_packs()
    for rows in (1, 5, 16):
        x = torch.randn(rows, 64)
        with torch.no_grad():
            torch.testing.assert_close(package(x), module(x), rtol=1e-4, atol=1e-4)
    # The package's frozen copies of up and down were packed here, once each, on the first call.
    assert mkl_linear.cached_packs() == before + 2
