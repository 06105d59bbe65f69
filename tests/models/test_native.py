"""``models.native``: the kernel library's build on a thread, and what may go on beside it. Tracing
a graph needs the ops' schemas and fake kernels only, so a first start traces and compiles while the
library builds (``build_in_background``); whatever runs an op waits in ``kernels``."""

from __future__ import annotations

import pytest

from neuron_lmi.models import native
from tests.models.conftest import run_fresh

TRACE_WITHOUT_KERNELS = """
import torch
from neuron_lmi.models import native, packed_linear
from neuron_lmi.models.quant import linear

weight = torch.randn(4, 8)
class Graph(torch.nn.Module):
    def forward(self, x):
        return linear(x, weight)

library = next(name for name in packed_linear.LIBRARIES if packed_linear.available(name))
with packed_linear.tracing_packed_linears(library, torch.float32):
    program = torch.export.export(Graph(), (torch.randn(3, 8),), strict=False)
ops = [str(node.target) for node in program.graph.nodes if node.op == "call_function"]
print(native.registered(), ops)
"""

BUILD_ON_A_THREAD = """
import threading
from neuron_lmi.models import native

native.build_in_background()
for thread in threading.enumerate():
    if thread.name == "neuron-lmi-native-build":
        thread.join()
print(native.registered())
"""

BUILD_AND_EXIT = """
from neuron_lmi.models import native

native.build_in_background()
"""


def test_tracing_a_packed_linear_registers_no_kernel() -> None:
    registered, ops = run_fresh(TRACE_WITHOUT_KERNELS).strip().split(" ", 1)
    assert registered == "None"  # nothing built or loaded: the build may still be running
    assert "neuron_lmi." in ops and "_linear.default" in ops  # the packed op is in the graph


@pytest.mark.parametrize(("env", "kernels"), [({}, "native"), ({native.NATIVE_ENV: "0"}, "python")])
def test_the_background_build_registers_the_kernels_by_itself(env: dict[str, str], kernels: str) -> None:
    assert run_fresh(BUILD_ON_A_THREAD, env).strip() == kernels


def test_an_interpreter_exiting_mid_build_waits_for_it(tmp_path) -> None:
    """Else torch's builder leaves its lock file, and the next build on the host waits on it forever."""
    run_fresh(BUILD_AND_EXIT, {"XDG_CACHE_HOME": str(tmp_path)})
    (built,) = (tmp_path / "neuron-lmi" / "kernels").iterdir()
    assert (built / f"{native.NAME}.so").exists() and not (built / "lock").exists()
