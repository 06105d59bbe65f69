"""NxD Inference's CPU mode (``NeuronConfig(on_cpu=True)``, then ``to_cpu()``), made to run on 0.8.

NxD Inference 0.8.0 (cd3abf3) cannot run a text model's forward on the CPU as released: after every
forward that is not on a device, ``NeuronBaseForCausalLM._copy_past_key_values`` (``models/
model_base.py``) calls ``self._get_captured_tensors_offset()``, which 0.8.0 defines only on its
image-to-text base, so every request fails with ``AttributeError``. 0.9.0 (4bcdc54) defines it on the
causal-LM base: how many tensors ``tensor_capture_config`` adds to the outputs ahead of the KV cache
(that config's ``get_offset()``), 0 without one. On a device the path is never taken.

In the CPU mode only, where the application lacks the method, ``supply_cpu_methods`` binds that
behaviour to the one application object (its class, and every other user of the library in the
process, stay as released) and says so in the start-up log. A release that has the method runs
unaided.
"""

from __future__ import annotations

import logging
import types
from typing import Any

log = logging.getLogger(__name__)

CAPTURED_TENSORS_OFFSET = "_get_captured_tensors_offset"


def captured_tensors_offset(app: Any) -> int:
    """0.9.0's answer: the captured tensors' count from ``tensor_capture_config``, 0 without one."""
    capture = getattr(app.neuron_config, "tensor_capture_config", None)
    return int(capture.get_offset()) if capture else 0


def missing_cpu_methods(app: Any, on_cpu: bool) -> tuple[str, ...]:
    """The CPU-path methods the application lacks and the CPU mode calls; none off the CPU mode."""
    if not on_cpu or callable(getattr(app, CAPTURED_TENSORS_OFFSET, None)):
        return ()
    return (CAPTURED_TENSORS_OFFSET,)


def supply_cpu_methods(app: Any, on_cpu: bool, library_version: str) -> tuple[str, ...]:
    """Bind what ``missing_cpu_methods`` names to ``app``; returns the names supplied."""
    missing = missing_cpu_methods(app, on_cpu)
    for name in missing:
        setattr(app, name, types.MethodType(captured_tensors_offset, app))
        log.info(
            "NxD Inference %s lacks %s.%s, which its CPU mode calls after every forward: supplied as "
            "0.9.0 defines it (the tensors tensor_capture_config adds to the outputs, 0 without one)",
            library_version,
            type(app).__name__,
            name,
        )
    return missing
