"""PEFT adapters read into the model's fused projections: the grouped low-rank update equals the
merged weight line by line, and an adapter the model cannot serve is refused by name and reason."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from neuron_lmi.models import build_model, ops
from neuron_lmi.models.loader import load_checkpoint
from neuron_lmi.models.lora import AdapterError, LoraSlots, load_adapter
from neuron_lmi.testing.lora import ATTENTION, MLP, make_tiny_adapter, merge_adapter, other_base


def _model(path: Path):
    ckpt = load_checkpoint(path, dtype=torch.float32)
    return build_model(ckpt.config, ckpt.state_dict, n_positions=64)


def test_fused_update_equals_the_merged_weights(tiny_llama_dir: Path, tmp_path: Path) -> None:
    ops.kernels()  # the update's op (the engine registers it before its first step)
    base = _model(tiny_llama_dir)
    projections = base.lora_projections()
    assert projections == {"qkv", "o", "gate_up", "down"}
    adapter_dir = make_tiny_adapter(
        tmp_path / "a", tiny_llama_dir, 3, ATTENTION + MLP, alpha=6.0, rslora=True
    )
    merged = _model(merge_adapter(tiny_llama_dir, adapter_dir, tmp_path / "merged"))
    adapter = load_adapter("a", adapter_dir, base.args, projections, max_rank=4)
    slots = LoraSlots(base.args, projections, n_slots=2, max_rank=4, dtype=torch.float32)
    slots.write(1, adapter)
    lora = slots.batch([None, 1, None])
    assert lora is not None and slots.batch([None, None]) is None  # nothing adapted: no LoRA work
    a = base.args
    x = torch.randn(3, 5, a.hidden_size)
    attn = torch.randn(3, a.n_heads, 5, a.head_dim)
    for i, (ours, theirs) in enumerate(zip(base.layers, merged.layers, strict=True)):
        layer = lora.layer(i)
        for got, want, plain in (
            (ours.qkv(x, layer), theirs.qkv(x), ours.qkv(x)),
            ((ours.attn_out(attn, layer),), (theirs.attn_out(attn),), (ours.attn_out(attn),)),
            ((ours.mlp(x, layer),), (theirs.mlp(x),), (ours.mlp(x),)),
        ):
            for g, w, p in zip(got, want, plain, strict=True):
                torch.testing.assert_close(g[1], w[1], atol=1e-5, rtol=1e-4)  # the adapted line
                torch.testing.assert_close(g[[0, 2]], p[[0, 2]])  # base lines untouched
    slots.write(1, None)
    assert all(t.abs().sum() == 0 for pair in slots.stacked.values() for t in pair)


def test_refusals_name_the_adapter_and_reason(tiny_llama_dir: Path, tmp_path: Path) -> None:
    a = _model(tiny_llama_dir).args
    attention_only = frozenset({"qkv", "o"})
    mlp = make_tiny_adapter(tmp_path / "mlp", tiny_llama_dir, 2, ("up_proj",))
    with pytest.raises(AdapterError, match=r"'mlp': target module up_proj cannot be adapted"):
        load_adapter("mlp", mlp, a, attention_only, max_rank=8)  # an expert MLP's model
    with pytest.raises(AdapterError, match=r"'mlp': rank 2 exceeds max_lora_rank=1"):
        load_adapter("mlp", mlp, a, frozenset({"gate_up"}), max_rank=1)
    with pytest.raises(AdapterError, match="base_model_name_or_path"):
        load_adapter("mlp", mlp, a, frozenset({"gate_up"}), max_rank=8, base_names=["org/Other"])
    load_adapter("mlp", mlp, a, frozenset({"gate_up"}), max_rank=8, base_names=[f"hub/{tiny_llama_dir.name}"])

    other = other_base(tiny_llama_dir, tmp_path / "other_base", hidden_size=32)  # another width
    wide = make_tiny_adapter(tmp_path / "wide", other, 2, ("q_proj",), base_name="")
    with pytest.raises(AdapterError, match=r"'wide': layer 0 q_proj: .* another base model"):
        load_adapter("wide", wide, a, attention_only, max_rank=8)

    embed = tmp_path / "embed"
    shutil.copytree(mlp, embed)
    from safetensors.torch import save_file

    save_file(
        {"base_model.model.model.embed_tokens.lora_A.weight": torch.zeros(2, 8)},
        str(embed / "adapter_model.safetensors"),
    )
    with pytest.raises(AdapterError, match=r"'embed': weight .*embed_tokens"):
        load_adapter("embed", embed, a, attention_only, max_rank=8)
    (embed / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 2, "use_dora": True}))
    with pytest.raises(AdapterError, match="use_dora"):
        load_adapter("embed", embed, a, attention_only, max_rank=8)
