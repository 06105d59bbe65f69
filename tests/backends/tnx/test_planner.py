"""Capacity planner: agreement with AWS's published tp choices, arithmetic, and input validation."""

from __future__ import annotations

import json

import pytest

from neuron_lmi.backends.tnx.planner import (
    ideal_weight_bytes_per_core,
    plan_all_instances,
    plan_instance,
    weight_bytes_per_core,
)
from neuron_lmi.parallel.catalog import (
    GIB,
    INSTANCES,
    PRESETS,
    ModelSpec,
    get_instance,
    load_model_spec,
    model_spec_from_config,
)
from neuron_lmi.parallel.gqa import build_sharding_plan


def _plan(model: str, instance: str, **kwargs):
    return plan_instance(load_model_spec(model), get_instance(instance), **kwargs)


@pytest.mark.parametrize(
    ("model", "instance", "dtype", "tp"),
    [
        ("llama-2-70b", "inf2.48xlarge", "fp16", 24),
        ("llama-2-70b", "trn1.32xlarge", "fp16", 32),
        ("mistral-7b", "inf2.48xlarge", "bf16", 8),
        ("llama-2-7b", "inf2.xlarge", "fp16", 2),
        ("llama-2-7b", "inf2.24xlarge", "fp16", 8),
        ("llama-2-13b", "inf2.24xlarge", "fp16", 8),
    ],
)
def test_recommendations_match_published_choices(model, instance, dtype, tp):
    plan = _plan(model, instance, dtype=dtype)
    assert plan.recommended_tp == tp, plan.reason


def test_mistral_tp8_bf16_on_inf2_48xlarge_leaves_three_replicas():
    plan = _plan("mistral-7b", "inf2.48xlarge", dtype="bf16", batch_size=32)
    pick = plan.recommended
    assert pick.tp_degree == 8 and pick.replicas == 3 and pick.fits
    assert pick.strategy == "shard-over-heads" and pick.fallback_reason is None
    assert pick.max_rows >= 32
    assert "3 replicas on 24 cores" in plan.reason


def test_llama_70b_needs_more_than_8_cores_and_uses_replicated_heads_at_24():
    plan = _plan("llama-2-70b", "inf2.48xlarge")
    by_tp = {o.tp_degree: o for o in plan.options}
    assert not by_tp[8].fits and by_tp[8].max_rows == 0  # 16 GiB of weights per core
    assert by_tp[24].strategy == "replicated-heads"
    assert (by_tp[24].query_heads_padded, by_tp[24].kv_heads_effective) == (72, 24)
    assert by_tp[24].padding_bytes_per_core > 0  # 8 dummy query heads + 3x KV weights
    assert "smallest degree that fits" in plan.reason


def test_70b_on_inf2_xlarge_does_not_fit():
    plan = _plan("llama-2-70b", "inf2.xlarge")
    assert plan.recommended_tp is None and plan.recommended is None
    assert "does not fit" in plan.reason and "weights alone" in plan.reason


def test_weights_are_exact_for_llama_7b_tp2():
    model = PRESETS["llama-2-7b"]
    plan = build_sharding_plan(32, 32, 128, 2)
    h, i, v = 4096, 11008, 32000
    per_layer = 4 * h * h // 2 + 3 * h * i // 2 + 2 * h
    expected = (32 * per_layer + h + h * v // 2) * 2
    assert weight_bytes_per_core(model, plan, 2) == expected
    assert ideal_weight_bytes_per_core(model, 2, 2) == expected  # nothing to pad at tp=2


def test_kv_bytes_per_row_and_rows_fit():
    plan = _plan("mistral-7b", "inf2.48xlarge", dtype="bf16")
    tp8 = next(o for o in plan.options if o.tp_degree == 8)
    assert tp8.kv_bytes_per_row_per_core == 2 * 32 * 4096 * 1 * 128 * 2  # one KV head per core
    budget = int(16 * GIB * 0.9)
    assert tp8.max_rows == (budget - tp8.weight_bytes_per_core) // tp8.kv_bytes_per_row_per_core


def test_every_strategy_is_costed_with_its_fallback():
    plan = _plan("llama-2-70b", "trn1.32xlarge", batch_size=32)
    tp32 = next(o for o in plan.options if o.tp_degree == 32)
    costs = {c.requested: c for c in tp32.strategies}
    assert set(costs) == {"shard-over-heads", "shard-over-batch", "replicated-heads", "all-gather-heads"}
    assert costs["shard-over-heads"].effective == "replicated-heads"
    # 32 rows % tp 32 == 0, but under continuous batching the context decoders are built with batch 1,
    # so transformers-neuronx replaces shard-over-batch at any tp > 1: the plan says what runs, and why.
    assert costs["shard-over-batch"].effective == "replicated-heads"
    assert "continuous batching" in (costs["shard-over-batch"].fallback_reason or "")
    assert costs["all-gather-heads"].effective == "all-gather-heads"
    # Split KV weights cost less than replicated ones.
    assert costs["all-gather-heads"].weight_bytes_per_core < costs["replicated-heads"].weight_bytes_per_core


def test_default_n_positions_and_json_round_trip():
    plan = _plan("mistral-7b", "inf2.xlarge")
    assert plan.n_positions == 4096  # min(32768, 4096)
    data = json.loads(json.dumps(plan.to_dict()))
    assert data["recommended_tp"] == 2 and data["options"][1]["tp_degree"] == 2


def test_all_instances_in_catalog_order():
    plans = plan_all_instances(PRESETS["llama-2-7b"])
    assert [p.instance for p in plans] == list(INSTANCES)
    assert INSTANCES["inf2.48xlarge"].tp_degrees == (1, 2, 4, 8, 24)
    assert INSTANCES["trn1.32xlarge"].tp_degrees == (1, 2, 8, 32)
    assert INSTANCES["inf2.24xlarge"].tp_degrees == (1, 2, 4, 8)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"dtype": "int4"}, "dtype"),
        ({"n_positions": 8192}, "max_position_embeddings"),
        ({"n_positions": 0}, "n_positions"),
        ({"batch_size": 0}, "batch_size"),
        ({"headroom": 1.5}, "headroom"),
    ],
)
def test_invalid_plan_inputs(kwargs, words):
    with pytest.raises(ValueError, match=words):
        _plan("llama-2-7b", "inf2.xlarge", **kwargs)


