"""transformers-neuronx argument mapping, from serving.properties-like settings to exact kwargs."""

from __future__ import annotations

import json
import sys
import types

import pytest

from neuron_lmi.backends.tnx.args import (
    MappedNeuronArgs,
    NeuronCompileSpec,
    build_neuron_config,
    map_compile_spec,
    tnx_context_buckets,
    tnx_token_buckets,
)


def llama_70b_inf2_48xlarge() -> NeuronCompileSpec:
    # option.model_id=meta-llama/Llama-2-70b-hf, option.tensor_parallel_degree=24,
    # option.max_rolling_batch_size=4, option.n_positions=4096, option.dtype=fp16
    return NeuronCompileSpec(
        model_path="/opt/ml/model/Llama-2-70b-hf",
        tp_degree=24,
        batch_size=4,
        n_positions=4096,
        dtype="fp16",
    )


def mistral_7b_tp8_bf16() -> NeuronCompileSpec:
    # option.tensor_parallel_degree=8, option.max_rolling_batch_size=32, option.dtype=bf16,
    # option.n_positions=4096, option.context_length_estimate=1024,256,512 (LMI's comma list),
    # option.group_query_attention=shard-over-heads, option.fuse_qkv=true,
    # option.neuron_optimize_level=2, option.enable_saturate_infinity=true,
    # option.enable_mixed_precision_accumulation=true, option.quantize=static_int8,
    # option.compiled_graph_path=s3://bucket/neff/mistral-7b/
    return NeuronCompileSpec(
        model_path="/opt/ml/model/Mistral-7B-Instruct-v0.1",
        tp_degree=8,
        batch_size=32,
        n_positions=4096,
        dtype="bf16",
        context_length_estimate=(1024, 256, 512),
        group_query_attention="shard-over-heads",
        fuse_qkv=True,
        quantize="static_int8",
        neuron_optimize_level=2,
        enable_saturate_infinity=True,
        enable_mixed_precision_accumulation=True,
        compiled_graph_path="s3://bucket/neff/mistral-7b/",
    )


def test_llama_70b_maps_to_exact_arguments():
    mapped = map_compile_spec(llama_70b_inf2_48xlarge())
    assert mapped.model_path == "/opt/ml/model/Llama-2-70b-hf"
    assert mapped.from_pretrained_kwargs == {
        "batch_size": 4,
        "tp_degree": 24,
        "n_positions": 4096,
        "amp": "f16",
        # Passed explicitly: the library's default (half of each token bucket) stops at 2048.
        "context_length_estimate": [128, 256, 512, 1024, 2048, 4096],
    }
    assert mapped.neuron_config == {
        "continuous_batching": {"batch_size_for_shared_caches": 4},
        "group_query_attention": None,
        "fuse_qkv": False,
        "padding_side": "right",
        "quant": None,
    }
    assert mapped.env == {}
    assert mapped.token_buckets == (128, 256, 512, 1024, 2048, 4096)
    assert mapped.context_buckets == (128, 256, 512, 1024, 2048, 4096)
    assert mapped.notes == ()


def test_mistral_maps_to_exact_arguments():
    mapped = map_compile_spec(mistral_7b_tp8_bf16())
    assert mapped.from_pretrained_kwargs == {
        "batch_size": 32,
        "tp_degree": 8,
        "n_positions": 4096,
        "amp": "bf16",
        "context_length_estimate": [256, 512, 1024],
    }
    assert mapped.neuron_config == {
        "continuous_batching": {"batch_size_for_shared_caches": 32},
        "group_query_attention": "shard-over-heads",
        "fuse_qkv": True,
        "padding_side": "right",
        "quant": {"quant_dtype": "s8", "dequant_dtype": "bf16"},
    }
    assert mapped.env == {
        "NEURON_CC_FLAGS": "-O2 --enable-saturate-infinity --enable-mixed-precision-accumulation",
        "NEURON_COMPILE_CACHE_URL": "s3://bucket/neff/mistral-7b/",
    }
    assert mapped.context_buckets == (256, 512, 1024)
    json.dumps([mapped.from_pretrained_kwargs, mapped.neuron_config, mapped.env])  # plain values only


