"""``--platform`` and ``--nxdi-version``: the chip and NxD Inference release an offline review is for.

``compile --target neuron`` and ``plan`` read them. The platform: ``--platform`` (or
``option.neuron_platform``), else NxD's ``NEURON_PLATFORM_TARGET_OVERRIDE``, else this host's instance
type. The release: ``--nxdi-version``, else the installed one, else the one the platform runs (0.8 on
inf2/trn1, 0.9 on trn2/trn3; ``neuron_lmi.backends.nxdi.support.library_release``). Both are printed with
where they came from.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Mapping

from neuron_lmi.backends.host import NXDI, installed_version
from neuron_lmi.backends.nxdi.support import PLATFORM_KEY, PLATFORM_VAR, Platform, release, target_platform

__all__ = ["PLATFORM_VAR", "nxdi_target", "nxdi_version"]

OLDEST = (0, 8)  # the mapping is written for NxD Inference 0.8 (SDK 2.28) and later


def nxdi_version(text: str) -> str:
    """argparse type of ``--nxdi-version``: ``0.8``, ``0.9.0``..."""
    value = text.strip()
    found = release(value)
    if not re.fullmatch(r"\d+\.\d+(\.\d+)?", value) or found is None:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a release such as 0.8 or 0.9.0")
    if found < OLDEST:
        raise argparse.ArgumentTypeError(
            f"{text}: the NxD Inference mapping is written for 0.8 and later (older Neuron SDKs: "
            "--model-loader tnx)"
        )
    return value


def nxdi_target(
    configured_platform: str | None,
    platform_key: str,
    given_version: str | None,
    env: Mapping[str, str],
    compiling: bool = False,
) -> tuple[Platform, str | None, str]:
    """(platform, release or None to infer it from the platform, where the release came from).

    ``compiling`` (a real compile, not a review) refuses a ``--nxdi-version`` other than the installed
    release: the compile runs the installed library."""
    platform = target_platform(configured_platform, env, key=platform_key or PLATFORM_KEY)
    installed = installed_version(NXDI.distribution)
    if given_version:
        if compiling and installed and release(installed) != release(given_version):
            raise ValueError(
                f"--nxdi-version {given_version}: NxD Inference {installed} is installed, and a compile "
                "runs the installed release; drop --nxdi-version or add --dry-run"
            )
        return platform, given_version, "--nxdi-version"
    return platform, installed, "installed"
