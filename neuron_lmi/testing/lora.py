"""Tiny random LoRA adapters in PEFT's format, and the merged checkpoint that is their reference.

PEFT is not a dependency, so a test writes what ``PeftModel.save_pretrained`` writes
(``adapter_config.json`` and ``adapter_model.safetensors`` with PEFT's key names) and computes the
reference as PEFT's ``merge_and_unload`` does: ``W' = W + s B A`` with ``s = lora_alpha / r``
(``lora_alpha / sqrt(r)`` with ``use_rslora``), written as a copy of the base checkpoint that
transformers then runs.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def _shapes(config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """PEFT module -> (out, in) of the base Llama-family model described by ``config``."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    return {
        "q_proj": (heads * head_dim, hidden),
        "k_proj": (kv_heads * head_dim, hidden),
        "v_proj": (kv_heads * head_dim, hidden),
        "o_proj": (hidden, heads * head_dim),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }


def _part(module: str) -> str:
    return "self_attn" if module in ATTENTION else "mlp"


def make_tiny_adapter(
    out_dir: str | Path,
    base_dir: str | Path,
    rank: int,
    targets: Sequence[str],
    alpha: float = 16.0,
    seed: int = 0,
    rslora: bool = False,
    delta: float = 0.1,
    base_name: str | None = None,
    layers: Sequence[int] | None = None,
) -> Path:
    """Write a random PEFT LoRA adapter for the checkpoint at ``base_dir`` into ``out_dir``: rank
    ``rank`` on ``targets`` in ``layers`` (default every layer). Both A and B are random (a trained
    adapter's B is not zero), sized so that the merged update ``s B A`` has entries of standard
    deviation ``delta``: five times the tiny models' initial weights, so greedy tokens change
    without the activations blowing up."""
    from safetensors.torch import save_file

    config = json.loads((Path(base_dir) / "config.json").read_text())
    shapes = _shapes(config)
    generator = torch.Generator().manual_seed(seed)
    scale = alpha / (math.sqrt(rank) if rslora else rank)
    std = math.sqrt(delta / (scale * math.sqrt(rank)))  # (s B A)_ij has std s * sqrt(r) * std**2
    tensors: dict[str, torch.Tensor] = {}
    for layer in layers if layers is not None else range(config["num_hidden_layers"]):
        for module in targets:
            out_features, in_features = shapes[module]
            prefix = f"base_model.model.model.layers.{layer}.{_part(module)}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) * std
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * std
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_name if base_name is not None else str(base_dir),
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": list(targets),
        "bias": "none",
        "use_rslora": rslora,
        "fan_in_fan_out": False,
        "modules_to_save": None,
    }
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
    return out


def other_base(base_dir: str | Path, out_dir: str | Path, **changes: Any) -> Path:
    """A directory holding only ``config.json``: the checkpoint at ``base_dir``'s with ``changes``
    (``hidden_size=32``), enough to make an adapter for another base model."""
    config = json.loads((Path(base_dir) / "config.json").read_text())
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({**config, **changes}))
    return out


def merge_adapter(base_dir: str | Path, adapter_dir: str | Path, out_dir: str | Path) -> Path:
    """A copy of the checkpoint at ``base_dir`` with the adapter merged into its weights, as PEFT's
    ``merge_and_unload`` computes it (fp32)."""
    from safetensors.torch import load_file, save_file

    base, adapter = Path(base_dir), Path(adapter_dir)
    out = Path(out_dir)
    shutil.copytree(base, out, dirs_exist_ok=True)
    config = json.loads((adapter / "adapter_config.json").read_text())
    weights = load_file(str(adapter / "adapter_model.safetensors"))
    files = sorted(out.glob("*.safetensors"))
    if len(files) != 1:
        raise ValueError(f"merge_adapter: expected one safetensors file in {base}, found {len(files)}")
    state = load_file(str(files[0]))
    for key, a in weights.items():
        if ".lora_A." not in key:
            continue
        b = weights[key.replace(".lora_A.", ".lora_B.")]
        rank = a.shape[0]
        scale = config["lora_alpha"] / (math.sqrt(rank) if config.get("use_rslora") else rank)
        name = key.removeprefix("base_model.model.").split(".lora_A.")[0] + ".weight"
        state[name] = (state[name].float() + scale * (b.float() @ a.float())).to(state[name].dtype)
    save_file(state, str(files[0]), metadata={"format": "pt"})
    return out
