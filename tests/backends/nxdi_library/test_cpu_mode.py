"""The CPU mode runs the product's path on both releases: where a release lacks the CPU-path method
its ``to_cpu`` forward calls, ``neuron_lmi.backends.nxdi.cpu_mode`` supplies it, and only then.

On 0.8.0 the library's own application fails for that reason (checked here, so a fixed 0.8.x shows
up); on 0.9.0 it runs as released and nothing is supplied. Either way the library's class stays as
released: the method is bound to the one application object.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from neuron_lmi.backends.nxdi.artifacts import new_application
from neuron_lmi.backends.nxdi.cpu_mode import missing_cpu_methods
from neuron_lmi.backends.nxdi.runner import on_cpu_application
from neuron_lmi.backends.nxdi.support import release
from neuron_lmi.testing.checkpoints import make_tiny_checkpoint
from tests.backends.nxdi_library import library
from tests.backends.nxdi_library.conftest import KNOWN_CPU_FAILURE, nxdi_plan, probe_forward

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_product_supplies_what_the_release_lacks(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from neuronx_distributed_inference.models.model_base import NeuronBaseForCausalLM

    old = (release(library.library_version()) or (0, 9)) <= (0, 8)
    assert hasattr(NeuronBaseForCausalLM, KNOWN_CPU_FAILURE) is not old  # 0.9.0 defines it

    plan, _ = nxdi_plan(make_tiny_checkpoint(tmp_path / "llama", arch="llama"), 2, 32)
    released = new_application(plan)
    assert missing_cpu_methods(released, on_cpu=True) == ((KNOWN_CPU_FAILURE,) if old else ())
    assert missing_cpu_methods(released, on_cpu=False) == ()
    released.to_cpu()
    if old:
        with pytest.raises(AttributeError, match=KNOWN_CPU_FAILURE):
            probe_forward(released)
    else:
        probe_forward(released)

    with caplog.at_level(logging.INFO, logger="neuron_lmi.backends.nxdi.cpu_mode"):
        app = on_cpu_application(plan)
    said = [r.getMessage() for r in caplog.records if KNOWN_CPU_FAILURE in r.getMessage()]
    assert len(said) == (1 if old else 0)
    if old:
        assert "supplied as 0.9.0 defines it" in said[0] and library.library_version() in said[0]
    logits = probe_forward(app).logits
    assert logits.shape[0] == 1 and torch.isfinite(logits).all()
    assert app._get_captured_tensors_offset() == 0  # no tensor_capture_config: 0.9.0's answer
    assert hasattr(NeuronBaseForCausalLM, KNOWN_CPU_FAILURE) is not old  # the class is as released
