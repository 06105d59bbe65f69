"""Fused speculation on the real classes: what can be checked of it on a CPU.

NxD Inference's CPU mode refuses speculation (``to_cpu``: "Speculation is not yet supported for CPU
inference", ``models/application_base.py``), so no forward of ``NeuronFusedSpecModel`` runs here; its
inputs and outputs were read from the source (docs/verification.md) and are modelled by the contract
model (``tests/backends/nxdi/test_fused_speculation.py``). What runs here, on the release under test:
the plan's keywords for a draft model, EAGLE and EAGLE3 are taken by the real ``NeuronConfig`` (no
"Unexpected keyword arguments", every value kept), the real ``InferenceConfig`` takes the real
``FusedSpecNeuronConfig`` with the draft's own config, the application builds its fused-speculation
model in place of token generation, and ``to_cpu`` stops exactly at that refusal.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest

from neuron_lmi.backends.nxdi.artifacts import new_application
from tests.backends.nxdi.test_plan import LLAMA_3_8B
from tests.backends.nxdi_library.test_neuron_config_kwargs import plan_for

K = 4
DRAFT = {**LLAMA_3_8B, "hidden_size": 2048, "num_hidden_layers": 16, "intermediate_size": 8192}
BASE = "option.tensor_parallel_degree=8\noption.max_rolling_batch_size=8\noption.n_positions=1024\n"


def fused_plan(tmp_path: Path, method: str, base: str = BASE) -> Any:
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps(DRAFT), encoding="utf-8")
    value = {"method": method, "model": str(draft), "num_speculative_tokens": K}
    return plan_for(tmp_path, LLAMA_3_8B, f"{base}option.speculative_config={json.dumps(value)}\n")


@pytest.mark.parametrize("method", ["draft_model", "eagle", "eagle3"])
def test_the_real_classes_take_the_fused_speculation_keywords(
    tmp_path: Path, method: str, caplog: pytest.LogCaptureFixture
) -> None:
    plan = fused_plan(tmp_path, method)
    with caplog.at_level(logging.DEBUG):
        app = new_application(plan)
    unexpected = [r.getMessage() for r in caplog.records if "Unexpected keyword" in r.getMessage()]
    assert unexpected == []
    built = app.config.neuron_config
    for key, value in plan.kwargs().items():
        if key != "on_device_sampling_config":
            assert getattr(built, key) == value, key
    assert built.speculation_length == K + 1 and built.enable_fused_speculation is True
    assert built.enable_eagle_speculation is (method != "draft_model")
    assert built.is_eagle3 is (method == "eagle3")

    fused = app.config.fused_spec_config
    assert type(fused).__name__ == "FusedSpecNeuronConfig"
    assert fused.worker_cls is type(app)._model_cls and fused.draft_model_path == plan.speculation.draft_path
    draft = fused.draft_config.neuron_config
    assert draft.enable_fused_speculation is False  # set after construction, as inference_demo.py does
    assert draft.is_eagle_draft is (method != "draft_model")
    assert draft.speculation_length == (0 if method == "draft_model" else K + 1)
    assert fused.draft_config.hidden_size == DRAFT["hidden_size"]
    assert fused.draft_config.num_hidden_layers == DRAFT["num_hidden_layers"]
    # the application built its fused model in place of token generation (model_base.py __init__)
    assert hasattr(app, "fused_spec_model") and not hasattr(app, "token_generation_model")
    assert app.get_generation_model() is app.fused_spec_model
    assert app.fused_spec_model.tag == "fused_speculation_model"


def test_the_cpu_mode_stops_at_its_refusal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where checking it by running stops: at one rank in fp32 (what the CPU mode takes), ``to_cpu``
    refuses before building anything."""
    one_rank = "option.tensor_parallel_degree=1\noption.max_rolling_batch_size=2\noption.dtype=fp32\n"
    plan = fused_plan(tmp_path, "draft_model", f"{one_rank}option.n_positions=256\n")
    app = new_application(plan)
    monkeypatch.setenv("NXD_CPU_MODE", os.environ.get("NXD_CPU_MODE", "0"))  # to_cpu sets it first
    with pytest.raises(NotImplementedError, match="Speculation is not yet supported for CPU inference"):
        app.to_cpu()
