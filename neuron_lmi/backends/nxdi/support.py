"""Which NxD Inference release runs where: the Neuron SDK matrix, as AWS's release notes state it.

    instance family   Neuron SDK   NxD Inference   notes
    inf2, trn1        <= 2.28      <= 0.8.x        2.28 (0.8.0) is the last release for these chips
    trn2, trn3        2.29+        0.9+            maintenance from 2.30
    Mixtral (any)     <= 2.28      <= 0.8.x        a kernel it needs was removed in 2.29

transformers-neuronx (SDK <= 2.25) is the other library for inf2/trn1 hosts on older SDKs; the
vllm-neuron plugin 0.21+ needs no NxD Inference and runs on Trn2/Trn3 only.

``check_release`` refuses a combination the matrix rules out, naming the release to pin. The
platform comes from ``NEURON_PLATFORM_TARGET_OVERRIDE`` (NxD's own override) or the instance type;
where neither tells, nothing is refused for the platform.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

LAST_INF2_TRN1 = (0, 8)  # NxD Inference 0.8.x = Neuron SDK 2.28
PIN = "Neuron SDK 2.28 (neuronx-distributed-inference 0.8.x)"
V2_PLATFORMS = ("inf2", "trn1")  # NeuronCore-v2 chips
PLATFORM_VAR = "NEURON_PLATFORM_TARGET_OVERRIDE"
DMI_PRODUCT = "/sys/devices/virtual/dmi/id/product_name"
# Models whose NxD Inference application ends with 0.8.x.
ENDS_AT_0_8 = frozenset({"mixtral", "dbrx", "llama4"})


class UnsupportedReleaseError(RuntimeError):
    """The installed NxD Inference release does not serve this model on this platform."""


def release(version: str | None) -> tuple[int, int] | None:
    """``"0.9.0"`` -> (0, 9); None where the version is unknown."""
    match = re.match(r"(\d+)\.(\d+)", version or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


def host_platform(env: Mapping[str, str], dmi_product: str = DMI_PRODUCT) -> str | None:
    """``inf2``/``trn1``/``trn2``/``trn3`` from NxD's override, else from the EC2 instance type."""
    override = env.get(PLATFORM_VAR, "").strip().lower()
    if override:
        return override
    path = Path(dmi_product)
    product = path.read_text(encoding="ascii", errors="replace").strip().lower() if path.is_file() else ""
    family = product.removeprefix("ml.").split(".")[0]
    return family if re.fullmatch(r"(inf|trn)\d+[a-z]*", family) else None


def check_release(version: str | None, platform: str | None, model_type: str | None = None) -> None:
    """Raise ``UnsupportedReleaseError`` where the SDK matrix rules the combination out."""
    found = release(version)
    if found is None or found <= LAST_INF2_TRN1:
        return
    family = (platform or "").rstrip("n")  # "trn1n" is a trn1
    if family in V2_PLATFORMS:
        raise UnsupportedReleaseError(
            f"neuronx-distributed-inference {version} supports Trn2 and newer only; this host is "
            f"{platform}: pin {PIN}, the last release for Inf2/Trn1"
        )
    if model_type in ENDS_AT_0_8:
        raise UnsupportedReleaseError(
            f"neuronx-distributed-inference {version} has no {model_type} (a kernel it needs was "
            f"removed in SDK 2.29): pin {PIN}"
        )
