"""Shared by the ``neuron_lmi::`` op tests: a script run where the native kernels are off."""

from __future__ import annotations

import os
import subprocess
import sys

from neuron_lmi.models import native


def run_with_python_kernels(script: str) -> str:
    """Run ``script`` in a fresh interpreter with ``NEURON_LMI_NATIVE_KERNELS=0`` (the fallback where
    no compiler builds the kernels); its stdout, once it exited cleanly."""
    env = {**os.environ, native.NATIVE_ENV: "0"}
    command = [sys.executable, "-c", script]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout
