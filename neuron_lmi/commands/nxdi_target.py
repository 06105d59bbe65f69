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

from neuron_lmi.backends.nxdi.support import release

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
