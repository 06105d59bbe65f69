"""AWS's serving defaults against the library: fused QKV is on exactly where the application's weight
conversion fuses Q/K/V (``Application.fuses_qkv``).

The Llama, Qwen2 and Qwen3-MoE applications convert q/k/v weights into ``Wqkv`` (0.8.0 and 0.9.0), as
do 0.9's Qwen3 and Gemma 3; 0.9's Mistral application, 0.8's Qwen3 and both releases' Mixtral keep them
apart, and their fused projection then finds no weights (``KeyError`` naming ``Wqkv``). A Mistral on
0.8 runs on the Llama application and fuses.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from neuron_lmi.backends.nxdi.runner import on_cpu_application
from tests.backends.nxdi.test_families import tiny_checkpoint
from tests.backends.nxdi_library.conftest import ARCHES, nxdi_plan, probe_forward

pytestmark = pytest.mark.usefixtures("one_thread", "cpu_forward")


def fused_weights(app: Any) -> bool:
    names = [name for name, _ in app.named_parameters() if ".self_attn.qkv_proj." in name]
    assert names
    return all(".Wqkv." in name for name in names)


@pytest.mark.parametrize("arch", ARCHES)
def test_fused_qkv_is_on_where_the_library_fuses_the_weights(arch: str, tmp_path: Path) -> None:
    checkpoint = tiny_checkpoint(tmp_path / arch, arch, 32)
    plan, _ = nxdi_plan(checkpoint, 2, 32)
    fuses = plan.application.fuses_qkv
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
