"""What SageMaker accepts per instance family: an EBS volume size, and accelerators per model copy.

* ``VolumeSizeInGB``: families with local NVMe instance storage refuse it (the model and its caches
  live on the instance store). That is ml.g5, ml.g6, ml.g6e, ml.p5, ml.trn1 and ml.trn2, and every
  "d" family (ml.m5d, ml.c6id, ml.g4dn, ml.p3dn, ml.p4d, ml.p4de, ...). EBS-only families such as
  ml.inf2, ml.m5 or ml.c5 accept it.
* Accelerators: an inference component asks for ``NumberOfAcceleratorDevicesRequired`` devices per
  copy. A Neuron device holds two NeuronCore-v2 on inf2/trn1 (one tensor-parallel rank each), and
  eight NeuronCore-v3 on trn2, grouped in pairs at the default logical NeuronCore config 2; a GPU
  holds one rank. So a copy at tensor parallel degree ``tp`` needs ``ceil(tp / ranks_per_device)``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

DEFAULT_VOLUME_GB = 256  # room for 70B-class weights plus compiled artifacts on EBS-only families

# Families with instance storage whose names carry no "d" attribute.
NVME_FAMILIES = frozenset({"g5", "g6", "g6e", "gr6", "p5", "p5e", "p5en", "trn1", "trn1n", "trn2"})
# "d" in a family's attributes (the letters after the generation digit) marks local NVMe storage.
_D_FAMILY = re.compile(r"[a-z]+\d+[a-z-]*d[a-z-]*")


@dataclass(frozen=True, slots=True)
class Accelerator:
    """One accelerator device: its kind and how many tensor-parallel ranks it holds."""

    kind: str
    ranks_per_device: int


_NEURON2 = Accelerator("Neuron device", 2)
_GPU = Accelerator("GPU", 1)
FAMILY_ACCELERATORS: dict[str, Accelerator] = {
    "inf2": _NEURON2,
    "trn1": _NEURON2,
    "trn1n": _NEURON2,
    **{f: _GPU for f in ("g4dn", "g5", "g6", "g6e", "p3", "p3dn", "p4d", "p4de", "p5", "p5e", "p5en")},
}
TRN2_PHYSICAL_CORES = 8  # NeuronCore-v3 per Trainium2 device

_GPU_SIZES = {"xlarge": 1, "2xlarge": 1, "4xlarge": 1, "8xlarge": 1, "16xlarge": 1, "12xlarge": 4,
              "24xlarge": 4, "48xlarge": 8}  # fmt: skip
DEVICES: dict[str, int] = {
    "ml.inf2.xlarge": 1,
    "ml.inf2.8xlarge": 1,
    "ml.inf2.24xlarge": 6,
    "ml.inf2.48xlarge": 12,
    "ml.trn1.2xlarge": 1,
    "ml.trn1.32xlarge": 16,
    "ml.trn1n.32xlarge": 16,
    "ml.trn2.48xlarge": 16,
    **{f"ml.{family}.{size}": n for family in ("g5", "g6", "g6e") for size, n in _GPU_SIZES.items()},
    **{f"ml.g4dn.{size}": (4 if size == "12xlarge" else 1) for size in ("xlarge", "2xlarge", "4xlarge",
                                                                         "8xlarge", "12xlarge", "16xlarge")},
    **{f"ml.{family}.24xlarge": 8 for family in ("p4d", "p4de")},
    **{f"ml.{family}.48xlarge": 8 for family in ("p5", "p5e", "p5en")},
}  # fmt: skip


def instance_family(instance_type: str) -> str:
    """``ml.g5.12xlarge`` → ``g5``; ValueError for anything that is not ``ml.<family>.<size>``."""
    parts = instance_type.split(".")
    if len(parts) != 3 or parts[0] != "ml" or not parts[1] or not parts[2]:
        raise ValueError(f"instance_type={instance_type!r}: expected ml.<family>.<size> (ml.inf2.24xlarge)")
    return parts[1]


def accepts_volume_size(instance_type: str) -> bool:
    family = instance_family(instance_type)
    return family not in NVME_FAMILIES and not _D_FAMILY.fullmatch(family)


def default_volume_size(instance_type: str) -> int | None:
    """The EBS size to ask for when none was given: None (leave it out) where it is refused."""
    return DEFAULT_VOLUME_GB if accepts_volume_size(instance_type) else None


def check_volume_size(instance_type: str, volume_size_gb: int | None) -> None:
    if volume_size_gb is not None and not accepts_volume_size(instance_type):
        raise ValueError(
            f"volume_size_gb={volume_size_gb}: {instance_type} has local NVMe instance storage and "
            "SageMaker refuses VolumeSizeInGB for it; leave the volume size out"
        )


def accelerator(instance_type: str, logical_nc_config: int | None = None) -> Accelerator | None:
    """The accelerator of an instance family; None for CPU-only or unknown families."""
    family = instance_family(instance_type)
    if family == "trn2":
        lnc = logical_nc_config or 2
        if lnc not in (1, 2):
            raise ValueError(f"logical_nc_config={lnc}: Trainium2 supports 1 or 2")
        return Accelerator("Trainium2 device", TRN2_PHYSICAL_CORES // lnc)
    return FAMILY_ACCELERATORS.get(family)


def devices_needed(
    instance_type: str, tensor_parallel_degree: int, logical_nc_config: int | None = None
) -> int | None:
    """Devices one copy at ``tensor_parallel_degree`` occupies; None without a known accelerator."""
    if tensor_parallel_degree < 1:
        raise ValueError(f"tensor_parallel_degree={tensor_parallel_degree}: must be >= 1")
    device = accelerator(instance_type, logical_nc_config)
    return None if device is None else math.ceil(tensor_parallel_degree / device.ranks_per_device)


def check_accelerators(
    instance_type: str,
    tensor_parallel_degree: int,
    accelerators: int | None = None,
    logical_nc_config: int | None = None,
) -> None:
    """The copy (``accelerators`` devices, or the whole instance when None) fits
    ``tensor_parallel_degree`` ranks exactly: fewer devices cannot hold the ranks, more sit idle."""
    if tensor_parallel_degree < 1:
        raise ValueError(f"tensor_parallel_degree={tensor_parallel_degree}: must be >= 1")
    device = accelerator(instance_type, logical_nc_config)
    if device is None:
        return
    needed = math.ceil(tensor_parallel_degree / device.ranks_per_device)
    per = f"{device.kind}s of {device.ranks_per_device} rank(s) each"
    available = DEVICES.get(instance_type)
    if available is not None and needed > available:
        raise ValueError(
            f"tensor_parallel_degree={tensor_parallel_degree} needs {needed} {per}; "
            f"{instance_type} has {available}"
        )
    if accelerators is not None and accelerators != needed:
        fate = (
            "cannot hold the ranks" if accelerators < needed else f"would leave {accelerators - needed} idle"
        )
        raise ValueError(
            f"accelerators={accelerators} per copy: tensor_parallel_degree={tensor_parallel_degree} on "
            f"{instance_type} needs {needed} {per}; {accelerators} {fate}"
        )
