"""``models.native`` and ``models.ops``: the kernel library's build on a thread, and what may go on
beside it. Tracing a graph needs the ops' schemas and fake kernels only, so a first start traces and
compiles while the library builds (``ops.build_in_background``); whatever runs an op waits in
``ops.kernels``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from compile_cache.lock import key_lock
from neuron_lmi.models import native
from tests.models.conftest import run_fresh

TRACE_WITHOUT_KERNELS = """
import torch
from neuron_lmi.models import ops as kernel_ops, packed_linear
from neuron_lmi.models.quant import linear

weight = torch.randn(4, 8)
class Graph(torch.nn.Module):
    def forward(self, x):
        return linear(x, weight)

library = next(name for name in packed_linear.LIBRARIES if packed_linear.available(name))
with packed_linear.tracing_packed_linears(library, torch.float32):
    program = torch.export.export(Graph(), (torch.randn(3, 8),), strict=False)
ops = [str(node.target) for node in program.graph.nodes if node.op == "call_function"]
print(kernel_ops.registered(), ops)
"""

BUILD_ON_A_THREAD = """
import threading
from neuron_lmi.models import ops

ops.build_in_background()
for thread in threading.enumerate():
    if thread.name == ops.BUILD_THREAD:
        thread.join()
print(ops.registered())
"""

BUILD_AND_EXIT = """
from neuron_lmi.models import ops

ops.build_in_background()
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
    (built,) = [d for d in (tmp_path / "neuron-lmi" / "kernels").iterdir() if d.is_dir()]
    assert (built / f"{native.NAME}.so").exists() and not (built / "lock").exists()
    assert native.build_lock_path(built).exists()  # the flock's file, beside the build


BUILD_NOW = """
import sys
from neuron_lmi.models import native, ops
native.BUILD_LOCK_TIMEOUT_S = float(sys.argv[1])
print(ops.kernels(), flush=True)
"""


def _build_now(cache: Path, lock_timeout: float = native.BUILD_LOCK_TIMEOUT_S) -> subprocess.CompletedProcess:
    command = [sys.executable, "-c", BUILD_NOW, str(lock_timeout)]
    env = {**os.environ, "XDG_CACHE_HOME": str(cache)}
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


def test_a_build_killed_mid_way_does_not_hang_the_next(tmp_path: Path) -> None:
    """SIGKILL (SageMaker's 30 s after SIGTERM, the OOM killer's) leaves torch's lock file in the
    build directory; the next build, holding the flock the dead one lost, removes it and builds."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    command = [sys.executable, "-c", BUILD_NOW, str(native.BUILD_LOCK_TIMEOUT_S)]
    killed = subprocess.Popen(command, env=env, start_new_session=True, stdout=subprocess.DEVNULL)
    kernels = tmp_path / "neuron-lmi" / "kernels"
    deadline = time.monotonic() + 120
    while not any((d / native.TORCH_BATON).exists() for d in kernels.glob("torch-*") if d.is_dir()):
        assert killed.poll() is None, "the build ended before it could be killed"
        assert time.monotonic() < deadline, "no build started"
        time.sleep(0.02)
    os.killpg(killed.pid, signal.SIGKILL)  # the compiler with it, as a container's end would
    killed.wait()
    (built,) = [d for d in kernels.iterdir() if d.is_dir()]
    assert (built / native.TORCH_BATON).exists()  # what made every later start wait forever
    again = _build_now(tmp_path)
    assert again.returncode == 0 and again.stdout.strip() == "native", again.stderr
    assert f"removing {built / native.TORCH_BATON}" in again.stderr
    assert not (built / native.TORCH_BATON).exists() and (built / f"{native.NAME}.so").exists()


def test_a_build_lock_held_too_long_ends_in_an_error_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    lock = native.build_lock_path(native.build_directory())
    with key_lock(lock, timeout=1):  # a live holder (this process), wedged
        waited = _build_now(tmp_path, lock_timeout=1)
    assert waited.returncode == 0 and waited.stdout.strip() == "python"  # the process still serves
    assert f"lock {lock} still held" in waited.stderr
