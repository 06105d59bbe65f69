"""Read a llama.cpp GGUF file into Hugging Face config fields and HF-named, dequantized tensors.

Invariants of what :func:`read_gguf` returns:

* tensor names are Hugging Face Llama names (``model.layers.{i}.self_attn.q_proj.weight``, ...);
  ``lm_head.weight`` is absent exactly when the file has no ``output.weight`` (tied embeddings);
* tensors are dense, contiguous, in the requested dtype, shaped ``(out_features, in_features)`` like
  ``nn.Linear.weight`` -- except, with ``keep_quantized``, Q4_0/Q4_1/Q8_0 tensors, which come back as
  :class:`~neuron_lmi.models.quant.QuantizedTensor` holding the file's own codes (never expanded);
* the rows of ``q_proj``/``k_proj`` are back in Hugging Face's rotary order: llama.cpp's converter
  interleaves the two rotary halves of every head, and this module undoes that;
* ``tokenizer_kwargs`` carries the file's ``add_bos_token``/``add_eos_token`` flags for
  ``AutoTokenizer.from_pretrained``;
* config fields use transformers' names (``rope_theta``, ``rms_norm_eps``, ``head_dim``, ...), so
  ``LlamaConfig(**fields)`` builds the config.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from neuron_lmi.models.quant import QuantizedTensor

# GGUF's per-architecture metadata keys (after "<arch>.") -> transformers config field.
_CONFIG_KEYS: dict[str, str] = {
    "block_count": "num_hidden_layers",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "context_length": "max_position_embeddings",
    "vocab_size": "vocab_size",
    "attention.sliding_window": "sliding_window",
}
_REQUIRED_FIELDS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads")
_TOKEN_ID_KEYS = {"bos_token_id": "bos", "eos_token_id": "eos", "pad_token_id": "padding"}
# transformers' GGUF tokenizer conversion ignores these (SmolLM2 would get a BOS it never trained with).
_TOKENIZER_FLAGS = {
    "tokenizer.ggml.add_bos_token": "add_bos_token",
    "tokenizer.ggml.add_eos_token": "add_eos_token",
}

# GGUF tensor name -> Hugging Face name; "{i}" is the layer index.
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.weight")
# llama.cpp stores Llama-3 style rope scaling as per-frequency divisors in this tensor.
_ROPE_FREQS = "rope_freqs.weight"
# GGUF general.architecture -> transformers model_type.
GGUF_MODEL_TYPES = {"llama": "llama", "mistral": "mistral"}


@dataclass(frozen=True)
class GGUFCheckpoint:
    """A GGUF file's model: transformers ``model_type``, config fields, and HF-named tensors."""

    model_type: str
    config_fields: dict[str, Any]
    state_dict: dict[str, torch.Tensor | QuantizedTensor]
    tokenizer_kwargs: dict[str, Any]


