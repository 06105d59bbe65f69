"""NxD Inference's own source trees on ``sys.path``, with the six hardware-only packages as stand-ins.

The tier runs the library unmodified: ``NEURON_LMI_NXDI_SRC`` and ``NEURON_LMI_NXD_SRC`` name source
trees of aws-neuron/neuronx-distributed-inference and aws-neuron/neuronx-distributed (a ``git archive``
of one commit each; the folder holding the package, or the tree whose ``src/`` holds it). Where either
is unset the tier skips and names them.

``forward()`` in ``on_cpu`` mode calls nothing of ``torch_xla``, ``torch_neuronx``, ``libneuronxla``,
``neuronxcc``, ``nki`` or ``nkilib``, but the library's modules import them by name, use their
decorators at import time, subclass their classes and annotate with ``torch.classes.neuron.*``. So each
of those names resolves to a module whose every attribute is a subclassable, callable stand-in. The two
things the library does read off them on the CPU are kept faithful: ``torch_neuronx.utils.
get_platform_target`` honours ``NEURON_PLATFORM_TARGET_OVERRIDE`` (as the real one does before probing a
device), and ``torch.classes.neuron`` exists (the real ``torch_neuronx`` registers it).

One application's forward does call into them: Qwen3-MoE's decoder layers (0.8.0 and 0.9.0) pass their
hidden states through ``ModuleMarkerStart``/``EndWrapper`` (``models/layer_boundary_marker.py``), whose
``forward_impl`` is an ``xla_hlo_call``: a custom call that hands the compiler a layer boundary and
returns its operand (its HLO's result type is the operand's). The real ``torch_xla`` runs such a call on
XLA tensors only, so the library's own CPU mode cannot run that model and the product refuses it there
(``Application.no_cpu_mode``); here those two calls return their operand, as on a device, so the tier
checks the rest of the application's code. Every other ``xla_hlo_call`` stays a stand-in that fails on
use.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import re
import sys
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any

SOURCE_VARS = ("NEURON_LMI_NXDI_SRC", "NEURON_LMI_NXD_SRC")
PACKAGES = {
    "NEURON_LMI_NXDI_SRC": "neuronx_distributed_inference",
    "NEURON_LMI_NXD_SRC": "neuronx_distributed",
}
HARDWARE_PACKAGES = ("torch_xla", "torch_neuronx", "libneuronxla", "neuronxcc", "nki", "nkilib")
PLATFORM_VAR = "NEURON_PLATFORM_TARGET_OVERRIDE"
# xla_hlo_call functions whose value on a device is their operand (compiler hints).
IDENTITY_CALLS = frozenset({"ModuleMarkerStart.forward_impl", "ModuleMarkerEnd.forward_impl"})


def skip_reason(env: Mapping[str, str] | None = None) -> str | None:
    """Why the tier cannot run here, or None when both source trees are given and hold their package."""
    env = os.environ if env is None else env
    missing = [var for var in SOURCE_VARS if not env.get(var)]
    if missing:
        return (
            f"the real NxD Inference tier needs {' and '.join(missing)}: source trees of "
            "aws-neuron/neuronx-distributed-inference and aws-neuron/neuronx-distributed "
            "(see docs/verification.md)"
        )
    for var in SOURCE_VARS:
        if source_root(env[var], PACKAGES[var]) is None:
            return f"{var}={env[var]} holds no {PACKAGES[var]} package (nor src/{PACKAGES[var]})"
    return None


def source_root(path: str, package: str) -> Path | None:
    """The folder to put on ``sys.path`` for ``package``: ``path`` itself or its ``src/``."""
    for root in (Path(path), Path(path) / "src"):
        if (root / package / "__init__.py").is_file():
            return root
    return None


class _StandInMeta(type):
    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _stand_in(name)

    def __getitem__(cls, item: Any) -> Any:  # annotations such as nt.tensor[nt.mutable]
        return cls


class _StandIn(metaclass=_StandInMeta):
    """Any attribute of a hardware package: subclassable, callable, a decorator that keeps the function."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return _stand_in("result")()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _stand_in(name)()

    def __getitem__(self, item: Any) -> Any:
        return self


def _stand_in(name: str) -> type:
    return _StandInMeta(name, (_StandIn,), {})


class _StandInModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _stand_in(name)


class _HardwarePackages(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(
        self, fullname: str, path: Any, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname.split(".")[0] in HARDWARE_PACKAGES:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StandInModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        if module.__name__ == "torch_neuronx.utils":
            module.get_platform_target = lambda: os.environ[PLATFORM_VAR]  # type: ignore[attr-defined]
        if module.__name__ == "torch_neuronx.xla_impl.base":
            module.xla_hlo_call = _xla_hlo_call  # type: ignore[attr-defined]


def _operand(*args: Any) -> Any:
    return args[0] if len(args) == 1 else args


def _xla_hlo_call(opfn: Any) -> Any:
    """A module marker's device value (its operand); any other custom call a stand-in that fails on use."""
    if getattr(opfn, "__qualname__", "") in IDENTITY_CALLS:
        return _operand
    return _stand_in("xla_hlo_call")(opfn)


def tree_version(env: Mapping[str, str] | None = None) -> str:
    """The NxD Inference tree's ``__version__``, read from its file (before anything imports it)."""
    env = os.environ if env is None else env
    root = source_root(env["NEURON_LMI_NXDI_SRC"], PACKAGES["NEURON_LMI_NXDI_SRC"])
    text = (Path(str(root)) / PACKAGES["NEURON_LMI_NXDI_SRC"] / "_version.py").read_text(encoding="utf-8")
    match = re.search(r"__version__\s*=\s*[\"']([^\"']+)", text)
    if match is None:
        raise RuntimeError(f"no __version__ in {root}")
    return match.group(1)


def platform_for(version: str) -> str:
    """The chip a release runs on (Neuron SDK matrix): 0.8.x is the last for trn1, 0.9+ is Trn2+."""
    major, minor = (int(part) for part in version.split(".")[:2])
    return "trn1" if (major, minor) <= (0, 8) else "trn2"


def install(env: Mapping[str, str] | None = None) -> None:
    """Put both trees first on ``sys.path`` and the stand-ins in front of the import system (once);
    NxD's platform override names the chip the release runs on, unless it is already set."""
    env = os.environ if env is None else env
    reason = skip_reason(env)
    if reason is not None:
        raise RuntimeError(reason)
    if any(isinstance(finder, _HardwarePackages) for finder in sys.meta_path):
        return
    os.environ.setdefault(PLATFORM_VAR, platform_for(tree_version(env)))
    for var in reversed(SOURCE_VARS):
        root = str(source_root(env[var], PACKAGES[var]))
        if root not in sys.path:
            sys.path.insert(0, root)
    sys.meta_path.insert(0, _HardwarePackages())
    import torch

    torch.classes.neuron = _StandInModule("torch.classes.neuron")  # what torch_neuronx registers


def library_version() -> str:
    import neuronx_distributed_inference

    return str(neuronx_distributed_inference.__version__)
