"""NxD Inference's multi-LoRA serving: ``option.enable_lora`` and the adapters onto ``LoraServingConfig``
for 0.8 and 0.9 (``backends.nxdi.lora``), and the refusal to serve it yet."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from neuron_lmi.backends.backend import CompileOptions
from neuron_lmi.backends.nxdi.backend import NXDI_BACKEND
from neuron_lmi.backends.nxdi.plan import plan_nxdi
from neuron_lmi.backends.registry import BuildRequest
from neuron_lmi.config import load_config
from neuron_lmi.config.hf_config import read_hf_config
from neuron_lmi.models.lora import AdapterError
from neuron_lmi.testing.checkpoints import make_tiny_checkpoint
from neuron_lmi.testing.lora import make_tiny_adapter


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("base"), arch="llama")


def adapters(tmp_path: Path, base: Path) -> tuple[Path, Path]:
    one = make_tiny_adapter(tmp_path / "one", base, 4, ("q_proj", "v_proj"), seed=1)
    two = make_tiny_adapter(tmp_path / "two", base, 8, ("q_proj", "down_proj"), seed=2)
    return one, two


def plan(tmp_path: Path, base: Path, extra: str, version: str) -> Any:
    props = tmp_path / "serving.properties"
    props.write_text(
        f"option.model_id={base}\noption.model_loader=nxdi\noption.max_rolling_batch_size=4\n"
        f"option.n_positions=64\noption.tensor_parallel_degree=1\n{extra}",
        encoding="utf-8",
    )
    config = load_config(properties_path=props, env={}).config
    platform = "trn1" if version == "0.8.0" else "trn2"
    return plan_nxdi(config, read_hf_config(base, "test"), str(base), None, version, platform)


@pytest.mark.parametrize("version", ["0.8.0", "0.9.0"])
def test_the_adapters_map_onto_lora_serving_config(tmp_path: Path, base: Path, version: str) -> None:
    one, two = adapters(tmp_path, base)
    extra = (
        "option.enable_lora=true\noption.max_loras=1\noption.max_lora_rank=8\n"
        f"option.lora_modules=one={one},two={two}\n"
    )
    p = plan(tmp_path, base, extra, version)
    lora = p.lora
    assert lora.kwargs["lora_ckpt_paths"] == {"one": str(one), "two": str(two)}
    assert lora.kwargs["max_loras"] == 2 and lora.kwargs["max_lora_rank"] == 8  # every adapter fits
    assert lora.kwargs["target_modules"] == ["q_proj", "v_proj", "down_proj"]
    assert lora.kwargs["batch_size"] == 4 and lora.kwargs["dynamic_multi_lora"] is False
    if version == "0.9.0":  # index 0 is the base model (enable_base_model_only)
        assert lora.kwargs["enable_base_model_only"] is True
        assert [lora.index(n) for n in (None, "one", "two")] == [0, 1, 2]
    else:  # 0.8: no base index; adapter_ids default to zeros, the first adapter
        assert "enable_base_model_only" not in lora.kwargs
        assert [lora.index(n) for n in ("one", "two")] == [0, 1]
        with pytest.raises(ValueError, match="no base-model adapter index"):
            lora.index(None)
    assert "lora" in p.key_args() and "lora_ckpt_paths" not in p.key_args()["lora"]
    assert p.describe()["lora_config"]["max_loras"] == 2


def test_adapters_under_the_model_folder_are_found(tmp_path: Path) -> None:
    model = make_tiny_checkpoint(tmp_path / "model", arch="llama")
    make_tiny_adapter(model / "adapters" / "lmi", model, 4, ("q_proj",))
    p = plan(tmp_path, model, "option.enable_lora=true\n", "0.9.0")
    assert list(p.lora.kwargs["lora_ckpt_paths"]) == ["lmi"]


def test_an_adapter_past_max_lora_rank_is_refused_by_name(tmp_path: Path, base: Path) -> None:
    one, two = adapters(tmp_path, base)
    extra = f"option.enable_lora=true\noption.max_lora_rank=4\noption.lora_modules=one={one},two={two}\n"
    with pytest.raises(AdapterError, match=r"adapter 'two': rank 8 exceeds option\.max_lora_rank=4"):
        plan(tmp_path, base, extra, "0.9.0")


def test_no_adapter_is_refused(tmp_path: Path, base: Path) -> None:
    with pytest.raises(ValueError, match=r"option\.enable_lora: NxD Inference compiles its adapters in"):
        plan(tmp_path, base, "option.enable_lora=true\n", "0.9.0")


def test_serving_with_adapters_is_refused_at_start_up(tmp_path: Path, base: Path) -> None:
    one, _ = adapters(tmp_path, base)
    props = tmp_path / "serving.properties"
    props.write_text(
        f"option.model_id={base}\noption.model_loader=nxdi\noption.max_rolling_batch_size=4\n"
        f"option.n_positions=64\noption.tensor_parallel_degree=1\noption.enable_lora=true\n"
        f"option.lora_modules=one={one}\n",
        encoding="utf-8",
    )
    resolved = load_config(properties_path=props, env={})
    with pytest.raises(ValueError, match="does not yet pass each row's adapter"):
        NXDI_BACKEND.plan(BuildRequest(resolved, {}, "neuron-nxdi", 1), base, CompileOptions())
