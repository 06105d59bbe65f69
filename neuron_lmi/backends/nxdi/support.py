"""Which NxD Inference release runs where: the Neuron SDK matrix, as AWS's release notes state it.

    instance family   Neuron SDK   NxD Inference   notes
    inf2, trn1        <= 2.28      <= 0.8.x        2.28 (0.8.0) is the last release for these chips
    trn2, trn3        2.29+        0.9+            maintenance from 2.30
    Mixtral (any)     <= 2.28      <= 0.8.x        a kernel it needs was removed in 2.29
    Gemma 3 (any)     2.29+        0.9+            0.8.x lists no gemma3 in MODEL_TYPES

transformers-neuronx (SDK <= 2.25) is the other library for inf2/trn1 hosts on older SDKs; the
vllm-neuron plugin 0.21+ needs no NxD Inference and runs on Trn2/Trn3 only.

AWS is not of one mind about inf2/trn1 after 2.28: the 2.29 notes say NxD Inference no longer
supports NKI kernels there and to pin 2.28, while the end-of-support announcement keeps inf2/trn1
in maintenance at SDK 2.31. ``check_release`` refuses 0.9+ on inf2/trn1 by default, naming the
release to pin; ``option.allow_unsupported_nxdi_on_inf2_trn1`` lets a 2.29-2.31 image start with a
warning naming the risk. Mixtral, DBRX and Llama 4 on 0.9+ stay refused whatever the key says, and
Gemma 3 on 0.8 (its ``models/gemma3`` there is unlisted work: no ``query_pre_attn_scalar`` scaling).

The platform (``target_platform``): ``option.neuron_platform`` (``--platform``) where given, else
NxD's own ``NEURON_PLATFORM_TARGET_OVERRIDE``, else the EC2 instance type; where none tells, nothing
is refused for the platform.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from neuron_lmi.config.options import NEURON_PLATFORMS

LAST_INF2_TRN1 = (0, 8)  # NxD Inference 0.8.x = Neuron SDK 2.28
PIN = "Neuron SDK 2.28 (neuronx-distributed-inference 0.8.x)"
V2_PLATFORMS = ("inf2", "trn1")  # NeuronCore-v2 chips
PLATFORM_VAR = "NEURON_PLATFORM_TARGET_OVERRIDE"
PLATFORM_KEY = "option.neuron_platform"
ALLOW_KEY = "option.allow_unsupported_nxdi_on_inf2_trn1"
DMI_PRODUCT = "/sys/devices/virtual/dmi/id/product_name"
# Models whose NxD Inference application ends with 0.8.x.
ENDS_AT_0_8 = frozenset({"mixtral", "dbrx", "llama4"})
# Models whose NxD Inference application starts with 0.9.0 (utils/constants.py MODEL_TYPES).
STARTS_AT_0_9 = frozenset({"gemma3", "gemma3_text"})
DEFAULT_VERSION = {"v2": "0.8.0", "other": "0.9.0"}  # assumed where the library is not installed
# The release a platform runs when none is installed or named (the matrix above).
PLATFORM_RELEASES = {"inf2": "0.8.0", "trn1": "0.8.0", "trn2": "0.9.0", "trn3": "0.9.0"}
NKI_RISK = (
    "from Neuron SDK 2.29 NxD Inference no longer supports NKI kernels on Inf2/Trn1 (release notes: "
    "pin 2.28); a kernel-backed feature may fail to compile or run there"
)


class UnsupportedReleaseError(RuntimeError):
    """The installed NxD Inference release does not serve this model on this platform."""


@dataclass(frozen=True, slots=True)
class Platform:
    """The chip NxD Inference targets and how it was found (for the start-up log and dry runs)."""

    name: str | None
    source: str

    @property
    def v2(self) -> bool:
        """inf2 or trn1 (NeuronCore-v2)."""
        return family(self.name) in V2_PLATFORMS

    def describe(self) -> str:
        return f"{self.name} ({self.source})" if self.name else self.source


def release(version: str | None) -> tuple[int, int] | None:
    """``"0.9.0"`` -> (0, 9); None where the version is unknown."""
    match = re.match(r"(\d+)\.(\d+)", version or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


def family(platform: str | None) -> str:
    """``trn1n`` is a trn1; ``""`` where unknown."""
    return (platform or "").strip().lower().rstrip("n")


def instance_type(dmi_product: str = DMI_PRODUCT) -> str | None:
    """The EC2 instance type (``inf2.48xlarge``) from DMI, or None off EC2."""
    path = Path(dmi_product)
    product = path.read_text(encoding="ascii", errors="replace").strip().lower() if path.is_file() else ""
    product = product.removeprefix("ml.")
    return product if re.fullmatch(r"(inf|trn)\d+[a-z]*\.\w+", product) else None


def host_platform(env: Mapping[str, str], dmi_product: str = DMI_PRODUCT) -> str | None:
    """``inf2``/``trn1``/``trn2``/``trn3`` from NxD's override, else from the EC2 instance type."""
    return target_platform(None, env, dmi_product=dmi_product).name


