"""LoRA configuration: LMI's and vLLM's keys, the --lora-modules forms, and the CPU engine's view
(start-up adapters from option.lora_modules and the model directory's adapters/ folder)."""

from __future__ import annotations

from pathlib import Path

import pytest

from neuron_lmi.backends.lora import base_names_of, resolve_lora
from neuron_lmi.config import ConfigError, cli_overrides, format_config


def test_keys_from_properties_environment_and_cli(load, write_props, tmp_path: Path) -> None:
    props = write_props("option.enable_lora=true\noption.max_loras=2\noption.lora_modules=a=/x/a, b=/x/b\n")
    lora = load(properties=props, env={"OPTION_MAX_LORA_RANK": "32"}).config.lora
    assert (lora.enable_lora, lora.max_loras, lora.max_lora_rank, lora.cpu_loras) == (True, 2, 32, 2)
    assert lora.lora_modules == (("a", "/x/a"), ("b", "/x/b"))
    assert "a=/x/a,b=/x/b" in format_config(load(properties=props))  # printed as it reads back
    json_list = '[{"name": "a", "path": "s3://bucket/a"}]'
    assert load(env={"OPTION_LORA_MODULES": json_list}).config.lora.lora_modules == (("a", "s3://bucket/a"),)
    cli = cli_overrides({"enable_lora": True, "lora_modules": ["c=/x/c"], "max_cpu_loras": 8, "port": None})
    lora = load(cli=cli).config.lora
    assert lora.enable_lora and lora.lora_modules == (("c", "/x/c"),) and lora.cpu_loras == 8
    assert load().config.lora.enable_lora is False


@pytest.mark.parametrize(
    ("env", "key", "reason"),
    [
        ({"OPTION_LORA_MODULES": "just-a-path"}, "OPTION_LORA_MODULES", "not name=path"),
        ({"OPTION_MAX_LORA_RANK": "0"}, "OPTION_MAX_LORA_RANK", "greater than or equal to 1"),
        (
            {"OPTION_MAX_LORAS": "4", "OPTION_MAX_CPU_LORAS": "2"},
            "OPTION_MAX_CPU_LORAS",
            "at least max_loras=4",
        ),
    ],
)
def test_bad_values_name_the_key(load, env: dict[str, str], key: str, reason: str) -> None:
    with pytest.raises(ConfigError, match=reason) as info:
        load(env=env)
    assert info.value.key == key


def test_cpu_view_finds_adapters_folder_and_refuses_repeats(load, tmp_path: Path) -> None:
    model = tmp_path / "model"
    for name in ("sql", "chat"):
        (model / "adapters" / name).mkdir(parents=True)
    given = tmp_path / "given"
    given.mkdir()
    lora = resolve_lora(load(cli={"enable_lora": True, "lora_modules": f"x={given}"}), model, {})
    assert lora is not None
    assert lora.modules == (
        ("x", str(given.resolve())),
        ("chat", str(model / "adapters" / "chat")),
        ("sql", str(model / "adapters" / "sql")),
    )
    assert resolve_lora(load(), model, {}) is None  # adapters/ alone does not turn LoRA on
    with pytest.raises(ValueError, match=r"needs option\.enable_lora"):
        resolve_lora(load(cli={"lora_modules": f"x={given}"}), model, {})
    with pytest.raises(ValueError, match=r"\['sql'\] given twice"):
        resolve_lora(load(cli={"enable_lora": True, "lora_modules": f"sql={given}"}), model, {})


def test_base_names_are_hub_ids_only(tmp_path: Path) -> None:
    """A Hub id names the base model an adapter records; a directory, S3 prefix or /opt/ml/model does not."""
    assert base_names_of("meta-llama/Llama-3.1-8B", tmp_path) == ("meta-llama/Llama-3.1-8B",)
    assert base_names_of(str(tmp_path), tmp_path) == ()
    assert base_names_of("s3://bucket/llama", tmp_path) == ()
    assert base_names_of(None, tmp_path) == ()
