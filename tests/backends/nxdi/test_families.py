"""Qwen2, Qwen3, Qwen3-MoE and Gemma 3 on NxD Inference: the application per release, the keywords, and
what each application does not honour of a published ``config.json`` (no library here).

The configs below are the models' own ``config.json`` fields (Hugging Face model cards); a Gemma 3
vision-language config lists in ``text_config`` only what differs from transformers' defaults, as
released. The real library takes the same plans in tests/backends/nxdi_library
(``test_neuron_config_kwargs.py``, ``test_model_checks.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from neuron_lmi.backends.common import with_model_defaults
from neuron_lmi.backends.nxdi.applications import APPLICATIONS, APPLICATIONS_0_8
from neuron_lmi.backends.nxdi.backend import positions_within_window
from neuron_lmi.backends.nxdi.plan import NEURON_CONFIG_FIELDS, plan_nxdi
from neuron_lmi.backends.nxdi.support import UnsupportedReleaseError
from neuron_lmi.config import load_config
from tests.backends.nxdi.test_plan import LLAMA_3_8B, model_dir, plan_for

QWEN2_5_7B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
    "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
    "num_key_value_heads": 4, "vocab_size": 152064, "max_position_embeddings": 32768,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "sliding_window": 131072, "use_sliding_window": False,
    "max_window_layers": 28, "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16",
}  # fmt: skip
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
    "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
    "rope_theta": 1000000, "rms_norm_eps": 1e-6, "sliding_window": None, "use_sliding_window": False,
    "max_window_layers": 36, "tie_word_embeddings": False, "hidden_act": "silu", "rope_scaling": None,
    "attention_bias": False, "torch_dtype": "bfloat16",
}  # fmt: skip
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
    "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "vocab_size": 151936, "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
    "sliding_window": None, "use_sliding_window": False, "max_window_layers": 48,
    "tie_word_embeddings": False, "hidden_act": "silu", "rope_scaling": None, "torch_dtype": "bfloat16",
}  # fmt: skip
GEMMA_3_27B = {
    "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
    "text_config": {
        "head_dim": 128, "hidden_size": 5376, "intermediate_size": 21504, "model_type": "gemma3_text",
        "num_attention_heads": 32, "num_hidden_layers": 62, "num_key_value_heads": 16,
        "query_pre_attn_scalar": 168, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    },
    "vision_config": {
        "hidden_size": 1152, "image_size": 896, "intermediate_size": 4304, "num_attention_heads": 16,
        "model_type": "siglip_vision_model", "num_hidden_layers": 27, "patch_size": 14,
        "vision_use_head": False,
    },
    "boi_token_index": 255999, "eoi_token_index": 256000, "eos_token_id": [1, 106],
    "image_token_index": 262144, "mm_tokens_per_image": 256, "torch_dtype": "bfloat16",
}  # fmt: skip
GEMMA_3_1B = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 1152,
    "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1,
    "head_dim": 256, "vocab_size": 262144, "max_position_embeddings": 32768, "sliding_window": 512,
    "sliding_window_pattern": 6, "rope_theta": 1000000, "rope_local_base_freq": 10000, "rope_scaling": None,
    "query_pre_attn_scalar": 256, "final_logit_softcapping": None, "torch_dtype": "bfloat16",
}  # fmt: skip
TP8 = "option.tensor_parallel_degree=8\noption.max_rolling_batch_size=8\n"

# Tiny checkpoints (``make_tiny_checkpoint`` overrides) of each family as NxD Inference serves it, run
# by the runner tests here over the contract model and by the real-library tier: configured as the
# released checkpoints are where the application honours the config (``model_checks``). Qwen3-MoE
# renormalises its top-k expert weights (Qwen3-30B-A3B, -235B-A22B: norm_topk_prob true); Gemma 3 has
# 262,208 tokens, every sixth layer global, rms_norm_eps 1e-6, a local rotary base of 10,000 (4B, 12B,
# 27B). Two differences are the library's (tests/backends/nxdi_library/test_model_checks.py holds them
# against transformers): Gemma 3's global rotary is the local one here (NxD Inference rotates every
# layer with the first layer's), and its window is the sequence (NxD Inference serves Gemma 3 only
# while n_positions <= sliding_window, its CPU mode only from sliding_window - 1: ``tiny_checkpoint``).
# A window of 8 is shorter than the tests' prompts where the family has one.
GEMMA3_SERVED = {
    "vocab_size": 262208, "num_hidden_layers": 6, "layer_types": None, "rms_norm_eps": 1e-6,
    "rope_local_base_freq": 10000.0, "rope_theta": 10000.0,
}  # fmt: skip
TINY: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {"sliding_window": 8},
    "mixtral": {"sliding_window": 8},
    "qwen2": {},
    "qwen3": {},
    "qwen3_moe": {"norm_topk_prob": True},
    "gemma3_text": GEMMA3_SERVED,
    # The vision-language checkpoint (language_model.* weights, text_config) as released: its head tied.
    "gemma3": {**GEMMA3_SERVED, "tie_word_embeddings": True},
}


def tiny_checkpoint(root: Path, arch: str, n_positions: int) -> Path:
    """``arch``'s checkpoint from ``TINY`` for a sequence of ``n_positions`` (Gemma 3's window)."""
    from neuron_lmi.testing.checkpoints import make_tiny_checkpoint

    window = {"sliding_window": n_positions} if arch.startswith("gemma3") else {}
    return make_tiny_checkpoint(root, arch=arch, **TINY[arch], **window)


def plan_in(folder: Path, config: dict[str, Any], properties: str) -> Any:
    """``plan_for`` in a folder of its own (one checkpoint folder each)."""
    folder.mkdir()
    return plan_for(folder, config, properties)


@pytest.mark.parametrize(
    ("config", "application", "neuron_config_cls", "fused"),
    [
        (QWEN2_5_7B, "NeuronQwen2ForCausalLM", "NeuronConfig", True),
        (QWEN3_8B, "NeuronQwen3ForCausalLM", "NeuronConfig", True),
        (QWEN3_30B_A3B, "NeuronQwen3MoeForCausalLM", "MoENeuronConfig", True),
        (GEMMA_3_27B, "NeuronGemma3ForCausalLM", "NeuronConfig", True),
    ],
)
def test_each_family_maps_to_its_application_on_0_9(
    tmp_path: Path, config: dict[str, Any], application: str, neuron_config_cls: str, fused: bool
) -> None:
    """The same keywords as Llama's (the expert settings are read from config.json by the application's
    own InferenceConfig), fused Q/K/V where its weight conversion fuses."""
    n = "option.n_positions=1024\n" if config is GEMMA_3_27B else ""
    plan, resolved = plan_for(tmp_path, config, TP8 + n)
    llama = plan_nxdi(resolved.config, {**LLAMA_3_8B, "max_position_embeddings": 40960}, str(tmp_path))
    assert plan.library_version == "0.9.0"
    assert plan.application.application == application
    assert plan.application.neuron_config_cls == neuron_config_cls
    assert plan.application.module.endswith(f".models.{config['model_type']}.modeling_{config['model_type']}")
    assert set(plan.neuron_config) <= NEURON_CONFIG_FIELDS
    assert plan.neuron_config["fused_qkv"] is fused
    if config is not GEMMA_3_27B:
        assert plan.neuron_config == llama.neuron_config
    assert plan.dtype == "bf16" and plan.sliding_window is None


def test_0_8_keeps_qwen3_qkv_apart_and_has_no_gemma3(tmp_path: Path) -> None:
    props = TP8 + "option.n_positions=1024\n"
    plan, resolved = plan_for(tmp_path, QWEN3_8B, props)
    old = plan_nxdi(resolved.config, QWEN3_8B, plan.model_path, None, "0.8.0", "trn1")
    assert old.application.application == "NeuronQwen3ForCausalLM" and old.neuron_config["fused_qkv"] is False
    _, fused = plan_in(tmp_path / "b", QWEN3_8B, props + "option.fuse_qkv=true\n")  # 0.9 fuses
    with pytest.raises(ValueError, match=r"option\.fuse_qkv=True: NxD Inference 0\.8\.0's NeuronQwen3"):
        plan_nxdi(fused.config, QWEN3_8B, plan.model_path, None, "0.8.0", "trn1")
    for config in (QWEN2_5_7B, QWEN3_30B_A3B):
        assert plan_nxdi(resolved.config, config, plan.model_path, None, "0.8.0", "trn1").neuron_config[
            "fused_qkv"
        ]
    for model_type in ("gemma3", "gemma3_text"):
        assert model_type in APPLICATIONS and model_type not in APPLICATIONS_0_8
    with pytest.raises(UnsupportedReleaseError, match=r"0\.8\.0 has no gemma3 application.*0\.9\+"):
        plan_nxdi(resolved.config, GEMMA_3_27B, plan.model_path, None, "0.8.0", None)
    with pytest.raises(UnsupportedReleaseError, match="has no gemma3 application"):  # inf2 runs 0.8
        plan_nxdi(resolved.config, GEMMA_3_27B, plan.model_path, None, None, "inf2")


def test_gemma3_is_served_within_its_window(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"option\.n_positions=4096 exceeds the model's sliding_window=1024.*"
                       r"Set option\.n_positions <= 1024"):  # fmt: skip
        plan_for(tmp_path, GEMMA_3_27B, TP8 + "option.n_positions=4096\n")
    plan, _ = plan_in(tmp_path / "b", GEMMA_3_27B, TP8 + "option.n_positions=1024\n")
    assert plan.n_positions == 1024 and plan.vocab_size == 262208  # text_config: transformers' default
    on_cpu = 'option.tensor_parallel_degree=1\noption.override_neuron_config={"on_cpu": true}\n'
    with pytest.raises(ValueError, match=r"on_cpu=true with option\.n_positions=512: .* 1023 or 1024"):
        plan_in(tmp_path / "c", GEMMA_3_27B, on_cpu + "option.n_positions=512\n")
    assert plan_in(tmp_path / "d", GEMMA_3_27B, on_cpu + "option.n_positions=1023\n")[0].on_cpu


def test_gemma3_default_positions_are_cut_to_its_window(tmp_path: Path) -> None:
    """LMI's default n_positions (2,048 here: the released config.json states no limit) becomes
    Gemma 3's window, so a start without option.n_positions plans; a value a source set is the
    user's, and the plan refuses it."""
    folder = model_dir(tmp_path, GEMMA_3_27B)
    resolved = with_model_defaults(load_config({"model_id": str(folder)}, None, {}), folder)
    assert resolved.config.batching.n_positions == 2048
    cut = positions_within_window(resolved, GEMMA_3_27B)
    assert cut.config.batching.n_positions == 1024 and "sliding_window=1024" in cut.source_of("n_positions")
    assert plan_nxdi(cut.config, GEMMA_3_27B, str(folder)).n_positions == 1024
    assert positions_within_window(cut, GEMMA_3_27B) is cut  # once is enough: the plan calls it again
    by_hand = load_config({"model_id": str(folder), "n_positions": 2048}, None, {})
    assert positions_within_window(by_hand, GEMMA_3_27B) is by_hand
    (tmp_path / "q").mkdir()
    qwen_dir = model_dir(tmp_path / "q", QWEN3_8B)
    qwen = with_model_defaults(load_config({"model_id": str(qwen_dir)}, None, {}), qwen_dir)
    assert positions_within_window(qwen, QWEN3_8B) is qwen  # no window to serve within