def target_platform(
    configured: str | None,
    env: Mapping[str, str],
    key: str = PLATFORM_KEY,
    serving: bool = False,
    dmi_product: str = DMI_PRODUCT,
) -> Platform:
    """The platform from ``configured`` (``key``: ``option.neuron_platform`` or ``--platform``), else
    ``NEURON_PLATFORM_TARGET_OVERRIDE``, else the instance type. Raises ``ValueError`` naming ``key``
    where ``configured`` contradicts the override (NxD Inference compiles for the override) or, when
    ``serving``, this host's instance type; a compile may target another chip than its build host."""
    override = env.get(PLATFORM_VAR, "").strip().lower()
    instance = instance_type(dmi_product)
    if configured:
        if configured not in NEURON_PLATFORMS:
            raise ValueError(f"{key}={configured!r}: expected one of {', '.join(NEURON_PLATFORMS)}")
        if override and family(override) != family(configured):
            raise ValueError(
                f"{key}={configured} contradicts {PLATFORM_VAR}={override}, which NxD Inference "
                "compiles for; unset one of them"
            )
        if serving and instance and family(instance.split(".")[0]) != family(configured):
            raise ValueError(f"{key}={configured}, but this host is a {instance} instance")
        return Platform(configured, key)
    if override:
        return Platform(override, PLATFORM_VAR)
    if instance:
        return Platform(instance.split(".")[0], f"instance type {instance}")
    return Platform(None, f"platform unknown: no {PLATFORM_KEY}, {PLATFORM_VAR} or EC2 instance type")


def check_release(
    version: str | None,
    platform: str | None,
    model_type: str | None = None,
    allow_unsupported_platform: bool = False,
) -> str | None:
    """Raise ``UnsupportedReleaseError`` where the SDK matrix rules the combination out. Returns the
    start-up warning where ``allow_unsupported_platform`` lets 0.9+ run on inf2/trn1, else None."""
    found = release(version)
    if found is not None and found <= LAST_INF2_TRN1 and model_type in STARTS_AT_0_9:
        raise UnsupportedReleaseError(
            f"neuronx-distributed-inference {version} has no {model_type} application (its "
            "utils/constants.py MODEL_TYPES starts Gemma 3 at 0.9.0): Neuron SDK 2.29+ "
            "(neuronx-distributed-inference 0.9+) serves it, on Trn2 and newer"
        )
    if found is None or found <= LAST_INF2_TRN1:
        return None
    if model_type in ENDS_AT_0_8:
        raise UnsupportedReleaseError(
            f"neuronx-distributed-inference {version} has no {model_type} (a kernel it needs was "
            f"removed in SDK 2.29): pin {PIN}"
        )
    if family(platform) not in V2_PLATFORMS:
        return None
    if not allow_unsupported_platform:
        raise UnsupportedReleaseError(
            f"neuronx-distributed-inference {version} supports Trn2 and newer only; this host is "
            f"{platform}: pin {PIN}, the last release for Inf2/Trn1 (or, on a Neuron SDK 2.29-2.31 "
            f"image, set {ALLOW_KEY}=true and accept the risk)"
        )
    return (
        f"neuronx-distributed-inference {version} on {platform}, allowed by {ALLOW_KEY}: AWS supports "
        f"this release on Trn2 and newer only, and {NKI_RISK}; {PIN} is the supported release"
    )


def platform_release(platform: Platform) -> tuple[str, str] | None:
    """The release ``platform`` runs where none is installed or named, and why; None if unknown."""
    name = family(platform.name)
    if name not in PLATFORM_RELEASES:
        return None
    why = (
        f"{PIN.split(' (')[0]} is the last release for inf2/trn1"
        if name in V2_PLATFORMS
        else "Neuron SDK 2.29+ (0.9+) serves trn2 and newer"
    )
    return PLATFORM_RELEASES[name], f"inferred from platform {platform.describe()}: {why}"


def library_release(
    version: str | None, platform: Platform, model_type: str, source: str = "installed"
) -> tuple[str, str]:
    """The release the mapping is for and how it was found: the one given or installed (``source``
    says which), else the one that serves this model on this platform (0.8 on inf2/trn1 and for
    Mixtral, 0.9 on trn2/trn3)."""
    if version:
        return version, source
    inferred = platform_release(platform)
    if inferred is not None and platform.v2:
        return inferred[0], f"not installed; {inferred[1]}"
    if model_type in ENDS_AT_0_8:
        return DEFAULT_VERSION["v2"], f"assumed: not installed, the last release with {model_type}"
    if inferred is not None:
        return inferred[0], f"not installed; {inferred[1]}"
    return DEFAULT_VERSION["other"], f"assumed: not installed, {platform.source}"