def read_gguf(path: Path, dtype: torch.dtype = torch.float32, keep_quantized: bool = False) -> GGUFCheckpoint:
    """Parse and dequantize ``path`` (Q4_0/Q4_1/Q8_0 tensors stay quantized with ``keep_quantized``);
    every failure is a ``ValueError`` naming the file."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except FileNotFoundError:
        raise
    except Exception as exc:  # the reader fails with IndexError/ValueError/... on damaged files
        raise ValueError(f"{path}: not a readable GGUF file (truncated or corrupt?): {exc}") from exc
    meta = _metadata(reader, path)
    arch = meta.get("general.architecture")
    if arch not in GGUF_MODEL_TYPES:
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} is not supported (supported: {sorted(GGUF_MODEL_TYPES)})"
        )
    fields = _config_fields(meta, arch, path)
    state_dict: dict[str, torch.Tensor] = {}
    rope_freqs = None
    for tensor in reader.tensors:  # one at a time, so only one dequantized fp32 copy is alive
        if keep_quantized and tensor.tensor_type.name in _BLOCK_FORMATS:
            state_dict[_hf_name(tensor.name, path)] = _kept(tensor, fields)
            continue
        try:
            array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except Exception as exc:
            raise ValueError(
                f"{path}: cannot dequantize tensor {tensor.name!r} ({tensor.tensor_type.name}): {exc}"
            ) from exc
        if tensor.name == _ROPE_FREQS:
            rope_freqs = np.array(array, dtype=np.float32)
            continue
        state_dict[_hf_name(tensor.name, path)] = _to_torch(array, tensor.name, fields, dtype)
    embed = state_dict.get("model.embed_tokens.weight")
    if "vocab_size" not in fields and embed is not None:
        fields["vocab_size"] = embed.shape[0]
    fields["tie_word_embeddings"] = "lm_head.weight" not in state_dict
    if rope_freqs is not None:
        fields["rope_scaling"] = llama3_rope_scaling(rope_freqs, fields, path)
    tokenizer_kwargs = {name: bool(meta[key]) for key, name in _TOKENIZER_FLAGS.items() if key in meta}
    return GGUFCheckpoint(GGUF_MODEL_TYPES[arch], fields, state_dict, tokenizer_kwargs)


def _metadata(reader: Any, path: Path) -> dict[str, Any]:
    """Scalar and string metadata as Python values; large arrays (the vocabulary) are skipped."""
    from gguf import GGUFValueType

    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if field.types and field.types[0] == GGUFValueType.ARRAY:
            continue
        try:
            meta[key] = field.contents()
        except Exception as exc:
            raise ValueError(f"{path}: cannot read GGUF metadata {key!r}: {exc}") from exc
    if "tokenizer.ggml.tokens" in reader.fields:
        meta["tokenizer.ggml.tokens.count"] = len(reader.fields["tokenizer.ggml.tokens"].data)
    return meta


def _config_fields(meta: dict[str, Any], arch: str, path: Path) -> dict[str, Any]:
    """Translate ``<arch>.*`` and ``tokenizer.ggml.*`` metadata into transformers config fields."""
    fields: dict[str, Any] = {}
    for key, name in _CONFIG_KEYS.items():
        if f"{arch}.{key}" in meta:
            fields[name] = meta[f"{arch}.{key}"]
    missing = [f"{arch}.{k}" for k, v in _CONFIG_KEYS.items() if v in _REQUIRED_FIELDS and v not in fields]
    if missing:
        raise ValueError(f"{path}: GGUF metadata lacks {missing}")
    fields.setdefault("num_key_value_heads", fields["num_attention_heads"])
    fields.setdefault("head_dim", fields["hidden_size"] // fields["num_attention_heads"])
    rotary_dims = meta.get(f"{arch}.rope.dimension_count", fields["head_dim"])
    if rotary_dims != fields["head_dim"]:
        raise ValueError(
            f"{path}: partial rotary ({rotary_dims} of {fields['head_dim']} dims) is unsupported"
        )
    if "vocab_size" not in fields and "tokenizer.ggml.tokens.count" in meta:
        fields["vocab_size"] = meta["tokenizer.ggml.tokens.count"]
    for field, token in _TOKEN_ID_KEYS.items():
        if f"tokenizer.ggml.{token}_token_id" in meta:
            fields[field] = int(meta[f"tokenizer.ggml.{token}_token_id"])
    scaling = _rope_scaling_from_metadata(meta, arch, path)
    if scaling is not None:
        fields["rope_scaling"] = scaling
    return fields


def _rope_scaling_from_metadata(meta: dict[str, Any], arch: str, path: Path) -> dict[str, Any] | None:
    """``<arch>.rope.scaling.{type,factor,original_context_length}`` -> transformers ``rope_scaling``."""
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if kind == "none" or (kind == "linear" and factor in (None, 1.0)):
        return None
    if kind not in ("linear", "yarn") or factor is None:
        raise ValueError(f"{path}: unsupported rope scaling {kind!r} with factor {factor!r}")
    scaling: dict[str, Any] = {"rope_type": kind, "factor": float(factor)}
    original = meta.get(f"{arch}.rope.scaling.original_context_length")
    if kind == "yarn" and original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def llama3_rope_scaling(freq_factors: np.ndarray, fields: dict[str, Any], path: Path) -> dict[str, Any]:
    """Recover Llama-3 ``rope_scaling`` from llama.cpp's ``rope_freqs`` divisors.

    The GGUF stores only the per-frequency divisors; Meta's published parameters (low 1, high 4,
    original context 8192, factor = the largest divisor) are tried and must reproduce them exactly.
    """
    head_dim, theta = fields["head_dim"], float(fields.get("rope_theta", 10000.0))
    scaling = {
        "rope_type": "llama3",
        "factor": float(np.max(freq_factors)),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    expected = []
    low_wavelen = scaling["original_max_position_embeddings"] / scaling["low_freq_factor"]
    high_wavelen = scaling["original_max_position_embeddings"] / scaling["high_freq_factor"]
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < high_wavelen:
            expected.append(1.0)
        elif wavelen > low_wavelen:
            expected.append(scaling["factor"])
        else:
            smooth = (scaling["original_max_position_embeddings"] / wavelen - 1.0) / (4.0 - 1.0)
            expected.append(1.0 / ((1 - smooth) / scaling["factor"] + smooth))
    if freq_factors.shape != (head_dim // 2,) or not np.allclose(freq_factors, expected, rtol=1e-4):
        raise ValueError(f"{path}: {_ROPE_FREQS} does not match Llama-3 rope scaling; unsupported")
    return scaling


def _hf_name(name: str, path: Path) -> str:
    if name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[name]
    match = _LAYER_NAME.fullmatch(name)
    if match is None or match.group(2) not in _LAYER_TENSORS:
        raise ValueError(f"{path}: unexpected tensor {name!r} for a Llama-family model")
    layer, part = match.groups()
    return f"model.layers.{layer}.{_LAYER_TENSORS[part]}.weight"


def _to_torch(array: np.ndarray, name: str, fields: dict[str, Any], dtype: torch.dtype) -> torch.Tensor:
    """Copy out of the memory map, convert, and undo the rotary row permutation of Q and K."""
    tensor = torch.from_numpy(np.array(array, dtype=np.float32, copy=True))
    if name.endswith(".attn_q.weight"):
        tensor = unpermute_rotary_rows(tensor, fields["num_attention_heads"])
    elif name.endswith(".attn_k.weight"):
        tensor = unpermute_rotary_rows(tensor, fields["num_key_value_heads"])
    return tensor.to(dtype).contiguous()


def _kept(tensor: Any, fields: dict[str, Any]) -> QuantizedTensor:
    """A Q4_0/Q4_1/Q8_0 tensor's blocks as codes and per-32 scales, rows in Hugging Face order."""
    q = _BLOCK_FORMATS[tensor.tensor_type.name](np.asarray(tensor.data))
    if tensor.name.endswith(".attn_q.weight"):
        return q.map_rows(lambda t: unpermute_rotary_rows(t, fields["num_attention_heads"]))
    if tensor.name.endswith(".attn_k.weight"):
        return q.map_rows(lambda t: unpermute_rotary_rows(t, fields["num_key_value_heads"]))
    return q


