"""Qwen2, Qwen3 and Qwen3-MoE on the Llama path: config flags, checkpoint names, the expert block
against transformers' own, and greedy ids and log-probabilities through the engine against
transformers; bf16 and int8/int4 weights against fp32."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from neuron_lmi.backends.cpu.llm import LLM
from neuron_lmi.engine.types import SamplingParams
from neuron_lmi.models import ARCHITECTURES, Qwen3MoeForCausalLM, build_model
from neuron_lmi.models.args import MoeSpec, model_args_from_config
from neuron_lmi.models.llama import DecoderLayer
from neuron_lmi.models.loader import expected_parameter_names, load_checkpoint
from neuron_lmi.models.mixtral import Qwen3MoeDecoderLayer, route
from neuron_lmi.models.quant_eval import greedy, token_agreement
from neuron_lmi.models.quantize import quantize_model
from neuron_lmi.testing.checkpoints import make_tiny_checkpoint
from tests.engine.conftest import random_prompts
from tests.engine.test_parity import GREEDY, assert_parity

BASE = {
    "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2,
}  # fmt: skip

VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {  # name: (family, make_tiny_checkpoint overrides)
    "qwen2": ("qwen2", {"seed": 21}),
    # Layers 1 and 2 windowed (use_sliding_window from max_window_layers on), layer 0 full.
    "qwen2-sliding-layers": (
        "qwen2", {"seed": 22, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
    ),
    "qwen3": ("qwen3", {"seed": 23}),
    "qwen3-moe": ("qwen3_moe", {"seed": 24}),
    "qwen3-moe-normalized-dense-layer-0": (
        "qwen3_moe", {"seed": 25, "norm_topk_prob": True, "mlp_only_layers": [0], "num_experts": 6},
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_qwen")
    return {
        name: make_tiny_checkpoint(root / name, family, **over) for name, (family, over) in VARIANTS.items()
    }


def test_config_flags() -> None:
    qwen2 = model_args_from_config({**BASE, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"})
    assert qwen2.qkv_bias and not qwen2.attention_bias and not qwen2.qk_norm
    assert qwen2.sliding_window is None and qwen2.layer_windows == ()
    qwen3 = model_args_from_config(
        {**BASE, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 8}
    )
    assert qwen3.qk_norm and not qwen3.qkv_bias and qwen3.head_dim == 8  # not hidden / heads = 4
    windowed = {
        "model_type": "qwen2",
        "use_sliding_window": True,
        "sliding_window": 6,
        "max_window_layers": 2,
    }
    args = model_args_from_config({**BASE, **windowed})
    assert args.layer_windows == (None, None, 6, 6) and [args.window(i) for i in range(4)] == [
        None,
        None,
        6,
        6,
    ]
    types = ["sliding_attention"] * 4
    assert model_args_from_config({**BASE, **windowed, "layer_types": types}).sliding_window == 6
    with pytest.raises(ValueError, match="layer_types"):
        model_args_from_config({**BASE, **windowed, "layer_types": types[:3]})


def test_qwen3_moe_spec_from_config() -> None:
    moe = {
        "model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 12, "sliding_window": 4096, "use_sliding_window": False,
    }  # fmt: skip
    args = model_args_from_config({**BASE, **moe})
    assert args.moe == MoeSpec(8, 2, intermediate_size=12, normalize=False, dense_layers=())
    assert args.sliding_window is None and args.qk_norm
    sparse = model_args_from_config({**BASE, **moe, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert sparse.moe is not None and sparse.moe.dense_layers == (0, 2, 3)
    assert model_args_from_config({**BASE, **moe, "norm_topk_prob": True}).moe.normalize  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="num_experts_per_tok must be in"):
        model_args_from_config({**BASE, **moe, "num_experts_per_tok": 9})


def test_route_keeps_raw_probabilities_without_renormalising() -> None:
    g = torch.Generator().manual_seed(1)
    h, router = torch.randn(10, 8, generator=g), torch.randn(5, 8, generator=g)
    weights, experts = route(h, router, 2, normalize=False)
    top = torch.softmax(h @ router.T, dim=-1).topk(2)
    torch.testing.assert_close(weights, top.values)
    assert torch.equal(experts, top.indices) and bool((weights.sum(-1) < 1).all())


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_expert_mlp_matches_transformers_block(norm_topk_prob: bool) -> None:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(
        hidden_size=32, moe_intermediate_size=24, num_experts=6, num_experts_per_tok=3,
        norm_topk_prob=norm_topk_prob, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=1, vocab_size=16, head_dim=8,
    )  # fmt: skip
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(config).eval()
    with torch.no_grad():
        block.gate.weight.normal_()
    args = model_args_from_config({**config.to_dict(), "architectures": ["Qwen3MoeForCausalLM"]})
    layer = Qwen3MoeDecoderLayer(args, args.n_heads, args.n_kv_heads, torch.float32)
    assert layer.experts_down.shape == (6, 32, 24) and layer.normalize == norm_topk_prob
    with torch.no_grad():
        layer.post_norm.fill_(1.0)
        layer.router.copy_(block.gate.weight)
        for e, expert in enumerate(block.experts):
            layer.experts_gate_up[e].copy_(torch.cat([expert.gate_proj.weight, expert.up_proj.weight]))
            layer.experts_down[e].copy_(expert.down_proj.weight)
    x = torch.randn(3, 7, 32)
    with torch.no_grad():
        ref, _ = block(torch.nn.functional.rms_norm(x, (32,), eps=config.rms_norm_eps))
    torch.testing.assert_close(layer.mlp(x), ref, rtol=1e-5, atol=1e-5)


def test_checkpoints_load_biases_norms_and_experts(tiny_dirs: dict[str, Path]) -> None:
    qwen2 = load_checkpoint(tiny_dirs["qwen2"])
    names = expected_parameter_names(qwen2.config)
    assert (
        "model.layers.0.self_attn.q_proj.bias" in names
        and "model.layers.0.self_attn.o_proj.bias" not in names
    )
    model = build_model(qwen2.config, qwen2.state_dict, n_positions=32)
    assert model.layers[0].bo is None
    torch.testing.assert_close(
        model.layers[1].bqkv[: model.args.n_heads * model.args.head_dim],
        qwen2.state_dict["model.layers.1.self_attn.q_proj.bias"],
    )
    moe = load_checkpoint(tiny_dirs["qwen3-moe-normalized-dense-layer-0"])
    names = expected_parameter_names(moe.config)
    assert "model.layers.0.mlp.gate_proj.weight" in names and "model.layers.0.mlp.gate.weight" not in names
    assert "model.layers.2.mlp.experts.5.down_proj.weight" in names
    assert "model.layers.2.self_attn.k_norm.weight" in names
    model = build_model(moe.config, moe.state_dict, n_positions=32)
    assert isinstance(model, Qwen3MoeForCausalLM)
    assert [type(layer) for layer in model.layers] == [DecoderLayer, *[Qwen3MoeDecoderLayer] * 2]
    torch.testing.assert_close(
        model.layers[1].k_norm, moe.state_dict["model.layers.1.self_attn.k_norm.weight"]
    )
    up = moe.state_dict["model.layers.2.mlp.experts.4.up_proj.weight"]
    torch.testing.assert_close(model.layers[2].experts_gate_up[4, up.shape[0] :], up)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tiny_qwen_matches_transformers(tiny_dirs: dict[str, Path], variant: str) -> None:
    from transformers import AutoModelForCausalLM

    path = tiny_dirs[variant]
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    assert type(hf).__name__ == hf.config.architectures[0]
    llm = LLM(str(path), dtype="fp32", enforce_eager=True, max_rolling_batch_size=4, n_positions=128)
    model = llm.core.runner.model
    assert type(model) is ARCHITECTURES[hf.config.architectures[0]]
    prompts = random_prompts([5, 17, 30, 9], seed=len(variant))
    if model.args.layer_windows:  # windowed and full layers, the window shorter than the sequences
        assert len(model.attention_kinds) == 2
        assert max(w or 0 for w in model.args.layer_windows) < min(map(len, prompts)) + GREEDY.max_new_tokens
    assert_parity(llm, hf, prompts, GREEDY)


@pytest.mark.parametrize(("variant", "dtype", "method"), [
    ("qwen2", torch.bfloat16, None),
    ("qwen3", torch.bfloat16, None),
    ("qwen3", torch.float32, "int8"),
    ("qwen3", torch.float32, "int4"),
    ("qwen3-moe", torch.bfloat16, None),
    ("qwen3-moe", torch.float32, "int8"),
])  # fmt: skip
def test_bf16_and_quantized_weights_follow_fp32(
    tiny_dirs: dict[str, Path], variant: str, dtype: torch.dtype, method: str | None
) -> None:
    """Teacher-forced top-1 agreement with the fp32 model over 24 greedy tokens (bounds as for the
    tiny Llama's quantization: tests/models/test_quant_quality.py)."""
    ckpt = load_checkpoint(tiny_dirs[variant])
    ref = build_model(ckpt.config, ckpt.state_dict, 128)
    candidate = build_model(ckpt.config, ckpt.state_dict, 128, dtype=dtype)
    if method is not None:
        quantize_model(candidate, method)
    prompts = random_prompts([5, 17, 30], seed=5)
    continuations = [greedy(ref, p, 24) for p in prompts]
    assert token_agreement(ref, candidate, prompts, continuations) >= (0.6 if method == "int4" else 0.9)


@pytest.mark.parametrize(("dtype", "quantize"), [("bf16", None), ("fp32", "int4")])
def test_engine_runs_qwen3_moe_in_bf16_and_int4(
    tiny_dirs: dict[str, Path], dtype: str, quantize: str | None
) -> None:
    llm = LLM(
        str(tiny_dirs["qwen3-moe"]),
        enforce_eager=True,
        dtype=dtype,
        quantize=quantize,
        max_rolling_batch_size=2,
        n_positions=64,
    )
    results = llm.generate(random_prompts([7, 12], seed=9), SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert [len(r.token_ids) for r in results] == [6, 6]
    assert all(torch.isfinite(torch.tensor(r.logprobs)).all() for r in results)
    assert llm.core.runner.rows.occupancy().rows_used == 0
