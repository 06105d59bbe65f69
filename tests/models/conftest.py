"""Shared by the ``neuron_lmi::`` op tests: a script run in a fresh interpreter, where no kernel has
been registered yet (optionally with the native kernels off)."""

from __future__ import annotations

import os
import subprocess
import sys

from neuron_lmi.models import native


def run_fresh(script: str, env: dict[str, str] | None = None) -> str:
    """Run ``script`` in a fresh interpreter, with ``env`` over this one's; its stdout, once it
    exited cleanly."""
    command, environment = [sys.executable, "-c", script], {**os.environ, **(env or {})}
    done = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def run_with_python_kernels(script: str) -> str:
    """``run_fresh`` with ``NEURON_LMI_NATIVE_KERNELS=0`` (the fallback where no compiler builds the
    kernels)."""
    return run_fresh(script, {native.NATIVE_ENV: "0"})
