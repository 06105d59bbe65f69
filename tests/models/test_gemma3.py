"""Gemma 3 (text, and the language model of a vision-language checkpoint): config reading, checkpoint
names, and greedy ids and log-probabilities through the engine against transformers, past the
sliding window; bf16 and int8/int4 weights against fp32."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from neuron_lmi.backends.cpu import compiled_decode
from neuron_lmi.backends.cpu.llm import LLM
from neuron_lmi.engine.types import SamplingParams
from neuron_lmi.models import Gemma3ForCausalLM, build_model
from neuron_lmi.models.args import model_args_from_config
from neuron_lmi.models.gemma3 import gemma_rms_norm
from neuron_lmi.models.loader import gemma3_text_name, load_checkpoint
from neuron_lmi.models.quant import QuantizedLinear, matmul_weight_slots
from neuron_lmi.models.quant_eval import greedy, token_agreement
from neuron_lmi.models.quantize import quantize_model
from neuron_lmi.testing.checkpoints import make_tiny_checkpoint
from tests.engine.conftest import random_prompts
from tests.engine.test_parity import GREEDY, assert_parity

TEXT = {
    "model_type": "gemma3_text", "vocab_size": 32, "hidden_size": 64, "intermediate_size": 32,
    "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "query_pre_attn_scalar": 12, "sliding_window": 5, "sliding_window_pattern": 3,
    "rope_theta": 1e6, "rope_local_base_freq": 1e4,
}  # fmt: skip

VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {  # name: (family, make_tiny_checkpoint overrides)
    "gemma3-text": ("gemma3_text", {"seed": 31}),
    # transformers' Gemma 3 ignores attn_logit_softcapping (its attention never applies it).
    "gemma3-text-softcaps-linear-rope": (
        "gemma3_text",
        {
            "seed": 32, "attn_logit_softcapping": 0.5, "final_logit_softcapping": 3.0,
            "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        },
    ),
    "gemma3-vision-language": ("gemma3", {"seed": 33}),
}  # fmt: skip


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_gemma3")
    return {
        name: make_tiny_checkpoint(root / name, family, **over) for name, (family, over) in VARIANTS.items()
    }


def test_config_gives_windows_rotaries_and_scales() -> None:
    args = model_args_from_config({**TEXT, "architectures": ["Gemma3ForCausalLM"]})
    # sliding_window_pattern 3: every third layer global, as Gemma3TextConfig derives layer_types.
    assert args.layer_windows == (5, 5, None, 5, 5, None) and args.sliding_window is None
    assert args.local_rope is not None and args.local_rope.theta == 1e4 and args.rope.theta == 1e6
    assert args.attn_scale == pytest.approx(12**-0.5) and args.embed_scale == pytest.approx(8.0)
    assert args.hidden_act == "gelu_pytorch_tanh" and args.qk_norm and not args.qkv_bias
    assert args.final_softcap is None
    capped = model_args_from_config({**TEXT, "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50})
    assert capped.final_softcap == 30.0
    assert model_args_from_config({**TEXT, "attn_logit_softcapping": 50}) == model_args_from_config(TEXT)
    model = Gemma3ForCausalLM(args, n_positions=16)
    assert model.layer_kind == (0, 0, 1, 0, 0, 1)
    local, full = model.attention_kinds
    assert (local.window, full.window) == (5, None) and local.rotary.spec.theta == 1e4
    assert full.rotary is model.rotary and model.scale == args.attn_scale
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        model_args_from_config({**TEXT, "use_bidirectional_attention": True})


def test_vision_language_config_reads_its_text_config() -> None:
    config = {
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "text_config": {**TEXT, "final_logit_softcapping": 30.0}, "vision_config": {"hidden_size": 16},
    }  # fmt: skip
    args = model_args_from_config(config)
    assert args.architecture == "Gemma3ForConditionalGeneration" and args.hidden_size == 64
    # transformers' Gemma3ForConditionalGeneration never applies the final cap; neither do we.
    assert args.final_softcap is None and args.layer_windows[2] is None


def test_vision_language_tensor_names() -> None:
    assert (
        gemma3_text_name("language_model.model.layers.0.mlp.up_proj.weight")
        == "model.layers.0.mlp.up_proj.weight"
    )
    assert gemma3_text_name("model.language_model.norm.weight") == "model.norm.weight"
    assert gemma3_text_name("language_model.lm_head.weight") == "lm_head.weight"
    assert gemma3_text_name("lm_head.weight") == "lm_head.weight"
    for skipped in ("vision_tower.vision_model.post_layernorm.weight", "model.multi_modal_projector.x"):
        assert gemma3_text_name(skipped) is None


def test_gemma_rms_norm_scales_by_one_plus_weight() -> None:
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 8, generator=g), torch.randn(8, generator=g)
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + w)
    torch.testing.assert_close(gemma_rms_norm(x, w, 1e-6), want)
    assert gemma_rms_norm(x.bfloat16(), w.bfloat16(), 1e-6).dtype == torch.bfloat16


def test_vision_language_checkpoint_loads_its_language_model(tiny_dirs: dict[str, Path]) -> None:
    ckpt = load_checkpoint(tiny_dirs["gemma3-vision-language"])
    assert type(ckpt.config).__name__ == "Gemma3TextConfig"
    assert ckpt.config.architectures == ["Gemma3ForConditionalGeneration"]
    assert not any("vision" in name or "projector" in name for name in ckpt.state_dict)
    assert "model.layers.2.post_feedforward_layernorm.weight" in ckpt.state_dict
    model = build_model(ckpt.config, ckpt.state_dict, n_positions=32)
    assert isinstance(model, Gemma3ForCausalLM)
    torch.testing.assert_close(
        model.layers[1].ffn_post_norm, ckpt.state_dict["model.layers.1.post_feedforward_layernorm.weight"]
    )
    torch.testing.assert_close(
        model.layers[1].q_norm, ckpt.state_dict["model.layers.1.self_attn.q_norm.weight"]
    )


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tiny_gemma3_matches_transformers(tiny_dirs: dict[str, Path], variant: str) -> None:
    import transformers

    path = tiny_dirs[variant]
    config = transformers.AutoConfig.from_pretrained(str(path))
    hf_cls = getattr(transformers, config.architectures[0])
    hf = hf_cls.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager").eval()
    llm = LLM(str(path), dtype="fp32", enforce_eager=True, max_rolling_batch_size=4, n_positions=128)
    model = llm.core.runner.model
    assert isinstance(model, Gemma3ForCausalLM) and len(model.attention_kinds) == 2
    prompts = random_prompts([5, 17, 30, 9], seed=len(variant))
    window = max(w or 0 for w in model.args.layer_windows)
    assert 0 < window < min(map(len, prompts)) + GREEDY.max_new_tokens - 30  # 30+ tokens past it
    assert_parity(llm, hf, prompts, GREEDY)


@pytest.mark.parametrize(
    ("dtype", "method"), [(torch.bfloat16, None), (torch.float32, "int8"), (torch.float32, "int4")]
)
def test_bf16_and_quantized_weights_follow_fp32(
    tiny_dirs: dict[str, Path], dtype: torch.dtype, method: str | None
) -> None:
    """Teacher-forced top-1 agreement over 24 greedy tokens. int4 on these random weights drifts
    further from fp32 than on the tiny Llama, so it is held to the fp32 model with its own
    (dequantized) int4 weights instead: that is what the int4 kernels must compute."""
    ckpt = load_checkpoint(tiny_dirs["gemma3-text"])
    ref = build_model(ckpt.config, ckpt.state_dict, 128)
    candidate = build_model(ckpt.config, ckpt.state_dict, 128, dtype=dtype)
    if method is not None:
        quantize_model(candidate, method)
    if method == "int4":
        with torch.no_grad():
            for (owner, name), (ref_owner, ref_name) in zip(
                matmul_weight_slots(candidate), matmul_weight_slots(ref), strict=True
            ):
                weight, ref_weight = getattr(owner, name), getattr(ref_owner, ref_name)
                if isinstance(weight, QuantizedLinear):
                    ref_weight.copy_(weight.dequantize().reshape(ref_weight.shape))
    prompts = random_prompts([5, 17, 30], seed=6)
    continuations = [greedy(ref, p, 24) for p in prompts]
    assert token_agreement(ref, candidate, prompts, continuations) >= 0.9


def test_engine_runs_gemma3_in_bf16_and_int8_eagerly_where_no_graph_compiles(
    tiny_dirs: dict[str, Path],
) -> None:
    """Gemma's layers are not the plain DecoderLayer the compiled graphs trace: the engine asked for
    them stays eager (``CpuBackend.plan_for`` logs why) and still serves."""
    path = tiny_dirs["gemma3-vision-language"]
    llm = LLM(str(path), dtype="bf16", max_rolling_batch_size=2, n_positions=64)  # graphs asked for
    reason = compiled_decode.decode_unsupported(llm.core.runner.model, 2, 64)
    assert reason is not None and "Gemma" in reason
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    int8 = LLM(str(path), dtype="fp32", quantize="int8", max_rolling_batch_size=2, n_positions=64)
    for engine in (llm, int8):
        results = engine.generate(random_prompts([7, 12], seed=9), params)
        assert [len(r.token_ids) for r in results] == [6, 6]
        assert all(torch.isfinite(torch.tensor(r.logprobs)).all() for r in results)
