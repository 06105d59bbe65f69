"""The native kernels' sources compile for every x86 instruction set the kernels branch on: AVX2
only, AVX-512 without BF16, AVX-512 with BF16, and AMX (Sapphire Rapids). The build targets the host
(``-march=native``), so a branch this host does not take is otherwise never compiled here; a host
whose build fails runs the slow Python kernels instead (``ops.kernels``)."""

from __future__ import annotations

import platform
import shutil
import subprocess

import pytest
from torch.utils.cpp_extension import include_paths

from neuron_lmi.models import native

pytestmark = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64") or shutil.which("g++") is None,
    reason="needs g++ on an x86-64 host",
)


@pytest.mark.parametrize("arch", ["x86-64-v3", "skylake-avx512", "cooperlake", "sapphirerapids"])
def test_the_sources_compile_for_each_instruction_set(arch: str) -> None:
    includes = [f"-I{path}" for path in include_paths()]
    # The unit the build compiles: every source, in the one translation unit they share.
    done = subprocess.run(
        ["g++", "-std=c++17", "-fsyntax-only", f"-march={arch}", "-fopenmp", *includes, str(native.UNIT)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, f"{native.UNIT.name} for {arch}:\n{done.stderr[-3000:]}"


def test_the_unit_includes_every_source() -> None:
    lines = native.UNIT.read_text().splitlines()
    included = [line.split('"')[1] for line in lines if line.startswith("#include")]
    assert included == [source.name for source in native.SOURCES]
