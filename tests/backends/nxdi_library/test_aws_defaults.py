"""AWS's serving defaults against the library: fused QKV is on exactly where the application's weight
conversion fuses Q/K/V.

Only ``NeuronLlamaForCausalLM`` converts q/k/v weights into ``Wqkv`` (0.8.0 and 0.9.0); 0.9's Mistral
application and both releases' Mixtral keep them apart, and their fused projection then finds no
weights (``KeyError`` naming ``Wqkv``). A Mistral on 0.8 runs on the Llama application and fuses.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from neuron_lmi.backends.nxdi.defaults import FUSED_QKV_APPLICATIONS
from neuron_lmi.backends.nxdi.runner import on_cpu_application
from neuron_lmi.testing.checkpoints import make_tiny_checkpoint
from tests.backends.nxdi_library.conftest import nxdi_plan, probe_forward

pytestmark = pytest.mark.usefixtures("one_thread", "cpu_forward")


def fused_weights(app: Any) -> bool:
    names = [name for name, _ in app.named_parameters() if ".self_attn.qkv_proj." in name]
    assert names
    return all(".Wqkv." in name for name in names)


@pytest.mark.parametrize("arch", ["llama", "mistral", "mixtral"])
def test_fused_qkv_is_on_where_the_library_fuses_the_weights(arch: str, tmp_path: Path) -> None:
    checkpoint = make_tiny_checkpoint(tmp_path / arch, arch=arch)
    plan, _ = nxdi_plan(checkpoint, 2, 32)
    fuses = plan.application.application in FUSED_QKV_APPLICATIONS
    assert plan.neuron_config["fused_qkv"] is fuses
    app = on_cpu_application(plan)
    assert fused_weights(app) is fuses
    logits = probe_forward(app).logits

    flipped = dataclasses.replace(plan, neuron_config={**plan.neuron_config, "fused_qkv": not fuses})
    if fuses:  # the same model unfused: the same logits
        other = on_cpu_application(flipped)
        assert not fused_weights(other)
        torch.testing.assert_close(probe_forward(other).logits, logits, rtol=0, atol=1e-5)
        return
    with pytest.raises(KeyError, match="Wqkv"):  # what the plan's refusal of fused_qkv spares a user
        on_cpu_application(flipped)
    with pytest.raises(ValueError, match=r"option\.fuse_qkv=True: .* does not fuse Q/K/V"):
        nxdi_plan(checkpoint, 2, 32, extra="option.fuse_qkv=true\n")