def test_what_gemma3_does_not_honour_is_named(tmp_path: Path) -> None:
    plan, _ = plan_for(tmp_path, GEMMA_3_27B, TP8 + "option.n_positions=1024\n")
    # 27B's global layers scale rope_theta 1e6 by 8; the library rotates them as its local layers.
    assert list(plan.ignored) == ["config.json rope_theta/rope_scaling"]
    assert "rotate with the local layers' rotary" in plan.ignored["config.json rope_theta/rope_scaling"]
    text = {
        **GEMMA_3_27B["text_config"], "rms_norm_eps": 1e-5, "layer_types": ["full_attention"] * 62,
        "rope_scaling": None, "rope_theta": 10000.0,
    }  # fmt: skip
    other, _ = plan_in(
        tmp_path / "b", {**GEMMA_3_27B, "text_config": text}, TP8 + "option.n_positions=1024\n"
    )
    assert sorted(other.ignored) == ["config.json layer_types", "config.json rms_norm_eps"]
    assert "1e-06 whatever the config says: 1e-05 is not applied" in other.ignored["config.json rms_norm_eps"]


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (GEMMA_3_1B, r"vocab_size=262144: .* builds a 262208-token embedding"),
        (
            {**GEMMA_3_27B, "text_config": {**GEMMA_3_27B["text_config"], "tie_word_embeddings": False}},
            r"text_config\.tie_word_embeddings=false: .* does not load",
        ),
        ({**QWEN3_30B_A3B, "mlp_only_layers": [0]}, r"mlp_only_layers=\[0\].* a dense layer's weights"),
    ],
)
def test_checkpoints_the_application_cannot_load_are_refused(
    tmp_path: Path, config: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        plan_for(tmp_path, config, TP8 + "option.n_positions=512\n")


def test_qwen_differences_are_named(tmp_path: Path) -> None:
    plan, _ = plan_for(tmp_path, QWEN2_5_7B, TP8 + "option.n_positions=8192\n")
    assert plan.ignored == {}  # sliding_window 131072 without use_sliding_window: no window
    windowed = {**QWEN2_5_7B, "use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 0}
    plan, _ = plan_in(tmp_path / "b", windowed, TP8 + "option.n_positions=8192\n")
    assert "has no sliding window" in plan.ignored["config.json sliding_window"]
    yarn = {
        **QWEN3_8B,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    }
    plan, _ = plan_in(tmp_path / "c", yarn, TP8)
    assert "rotates positions without scaling" in plan.ignored["config.json rope_scaling"]
    moe, _ = plan_in(tmp_path / "d", {**QWEN3_30B_A3B, "norm_topk_prob": False}, TP8)
    assert "renormalises the top-k expert weights" in moe.ignored["config.json norm_topk_prob"]


def test_qwen3_moe_is_refused_in_the_cpu_mode(tmp_path: Path) -> None:
    on_cpu = 'option.tensor_parallel_degree=1\noption.override_neuron_config={"on_cpu": true}\n'
    with pytest.raises(ValueError, match=r"on_cpu=true: .*NeuronQwen3MoeForCausalLM cannot run on the CPU: "
                       r"its decoder layers pass the hidden states through module markers"):  # fmt: skip
        plan_for(tmp_path, QWEN3_30B_A3B, on_cpu + "option.dtype=bf16\n")