def test_unknown_instance_and_model():
    with pytest.raises(ValueError, match="unknown instance"):
        get_instance("inf2.4xlarge")
    with pytest.raises(ValueError, match="preset"):
        load_model_spec("llama-3-8b")


def test_preset_aliases():
    assert load_model_spec("meta-llama/Llama-2-70b-hf") is PRESETS["llama-2-70b"]
    assert load_model_spec("mistralai/Mistral-7B-v0.1") is PRESETS["mistral-7b"]


def test_model_from_directory_and_config_file(tmp_path):
    config = {
        "model_type": "llama",
        "num_hidden_layers": 30,
        "hidden_size": 576,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "intermediate_size": 1536,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    from_dir = load_model_spec(str(tmp_path))
    assert (from_dir.n_heads, from_dir.n_kv_heads, from_dir.head_dim) == (9, 3, 64)
    assert load_model_spec(str(tmp_path / "config.json")) == from_dir


def test_model_from_tiny_checkpoint(tiny_llama_dir):
    spec = load_model_spec(str(tiny_llama_dir))
    plan = plan_instance(spec, get_instance("inf2.xlarge"))
    assert plan.recommended_tp == 2


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"model_type": "gpt2"}, "model_type"),
        ({"num_key_value_heads": 4}, "multiple of"),
        ({"hidden_size": 100}, "not divisible"),
        ({"num_hidden_layers": 0}, "n_layers"),
        ({"vocab_size": None}, "lacks vocab_size"),
    ],
)
def test_inconsistent_configs_are_rejected(change, words):
    config = {
        "model_type": "mistral",
        "num_hidden_layers": 2,
        "hidden_size": 96,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 100,
    }
    config |= change
    config = {k: v for k, v in config.items() if v is not None}
    with pytest.raises(ValueError, match=words):
        model_spec_from_config(config)


def test_model_spec_is_frozen():
    with pytest.raises(AttributeError):
        PRESETS["llama-2-7b"].n_layers = 1  # type: ignore[misc]
    assert ModelSpec("x", 1, 64, 4, 2, 128, 10, 128).head_dim == 16


def _parameters(spec: ModelSpec) -> float:
    """Billions of weights from the shape alone (norms and biases left out: under 0.1%)."""
    attention = spec.hidden_size * spec.head_dim * (2 * spec.n_heads + 2 * spec.n_kv_heads)
    mlp = spec.mlp_copies * 3 * spec.hidden_size * spec.intermediate_size + spec.hidden_size * spec.n_experts
    embeddings = spec.vocab_size * spec.hidden_size * (1 if spec.tie_word_embeddings else 2)
    return (spec.n_layers * (attention + mlp) + embeddings) / 1e9


@pytest.mark.parametrize(
    ("preset", "published"),
    [  # the model cards' totals (Gemma 3: its language model, without the 0.4B vision tower)
        ("qwen2.5-7b", 7.61), ("qwen2.5-72b", 72.7), ("qwen3-8b", 8.2), ("qwen3-32b", 32.8),
        ("qwen3-30b-a3b", 30.5), ("qwen3-235b-a22b", 235.0), ("gemma-3-12b", 11.8), ("gemma-3-27b", 27.0),
    ],
)  # fmt: skip
def test_presets_hold_the_published_sizes(preset: str, published: float) -> None:
    assert _parameters(PRESETS[preset]) == pytest.approx(published, rel=0.01)


def test_qwen3_moe_and_gemma3_configs_map_their_own_keys() -> None:
    """Qwen3-MoE's experts are ``num_experts`` of ``moe_intermediate_size``; a vision-language Gemma 3
    is planned as its ``text_config`` (the language model served)."""
    moe = {
        "model_type": "qwen3_moe", "num_hidden_layers": 48, "hidden_size": 2048, "num_attention_heads": 32,
        "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144, "moe_intermediate_size": 768,
        "num_experts": 128, "num_experts_per_tok": 8, "vocab_size": 151936, "max_position_embeddings": 40960,
    }  # fmt: skip
    assert model_spec_from_config(moe, name="qwen3-30b-a3b") == PRESETS["qwen3-30b-a3b"]
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        model_spec_from_config({k: v for k, v in moe.items() if k != "moe_intermediate_size"})
    text = {
        "num_hidden_layers": 62,
        "hidden_size": 5376,
        "num_attention_heads": 32,
        "num_key_value_heads": 16,
        "head_dim": 128,
        "intermediate_size": 21504,
        "vocab_size": 262208,
        "max_position_embeddings": 131072,
    }  # fmt: skip  (tied: Gemma's default, stated nowhere in the published file)
    gemma = {"model_type": "gemma3", "text_config": text, "vision_config": {"hidden_size": 1152}}
    assert model_spec_from_config(gemma, name="gemma-3-27b") == PRESETS["gemma-3-27b"]
    assert load_model_spec("google/gemma-3-27b-it") is PRESETS["gemma-3-27b"]
    assert load_model_spec("Qwen/Qwen2.5-7B-Instruct") is PRESETS["qwen2.5-7b"]
