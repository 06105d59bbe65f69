"""Mixtral's sparse MoE block, config reading and checkpoint loading (engine parity: tests/engine)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from neuron_lmi.models import ARCHITECTURES, MixtralForCausalLM, build_model, model_args_from_config
from neuron_lmi.models.args import MoeSpec
from neuron_lmi.models.loader import expected_parameter_names, load_checkpoint
from neuron_lmi.models.mixtral import MixtralDecoderLayer, route, sparse_moe
from neuron_lmi.testing.checkpoints import make_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny_mixtral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_mixtral"), "mixtral", seed=7)


def naive_moe(h, router, gate_up, down, top_k) -> torch.Tensor:
    """Token by token, expert by expert: the definition the batched version must reproduce."""
    out = torch.zeros_like(h)
    for t in range(h.shape[0]):
        probs = torch.softmax(router @ h[t], dim=-1)
        weights, experts = probs.topk(top_k)
        for w, e in zip(weights / weights.sum(), experts.tolist(), strict=True):
            gate, up = (gate_up[e] @ h[t]).chunk(2)
            out[t] += w * (down[e] @ (torch.nn.functional.silu(gate) * up))
    return out


@pytest.mark.parametrize(("n_experts", "top_k"), [(4, 2), (8, 2), (4, 1), (3, 3)])
def test_sparse_moe_matches_token_by_token_definition(n_experts: int, top_k: int) -> None:
    g = torch.Generator().manual_seed(n_experts * 10 + top_k)
    hidden, inter, n = 16, 24, 37
    h = torch.randn(n, hidden, generator=g)
    router = torch.randn(n_experts, hidden, generator=g)
    gate_up = torch.randn(n_experts, 2 * inter, hidden, generator=g) / 4
    down = torch.randn(n_experts, hidden, inter, generator=g) / 4
    got = sparse_moe(h, router, gate_up, down, top_k)
    torch.testing.assert_close(got, naive_moe(h, router, gate_up, down, top_k), rtol=1e-5, atol=1e-5)


def test_route_renormalises_the_top_k() -> None:
    g = torch.Generator().manual_seed(0)
    h, router = torch.randn(10, 8, generator=g), torch.randn(5, 8, generator=g)
    weights, experts = route(h, router, 2)
    probs = torch.softmax(h @ router.T, dim=-1)
    assert torch.equal(experts, probs.topk(2).indices)
    torch.testing.assert_close(weights.sum(-1), torch.ones(10))
    assert bool((weights[:, 0] >= weights[:, 1]).all())


def test_layer_mlp_matches_transformers_sparse_moe_block() -> None:
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = MixtralConfig(
        hidden_size=32, intermediate_size=48, num_local_experts=6, num_experts_per_tok=2,
        num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1, vocab_size=16,
    )  # fmt: skip
    torch.manual_seed(0)
    block = MixtralSparseMoeBlock(config).eval()
    with torch.no_grad():
        block.gate.weight.normal_()
    args = model_args_from_config({**config.to_dict(), "architectures": ["MixtralForCausalLM"]})
    layer = MixtralDecoderLayer(args, args.n_heads, args.n_kv_heads, torch.float32)
    with torch.no_grad():
        layer.post_norm.fill_(1.0)
        layer.router.copy_(block.gate.weight)
        for e, expert in enumerate(block.experts):
            layer.experts_gate_up[e].copy_(torch.cat([expert.w1.weight, expert.w3.weight]))
            layer.experts_down[e].copy_(expert.w2.weight)
    x = torch.randn(3, 7, 32)
    with torch.no_grad():
        ref, _ = block(torch.nn.functional.rms_norm(x, (32,), eps=config.rms_norm_eps))
    torch.testing.assert_close(layer.mlp(x), ref, rtol=1e-5, atol=1e-5)


def test_config_gives_moe_spec_and_sliding_window() -> None:
    base = {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 32,
        "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_local_experts": 8, "num_experts_per_tok": 2,
    }  # fmt: skip
    args = model_args_from_config({**base, "sliding_window": None})
    assert args.moe == MoeSpec(8, 2) and args.sliding_window is None
    assert model_args_from_config({**base, "sliding_window": 4096}).sliding_window == 4096
    with pytest.raises(ValueError, match="num_experts_per_tok must be in"):
        model_args_from_config({**base, "num_experts_per_tok": 9})
    assert ARCHITECTURES["MixtralForCausalLM"] is MixtralForCausalLM


def test_tiny_checkpoint_loads_every_expert_into_mixtral(tiny_mixtral_dir: Path) -> None:
    ckpt = load_checkpoint(tiny_mixtral_dir)
    names = expected_parameter_names(ckpt.config)
    assert "model.layers.2.block_sparse_moe.experts.3.w2.weight" in names
    assert not any(".mlp." in n for n in names)
    model = build_model(ckpt.config, ckpt.state_dict, n_positions=32)
    assert isinstance(model, MixtralForCausalLM)
    layer = model.layers[1]
    assert isinstance(layer, MixtralDecoderLayer) and layer.top_k == 2
    saved = ckpt.state_dict
    torch.testing.assert_close(layer.router, saved["model.layers.1.block_sparse_moe.gate.weight"])
    torch.testing.assert_close(
        layer.experts_down[3], saved["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    )
    w3 = saved["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    torch.testing.assert_close(layer.experts_gate_up[2, w3.shape[0] :], w3)


def test_missing_or_misshapen_expert_is_rejected(tiny_mixtral_dir: Path, copy_dir) -> None:
    missing = copy_dir(tiny_mixtral_dir, "missing")
    tensors = load_file(missing / "model.safetensors")
    del tensors["model.layers.0.block_sparse_moe.experts.1.w3.weight"]
    save_file(tensors, missing / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing 1 tensors.*experts\.1\.w3"):
        load_checkpoint(missing)
    fewer = copy_dir(tiny_mixtral_dir, "fewer")
    config = json.loads((fewer / "config.json").read_text())
    (fewer / "config.json").write_text(json.dumps({**config, "num_local_experts": 3}))
    with pytest.raises(ValueError, match=r"unexpected \d+ tensors.*experts\.3\."):
        load_checkpoint(fewer)
