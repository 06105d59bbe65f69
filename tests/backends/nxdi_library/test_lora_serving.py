"""Multi-LoRA serving on the real classes (``modules/lora_serving/``), and where its CPU mode stops.

What runs, on the release under test: the plan's ``LoraServingConfig`` keywords (two PEFT adapters of
ranks 4 and 8 over different modules) are taken by the real ``LoraServingConfig`` and
``NeuronConfig(lora_config=...)``, the application's ``LoraModelManager`` numbers the adapters as the
plan does (0.9: index 0 the base model), and ``to_cpu()`` builds the LoRA layers and loads the
adapters (its ``get_sharded_checkpoint`` runs NxD's ``preprocess_checkpoint``, which calls
``update_weights_for_lora`` on a LoRA-wrapped model). The first forward then fails: the model appends
the LoRA layers' tensors to its outputs after the K/V caches (``model_base.py`` ``outputs +=
lora_weights``, for the device to alias them), and in the CPU path ``_copy_past_key_values`` writes
every output after the logits into the K/V list, one past its end (``IndexError``). So rows with
different adapters cannot be run on the library's code here: checked no further than that.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from neuron_lmi.backends.nxdi.artifacts import new_application
from neuron_lmi.backends.nxdi.plan import plan_nxdi
from neuron_lmi.backends.nxdi.runner import on_cpu_application
from neuron_lmi.config import load_config
from neuron_lmi.config.hf_config import read_hf_config
from neuron_lmi.testing.checkpoints import make_tiny_checkpoint
from neuron_lmi.testing.lora import make_tiny_adapter
from tests.backends.nxdi_library import library

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("lora")
    base = make_tiny_checkpoint(root / "base", arch="llama")
    one = make_tiny_adapter(root / "one", base, 4, ("q_proj", "v_proj"), seed=1)
    two = make_tiny_adapter(root / "two", base, 8, ("q_proj", "down_proj"), seed=2)
    return base, one, two


def lora_plan(folders: tuple[Path, Path, Path], on_cpu: bool) -> Any:
    base, one, two = folders
    props = base.parent / f"lora-{on_cpu}.properties"
    props.write_text(
        f"option.model_id={base}\noption.model_loader=nxdi\noption.max_rolling_batch_size=2\n"
        "option.n_positions=64\noption.dtype=fp32\noption.tensor_parallel_degree=1\n"
        f"option.on_device_sampling=false\noption.enable_lora=true\noption.max_lora_rank=8\n"
        f"option.lora_modules=one={one},two={two}\n"
        + ('option.override_neuron_config={"on_cpu": true}\n' if on_cpu else ""),
        encoding="utf-8",
    )
    config = load_config(properties_path=props, env={}).config
    version = library.library_version()
    return plan_nxdi(
        config, read_hf_config(base, "tier"), str(base), None, version, library.platform_for(version)
    )


def test_the_real_classes_take_the_lora_serving_config(
    folders: tuple[Path, Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    plan = lora_plan(folders, on_cpu=False)
    with caplog.at_level(logging.DEBUG):
        app = new_application(plan)
    assert [r.getMessage() for r in caplog.records if "Unexpected keyword" in r.getMessage()] == []
    built = app.neuron_config.lora_config
    assert type(built).__name__ == "LoraServingConfig"
    given = plan.lora.kwargs
    base_only = given.get("enable_base_model_only", False)
    assert built.max_loras == given["max_loras"] + base_only  # the library adds the base model's
    assert built.max_lora_rank == 8 and built.batch_size == 2 and built.dynamic_multi_lora is False
    assert built.lora_ckpt_paths == given["lora_ckpt_paths"]
    assert set(given["target_modules"]) <= set(built.target_modules)
    mapping = app.lora_model_manager.lora_adapter_id_mapping
    assert mapping == {name: plan.lora.index(name) for name in plan.lora.names}
    assert base_only is (library.library_version() != "0.8.0")


def test_the_cpu_mode_builds_it_and_its_first_forward_fails(folders: tuple[Path, Path, Path]) -> None:
    plan = lora_plan(folders, on_cpu=True)
    app = on_cpu_application(plan)  # to_cpu() itself runs: the LoRA layers are built
    assert any("lora_A" in name for name, _ in app.context_encoding_model.model.named_parameters())
    layers = json.loads((folders[0] / "config.json").read_text())["num_hidden_layers"]
    seen: list[int] = []
    copy = app._copy_past_key_values

    def counted(outputs: list[Any]) -> Any:  # observes the outputs, changes nothing
        seen.append(len(outputs))
        return copy(outputs)

    app._copy_past_key_values = counted
    with pytest.raises(IndexError, match="out of range"), torch.inference_mode():
        app(
            input_ids=torch.tensor([[5, 6, 7, 8]]),
            attention_mask=torch.ones(1, 4, dtype=torch.long),
            position_ids=torch.arange(4)[None],
            seq_ids=torch.tensor([0]),
            adapter_ids=torch.tensor([plan.lora.index("one")], dtype=torch.int32),
        )
    assert seen and seen[0] > 1 + 2 * layers  # logits, the K/V caches, then the LoRA layers' tensors
