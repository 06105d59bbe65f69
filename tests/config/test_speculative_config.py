"""``option.speculative_config``: vLLM's names and defaults, errors naming the key as written, the
vLLM pass-through."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from neuron_lmi.commands.serve import add_parser
from neuron_lmi.config import ConfigError, cli_overrides, format_config, write_properties
from neuron_lmi.config.speculative import SpeculativeConfig

NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'


def test_properties_json_becomes_a_typed_setting_with_vllms_defaults(load, write_props) -> None:
    resolved = load(properties=write_props(f"option.speculative_config={NGRAM}\n"))
    assert resolved.config.batching.speculative_config == SpeculativeConfig("ngram", 3, 4, 4)
    assert resolved.source_of("speculative_config").startswith("serving.properties")
    both_default = load(env={"OPTION_SPECULATIVE_CONFIG": '{"method": "ngram", "num_speculative_tokens": 2}'})
    assert both_default.config.batching.speculative_config == SpeculativeConfig("ngram", 2, 5, 5)
    assert load().config.batching.speculative_config is None


def test_the_cli_flag_and_the_written_properties_round_trip(load, tmp_path: Path) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--speculative-config", NGRAM])
    resolved = load(cli=cli_overrides(args))
    assert resolved.config.batching.speculative_config == SpeculativeConfig("ngram", 3, 4, 4)
    assert resolved.source_of("speculative_config") == "cli"
    written = write_properties(resolved, tmp_path / "serving.properties")
    assert json.loads(written["option.speculative_config"]) == {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_min": 4,
        "prompt_lookup_max": 4,
    }
    again = load(properties=tmp_path / "serving.properties")
    assert again.config.batching.speculative_config == resolved.config.batching.speculative_config
    assert "option.speculative_config" in format_config(resolved)


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ('{"method": "lookahead", "num_speculative_tokens": 2}', "'lookahead' is not a speculative method"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "must be an integer >= 1, got 0"),
        ('{"method": "ngram"}', "num_speculative_tokens is required"),
        (
            '{"method": "ngram", "num_speculative_tokens": 2,"prompt_lookup_min": 4, "prompt_lookup_max": 2}',
            "prompt_lookup_min=4 must be <= prompt_lookup_max=2",
        ),
        ('{"method": "ngram", "num_speculative_tokens": 2, "lookup": 3}', "unknown field(s) lookup"),
        ("ngram", "must be a JSON object"),
    ],
)
def test_bad_settings_name_the_key_and_the_field(load, write_props, value: str, reason: str) -> None:
    with pytest.raises(ConfigError) as err:
        load(properties=write_props(f"option.speculative_config={value}\n"))
    assert err.value.key == "option.speculative_config"
    assert reason in err.value.reason
    with pytest.raises(ConfigError) as err:
        load(env={"OPTION_SPECULATIVE_CONFIG": value})
    assert err.value.key == "OPTION_SPECULATIVE_CONFIG"


def test_a_draft_model_is_a_valid_setting_the_engine_refuses(load) -> None:
    resolved = load(env={"OPTION_SPECULATIVE_CONFIG": '{"model": "org/draft", "num_speculative_tokens": 3}'})
    expected = SpeculativeConfig("draft_model", 3, model="org/draft")  # EngineCore refuses it
    assert resolved.config.batching.speculative_config == expected


def test_vllm_gets_the_parsed_key_when_it_serves(load, write_props) -> None:
    resolved = load(properties=write_props(f"option.rolling_batch=vllm\noption.speculative_config={NGRAM}\n"))
    # Parsed once here; gpu_fallback.config maps it onto vLLM's speculative_config.
    assert resolved.config.batching.speculative_config == SpeculativeConfig("ngram", 3, 4, 4)
    assert "speculative_config" not in resolved.vllm_options
    assert "option.speculative_config" not in resolved.ignored


def test_lmis_draft_model_keys_are_the_same_typed_setting(load, write_props) -> None:
    resolved = load(
        properties=write_props("option.speculative_draft_model=/models/draft\noption.speculative_length=3\n")
    )
    expected = SpeculativeConfig("draft_model", 3, model="/models/draft")
    assert resolved.config.batching.speculation == expected
    assert resolved.config.batching.speculation.key == "option.speculative_draft_model"
    alone = load(env={"OPTION_SPECULATIVE_DRAFT_MODEL": "org/draft"})  # LMI's default length: 5
    assert alone.config.batching.speculation == SpeculativeConfig("draft_model", 5, model="org/draft")
    vllm = load(env={"OPTION_SPECULATIVE_CONFIG": json.dumps({"method": "draft_model", "model": "org/draft",
                                                               "num_speculative_tokens": 5})})  # fmt: skip
    assert vllm.config.batching.speculation == alone.config.batching.speculation
    assert vllm.config.batching.speculation.key == "option.speculative_config"
    assert load().config.batching.speculation is None


@pytest.mark.parametrize(
    ("text", "key", "reason"),
    [
        ("option.speculative_length=0", "option.speculative_length", "greater than or equal to 1"),
        ("option.speculative_length=4", "option.speculative_length", "needs option.speculative_draft_model"),
        (
            f"option.speculative_draft_model=/d\noption.speculative_config={NGRAM}",
            "option.speculative_draft_model",
            "option.speculative_config is set too",
        ),
        (
            'option.speculative_config={"method": "draft_model", "num_speculative_tokens": 2}',
            "option.speculative_config",
            "method 'draft_model' needs model",
        ),
        (
            'option.speculative_config={"method": "draft_model", "model": "/d", "num_speculative_tokens": 0}',
            "option.speculative_config",
            "num_speculative_tokens must be an integer >= 1, got 0",
        ),
    ],
)
def test_bad_draft_model_settings_name_the_key(load, write_props, text: str, key: str, reason: str) -> None:
    with pytest.raises(ConfigError) as err:
        load(properties=write_props(text + "\n"))
    assert err.value.key == key
    assert reason in err.value.reason