def test_existing_cc_flags_are_kept_and_opt_level_replaced():
    spec = mistral_7b_tp8_bf16()
    mapped = map_compile_spec(
        spec, existing_cc_flags="--model-type=transformer --optlevel 1 --enable-saturate-infinity"
    )
    assert mapped.env["NEURON_CC_FLAGS"] == (
        "--model-type=transformer --enable-saturate-infinity -O2 --enable-mixed-precision-accumulation"
    )
    mapped = map_compile_spec(spec, existing_cc_flags="-O3 --auto-cast=none")
    assert mapped.env["NEURON_CC_FLAGS"].split() == [
        "--auto-cast=none",
        "-O2",
        "--enable-saturate-infinity",
        "--enable-mixed-precision-accumulation",
    ]


@pytest.mark.parametrize(("dtype", "amp"), [("fp32", "f32"), ("fp16", "f16"), ("bf16", "bf16")])
def test_dtype_to_amp(dtype, amp):
    spec = NeuronCompileSpec("m", tp_degree=2, batch_size=1, n_positions=128, dtype=dtype)
    assert map_compile_spec(spec).from_pretrained_kwargs["amp"] == amp


@pytest.mark.parametrize(
    ("n_positions", "tokens"),
    [
        (64, (64,)),
        (128, (128,)),
        (2048, (128, 256, 512, 1024, 2048)),
        (3000, (128, 256, 512, 1024, 2048, 3000)),
    ],
)
def test_token_buckets_double_from_128(n_positions, tokens):
    assert tnx_token_buckets(n_positions) == tokens
    # Context buckets reach n_positions (the library's default would stop at half of it).
    assert tnx_context_buckets(n_positions) == tokens
    assert tnx_context_buckets(n_positions)[-1] == n_positions
    assert tnx_context_buckets(n_positions, (100, 50)) == (50, 100)  # estimates are kept as given


def test_gqa_names_are_normalised():
    spec = NeuronCompileSpec("m", 8, 4, 1024, group_query_attention="Replicated-Heads")
    assert spec.group_query_attention == "replicated-heads"


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"tp_degree": 0}, "tp_degree"),
        ({"batch_size": -1}, "batch_size"),
        ({"dtype": "int8"}, "dtype"),
        ({"context_length_estimate": (512, 8192)}, "exceeds n_positions"),
        ({"context_length_estimate": (0,)}, "positive integers"),
        ({"group_query_attention": "shard-over-rows"}, "shard-over-rows"),
        ({"quantize": "awq"}, "quantize"),
        ({"neuron_optimize_level": 4}, "neuron_optimize_level"),
        ({"model_path": ""}, "model_path"),
    ],
)
def test_invalid_specs_raise_value_error(change, words):
    base = {"model_path": "m", "tp_degree": 8, "batch_size": 4, "n_positions": 4096}
    with pytest.raises(ValueError, match=words):
        NeuronCompileSpec(**(base | change))


def test_spec_is_frozen():
    with pytest.raises(AttributeError):
        llama_70b_inf2_48xlarge().tp_degree = 8  # type: ignore[misc]