def _f16(raw: np.ndarray) -> torch.Tensor:
    """Two bytes per block (the last axis) read as a float16 scale -> fp32 ``[rows, blocks]``."""
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32))


def _q4_blocks(raw: np.ndarray, with_min: bool) -> QuantizedTensor:
    """ggml Q4_0 (d, 16 bytes) and Q4_1 (d, m, 16 bytes) blocks of 32: byte j holds element j in its
    low nibble and element j + 16 in its high one; w = d * (q - 8) or d * q + m."""
    head = 4 if with_min else 2
    blocks = raw.reshape(raw.shape[0], -1, head + 16)
    d, qs = _f16(blocks[..., :2]), blocks[..., head:]
    codes = torch.from_numpy(np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(raw.shape[0], -1))
    zero = _f16(blocks[..., 2:4]) + 8 * d if with_min else torch.zeros_like(d)
    return QuantizedTensor(4, 32, codes, d, zero)


def _q8_blocks(raw: np.ndarray) -> QuantizedTensor:
    """ggml Q8_0 blocks of 32: a float16 d and 32 int8 codes; w = d * q."""
    blocks = raw.reshape(raw.shape[0], -1, 34)
    codes = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(raw.shape[0], -1)
    return QuantizedTensor(8, 32, torch.from_numpy(codes.copy()), _f16(blocks[..., :2]))


# GGML block formats read without dequantizing (the rest are expanded and quantized, if asked, later).
_BLOCK_FORMATS = {
    "Q4_0": lambda raw: _q4_blocks(raw, with_min=False),
    "Q4_1": lambda raw: _q4_blocks(raw, with_min=True),
    "Q8_0": _q8_blocks,
}


def unpermute_rotary_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's ``permute`` for a Q or K projection of ``n_heads`` heads.

    Hugging Face orders each head's output rows as ``[first half | second half]`` (rotate_half);
    llama.cpp interleaves them as pairs ``(x0, x_half), (x1, x_half+1), ...``. Viewing each head as
    ``(half, 2)`` and swapping those axes restores ``(2, half)``.
    """
    out_features = weight.shape[0]
    if out_features % (2 * n_heads):
        raise ValueError(f"projection with {out_features} rows cannot hold {n_heads} rotary heads")
    half = out_features // n_heads // 2
    return weight.reshape(n_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)