def test_build_neuron_config_without_the_sdk_names_the_packages(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers_neuronx", None)  # makes the import fail
    with pytest.raises(RuntimeError) as exc:
        build_neuron_config(map_compile_spec(mistral_7b_tp8_bf16()))
    message = str(exc.value)
    for package in ("transformers-neuronx", "torch-neuronx", "neuronx-cc"):
        assert package in message
    assert "Neuron pip repository" in message and "pip.repos.neuron.amazonaws.com" in message


def test_build_neuron_config_wires_the_library_classes(monkeypatch):
    """A stand-in module records the constructor calls, so the wiring is checked without the SDK."""

    class Recorder:
        def __init__(self, *args: object, **kwargs: object) -> None:
            self.args, self.kwargs = args, kwargs

    fake = types.ModuleType("transformers_neuronx")
    fake_config = types.ModuleType("transformers_neuronx.config")
    for name in ("NeuronConfig", "QuantizationConfig", "GQA"):
        setattr(fake, name, type(name, (Recorder,), {}))
    fake_config.ContinuousBatchingConfig = type("ContinuousBatchingConfig", (Recorder,), {})
    fake.config = fake_config
    monkeypatch.setitem(sys.modules, "transformers_neuronx", fake)
    monkeypatch.setitem(sys.modules, "transformers_neuronx.config", fake_config)

    config = build_neuron_config(map_compile_spec(mistral_7b_tp8_bf16()))
    assert type(config).__name__ == "NeuronConfig"
    assert config.kwargs["continuous_batching"].kwargs == {"batch_size_for_shared_caches": 32}
    assert config.kwargs["group_query_attention"].args == ("shard-over-heads",)
    assert config.kwargs["quant"].kwargs == {"quant_dtype": "s8", "dequant_dtype": "bf16"}
    assert (config.kwargs["fuse_qkv"], config.kwargs["padding_side"]) == (True, "right")
    plain = build_neuron_config(map_compile_spec(llama_70b_inf2_48xlarge()))
    assert "group_query_attention" not in plain.kwargs and "quant" not in plain.kwargs


def test_continuous_batching_keyword_is_the_one_every_release_accepts(monkeypatch):
    """Releases before 0.13 define ``ContinuousBatchingConfig(batch_size_for_shared_caches)`` only."""

    class OldContinuousBatchingConfig:
        def __init__(self, batch_size_for_shared_caches: int) -> None:
            self.batch_size_for_shared_caches = batch_size_for_shared_caches

    fake = types.ModuleType("transformers_neuronx")
    fake_config = types.ModuleType("transformers_neuronx.config")
    fake.NeuronConfig = lambda **kwargs: kwargs
    fake.QuantizationConfig = fake.GQA = lambda *a, **k: (a, k)
    fake_config.ContinuousBatchingConfig = OldContinuousBatchingConfig
    monkeypatch.setitem(sys.modules, "transformers_neuronx", fake)
    monkeypatch.setitem(sys.modules, "transformers_neuronx.config", fake_config)
    config = build_neuron_config(map_compile_spec(llama_70b_inf2_48xlarge()))
    assert config["continuous_batching"].batch_size_for_shared_caches == 4


@pytest.mark.parametrize(
    ("tp", "geometry", "passed", "runs", "why"),
    [
        # Llama-2-70B: 64 query / 8 KV heads. Context decoders have batch 1: 1 % tp != 0.
        (8, (64, 8, 128), "shard-over-heads", "shard-over-heads", "batch 1"),
        (24, (64, 8, 128), "replicated-heads", "replicated-heads", "KV heads are replicated"),
        (1, (64, 8, 128), "shard-over-batch", "shard-over-batch", None),  # 1 % 1 == 0: kept
        (8, None, "shard-over-heads", "shard-over-heads", "geometry unknown"),
    ],
)
def test_shard_over_batch_under_continuous_batching_reports_what_runs(tp, geometry, passed, runs, why):
    heads = dict(zip(("n_query_heads", "n_kv_heads", "head_dim"), geometry, strict=True)) if geometry else {}
    spec = NeuronCompileSpec("m", tp, 32, 4096, group_query_attention="shard-over-batch", **heads)
    mapped = map_compile_spec(spec)
    assert mapped.neuron_config["group_query_attention"] == passed
    assert mapped.gqa_strategy == runs
    if why is None:
        assert mapped.notes == ()
    else:
        (note,) = mapped.notes
        assert why in note and "shard-over-batch" in note


def test_honoured_requests_and_library_defaults_pass_unchanged():
    mha = map_compile_spec(NeuronCompileSpec("m", 8, 4, 1024, n_query_heads=32, n_kv_heads=32, head_dim=128))
    assert (mha.neuron_config["group_query_attention"], mha.gqa_strategy, mha.notes) == (
        None, "shard-over-heads", ()
    )  # fmt: skip
    gqa = map_compile_spec(NeuronCompileSpec("m", 8, 4, 1024, n_query_heads=64, n_kv_heads=8, head_dim=128))
    assert (gqa.neuron_config["group_query_attention"], gqa.gqa_strategy) == (None, "shard-over-heads")
    with pytest.raises(ValueError, match="both or neither"):
        NeuronCompileSpec("m", 8, 4, 1024, n_query_heads=64)


def test_build_neuron_config_with_the_real_library():
    pytest.importorskip("transformers_neuronx", reason="needs the AWS Neuron SDK (transformers-neuronx)")
    from transformers_neuronx import GQA

    mapped: MappedNeuronArgs = map_compile_spec(mistral_7b_tp8_bf16())
    config = build_neuron_config(mapped)
    assert config.continuous_batching.batch_size_for_shared_caches == 32
    assert config.group_query_attention == GQA.SHARD_OVER_HEADS
    assert config.padding_side == "right" and config.fuse_qkv is True
    assert config.quant.quant_dtype == "s8" and config.quant.dequant_dtype == "bf16"
