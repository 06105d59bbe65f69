"""Load a checkpoint of a supported family (Hugging Face directory or GGUF file) into HF-named tensors.

Families: Llama, Mistral, Mixtral (also as GGUF), Qwen2, Qwen3, Qwen3-MoE and Gemma 3 (a
``Gemma3ForConditionalGeneration`` checkpoint as its language model: its ``text_config`` and its
``language_model`` tensors; the vision tower is skipped). Invariants of every
:class:`LoadedCheckpoint` this module returns:

* ``config`` is the family's transformers config class (a Gemma 3 vision-language checkpoint's
  ``Gemma3TextConfig``) with ``architectures`` set to the architecture of :data:`ARCHITECTURES`;
* ``state_dict`` holds exactly the names of :func:`expected_parameter_names` with the shapes of
  :func:`expected_shapes`; ``lm_head.weight`` is absent exactly when ``config.tie_word_embeddings``
  (the model reuses ``model.embed_tokens.weight``);
* floating tensors are contiguous and in the requested dtype; with ``keep_quantized``, a GGUF file's
  Q4_0/Q4_1/Q8_0 tensors are ``QuantizedTensor`` objects (``neuron_lmi.models.quant``) instead.

Every rejected checkpoint raises ``FileNotFoundError`` or ``ValueError`` whose message names the file.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers

from neuron_lmi.config.hf_config import read_hf_config_file
from neuron_lmi.models.args import model_args_from_config
from neuron_lmi.models.builtin import BUILTIN_MODELS, resolve_builtin
from neuron_lmi.models.gguf_loader import read_gguf
from neuron_lmi.models.quant import QuantizedTensor


def dense_mlp_shapes(config: transformers.PretrainedConfig, layer: int = 0) -> dict[str, tuple[int, ...]]:
    """One layer's gated MLP tensors (Llama/Mistral names) and their shapes."""
    hidden, inter = config.hidden_size, config.intermediate_size
    return {
        "mlp.gate_proj.weight": (inter, hidden),
        "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
    }


def moe_mlp_shapes(config: transformers.PretrainedConfig, layer: int = 0) -> dict[str, tuple[int, ...]]:
    """One layer's Mixtral sparse-MoE tensors: the router and ``w1``/``w3``/``w2`` of every expert."""
    hidden, inter, n_experts = config.hidden_size, config.intermediate_size, config.num_local_experts
    shapes = {"block_sparse_moe.gate.weight": (n_experts, hidden)}
    for e in range(n_experts):
        expert = f"block_sparse_moe.experts.{e}."
        shapes |= {expert + "w1.weight": (inter, hidden), expert + "w3.weight": (inter, hidden)}
        shapes[expert + "w2.weight"] = (hidden, inter)
    return shapes


def qwen3_moe_mlp_shapes(config: transformers.PretrainedConfig, layer: int = 0) -> dict[str, tuple[int, ...]]:
    """Layer ``layer``'s Qwen3-MoE MLP: a dense one where ``mlp_only_layers``/``decoder_sparse_step``
    keep it, else the router ``mlp.gate`` and every expert's ``gate_proj``/``up_proj``/``down_proj``."""
    moe = model_args_from_config(config).moe
    if moe is None or layer in moe.dense_layers:
        return dense_mlp_shapes(config, layer)
    hidden, inter = config.hidden_size, config.moe_intermediate_size
    shapes = {"mlp.gate.weight": (moe.n_experts, hidden)}
    for e in range(moe.n_experts):
        expert = f"mlp.experts.{e}."
        shapes |= {expert + "gate_proj.weight": (inter, hidden), expert + "up_proj.weight": (inter, hidden)}
        shapes[expert + "down_proj.weight"] = (hidden, inter)
    return shapes


# The parts of a vision-language checkpoint a text-only engine leaves out, in both layouts.
VISION_PREFIXES = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
)


def gemma3_text_name(name: str) -> str | None:
    """A Gemma 3 vision-language checkpoint's tensor name as its language model's (``model.*``,
    ``lm_head.*``), or None for the vision tower and projector, which a text-only engine skips.
    Both layouts occur: ``language_model.model.*`` (as released) and ``model.language_model.*``."""
    for old, new in (
        ("language_model.model.", "model."),
        ("model.language_model.", "model."),
        ("language_model.lm_head.", "lm_head."),
    ):
        if name.startswith(old):
            return new + name[len(old) :]
    return None if name.startswith(VISION_PREFIXES) else name


@dataclass(frozen=True)
class Architecture:
    """A supported model family: its transformers config class, ``architectures`` entry and the
    per-layer tensors beyond the common q/k/v/o projections: the MLP's (by layer), the norms', the
    q/k/v biases and per-head q/k norms. ``text_config``: the checkpoint is a vision-language one
    whose language model is served (its config under ``text_config``, its tensor names mapped by
    ``gemma3_text_name``)."""

    config_cls: type[transformers.PretrainedConfig]
    architecture: str
    mlp_shapes: Callable[[transformers.PretrainedConfig, int], dict[str, tuple[int, ...]]] = dense_mlp_shapes
    norm_names: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")
    qkv_bias: bool = False
    qk_norm: bool = False
    text_config: bool = False


GEMMA3_NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)
# transformers model_type -> family. Add a family here, never as a branch in the loading code.
ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture(transformers.LlamaConfig, "LlamaForCausalLM"),
    "mistral": Architecture(transformers.MistralConfig, "MistralForCausalLM"),
    "mixtral": Architecture(transformers.MixtralConfig, "MixtralForCausalLM", moe_mlp_shapes),
    "qwen2": Architecture(transformers.Qwen2Config, "Qwen2ForCausalLM", qkv_bias=True),
    "qwen3": Architecture(transformers.Qwen3Config, "Qwen3ForCausalLM", qk_norm=True),
    "qwen3_moe": Architecture(
        transformers.Qwen3MoeConfig, "Qwen3MoeForCausalLM", qwen3_moe_mlp_shapes, qk_norm=True
    ),
    "gemma3_text": Architecture(
        transformers.Gemma3TextConfig, "Gemma3ForCausalLM", norm_names=GEMMA3_NORMS, qk_norm=True
    ),
    "gemma3": Architecture(
        transformers.Gemma3TextConfig,
        "Gemma3ForConditionalGeneration",
        norm_names=GEMMA3_NORMS,
        qk_norm=True,
        text_config=True,
    ),
}

CONFIG_FILE = "config.json"
# Weight layouts in order of preference: (index file for shards, single file).
WEIGHT_LAYOUTS = (
    ("model.safetensors.index.json", "model.safetensors"),
    ("pytorch_model.bin.index.json", "pytorch_model.bin"),
)
# Buffers some checkpoints saved alongside parameters; the model recomputes them.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclass(frozen=True)
class LoadedCheckpoint:
    """A checkpoint ready for the torch model; see the module docstring for the invariants."""

    config: transformers.PretrainedConfig
    state_dict: dict[str, torch.Tensor | QuantizedTensor] = field(repr=False)
    tokenizer_dir: Path
    tokenizer_kwargs: dict[str, Any]
    source: str


def resolve_model_path(model: str) -> Path:
    """A built-in name (``smollm2``), a checkpoint directory, or a ``.gguf`` file -> its local path."""
    builtin = resolve_builtin(model)
    if builtin is not None:
        return builtin
    path = Path(model).expanduser()
    if path.is_dir() or (path.is_file() and path.suffix == ".gguf"):
        return path
    raise FileNotFoundError(
        f"model {model!r} is not a built-in name ({', '.join(sorted(BUILTIN_MODELS))}), "
        "a checkpoint directory, or a .gguf file"
    )


def load_checkpoint(
    path: str | Path, dtype: torch.dtype = torch.float32, keep_quantized: bool = False
) -> LoadedCheckpoint:
    """Load the HF directory or GGUF file at ``path`` with floating tensors cast to ``dtype``
    (``keep_quantized``: a GGUF file's Q4/Q8 block tensors stay in their codes)."""
    path = Path(path).expanduser()
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating dtype, got {dtype}")
    if path.is_file() and path.suffix == ".gguf":
        ckpt = _load_gguf(path, dtype, keep_quantized)
    elif path.is_dir():
        ckpt = _load_hf_dir(path, dtype)
    else:
        raise FileNotFoundError(f"{path}: no such checkpoint directory or .gguf file")
    _check_state_dict(ckpt.config, ckpt.state_dict, ckpt.source)
    return ckpt


def load_tokenizer(ckpt: LoadedCheckpoint) -> Any:
    """The checkpoint's tokenizer, offline; for GGUF, EOS and padding follow the GGUF metadata.

    transformers' GGUF tokenizer conversion can pick a different EOS (SmolLM2: ``<|im_start|>``
    instead of ``<|im_end|>``), so the ids recorded in ``config.eos_token_id``/``pad_token_id`` win.
    The file's add-BOS/EOS flags arrive through ``tokenizer_kwargs``.
    """
    kwargs = dict(ckpt.tokenizer_kwargs)
    if "gguf_file" in kwargs:
        # Only silences transformers' Llama "legacy" notice; the GGUF tokenizer is built fast-only.
        kwargs.setdefault("legacy", False)
    try:
        tok = transformers.AutoTokenizer.from_pretrained(
            str(ckpt.tokenizer_dir), local_files_only=True, **kwargs
        )
    except OSError as exc:
        raise FileNotFoundError(f"{ckpt.tokenizer_dir}: no usable tokenizer: {exc}") from exc
    if "gguf_file" in kwargs:
        _use_config_special_tokens(tok, ckpt.config, ckpt.source)
    return tok


def _use_config_special_tokens(tok: Any, config: transformers.PretrainedConfig, source: str) -> None:
    """Point the tokenizer's EOS (and a missing pad) at the ids the config took from GGUF metadata."""
    eos_id, pad_id = config.eos_token_id, config.pad_token_id
    for name, token_id in (("eos_token_id", eos_id), ("pad_token_id", pad_id)):
        if isinstance(token_id, int) and not 0 <= token_id < len(tok):
            raise ValueError(f"{source}: {name} {token_id} outside the vocabulary ({len(tok)} tokens)")
    if isinstance(eos_id, int) and tok.eos_token_id != eos_id:
        tok.eos_token = tok.convert_ids_to_tokens(eos_id)
    if isinstance(pad_id, int) and tok.pad_token is None:
        tok.pad_token = tok.convert_ids_to_tokens(pad_id)


def expected_shapes(config: transformers.PretrainedConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter the model needs, by Hugging Face name, with its shape."""
    hidden, vocab = config.hidden_size, config.vocab_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q_rows, kv_rows = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (vocab, hidden)
    arch = ARCHITECTURES[config.model_type]
    per_layer = {
        "self_attn.q_proj.weight": (q_rows, hidden),
        "self_attn.k_proj.weight": (kv_rows, hidden),
        "self_attn.v_proj.weight": (kv_rows, hidden),
        "self_attn.o_proj.weight": (hidden, q_rows),
        **{f"{norm}.weight": (hidden,) for norm in arch.norm_names},
    }
    if arch.qkv_bias or getattr(config, "attention_bias", False):
        per_layer |= {
            f"self_attn.{n}_proj.bias": (r,) for n, r in (("q", q_rows), ("k", kv_rows), ("v", kv_rows))
        }
    if getattr(config, "attention_bias", False):
        per_layer["self_attn.o_proj.bias"] = (hidden,)
    if arch.qk_norm:
        per_layer |= {"self_attn.q_norm.weight": (head_dim,), "self_attn.k_norm.weight": (head_dim,)}
    for i in range(config.num_hidden_layers):
        layer = {**per_layer, **arch.mlp_shapes(config, i)}
        shapes.update({f"model.layers.{i}.{name}": shape for name, shape in layer.items()})
    return shapes


def expected_parameter_names(config: transformers.PretrainedConfig) -> list[str]:
    """The state-dict keys a checkpoint for ``config`` must provide."""
    return list(expected_shapes(config))


def _check_state_dict(
    config: transformers.PretrainedConfig, state_dict: dict[str, torch.Tensor | QuantizedTensor], source: str
) -> None:
    shapes = expected_shapes(config)
    missing = sorted(set(shapes) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(shapes))
    if missing:
        raise ValueError(f"{source}: missing {len(missing)} tensors, e.g. {missing[:3]}")
    if unexpected:
        raise ValueError(f"{source}: unexpected {len(unexpected)} tensors, e.g. {unexpected[:3]}")
    for name, shape in shapes.items():
        if tuple(state_dict[name].shape) != shape:
            raise ValueError(
                f"{source}: tensor {name} has shape {tuple(state_dict[name].shape)}, config implies {shape}"
            )


def _load_gguf(path: Path, dtype: torch.dtype, keep_quantized: bool) -> LoadedCheckpoint:
    gguf_ckpt = read_gguf(path, dtype, keep_quantized)
    arch = ARCHITECTURES[gguf_ckpt.model_type]
    config = arch.config_cls(**gguf_ckpt.config_fields, architectures=[arch.architecture])
    tokenizer_kwargs = {"gguf_file": path.name, **gguf_ckpt.tokenizer_kwargs}
    return LoadedCheckpoint(config, gguf_ckpt.state_dict, path.parent, tokenizer_kwargs, str(path))


def _load_hf_dir(path: Path, dtype: torch.dtype) -> LoadedCheckpoint:
    config = read_hf_config(path)
    family = next(a for a in ARCHITECTURES.values() if a.architecture == config.architectures[0])
    rename = gemma3_text_name if family.text_config else _same_name
    state_dict: dict[str, torch.Tensor] = {}
    for file in _weight_files(path):
        for stored, tensor in _read_weights(file).items():
            name = rename(stored)
            if name is None or name.endswith(IGNORED_SUFFIXES):
                continue
            state_dict[name] = tensor.to(dtype).contiguous() if tensor.is_floating_point() else tensor
    if config.tie_word_embeddings:
        # save_pretrained usually drops the tied head; a copy that is present is the same tensor.
        state_dict.pop("lm_head.weight", None)
    return LoadedCheckpoint(config, state_dict, path, {}, str(path))


def read_hf_config(path: Path) -> transformers.PretrainedConfig:
    """``path/config.json`` as the family's config class, rejecting unsupported architectures."""
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path}: missing; a Hugging Face checkpoint directory needs it")
    raw = read_hf_config_file(config_path, "the CPU engine")
    model_type = raw.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(
            f"{config_path}: model_type {model_type!r} is not supported (supported: {sorted(ARCHITECTURES)})"
        )
    arch = ARCHITECTURES[model_type]
    architectures = raw.get("architectures") or [arch.architecture]
    if architectures != [arch.architecture]:
        raise ValueError(
            f"{config_path}: architectures {architectures!r} not supported for model_type "
            f"{model_type!r} (expected [{arch.architecture!r}])"
        )
    fields = _text_fields(raw, config_path) if arch.text_config else raw
    try:
        return arch.config_cls.from_dict({**fields, "architectures": architectures})
    except (TypeError, ValueError, KeyError) as exc:
        raise ValueError(f"{config_path}: invalid {model_type} config: {exc}") from exc


def _text_fields(raw: dict[str, Any], config_path: Path) -> dict[str, Any]:
    """A vision-language config's ``text_config``, with the token ids and head tying the top level
    states (a released Gemma 3 lists its end-of-turn id there only)."""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"{config_path}: model_type {raw.get('model_type')!r} needs a text_config object")
    shared = ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings")
    top = {name: raw[name] for name in shared if raw.get(name) is not None and name not in text}
    return {key: value for key, value in {**text, **top}.items() if key != "model_type"}


def _same_name(name: str) -> str | None:
    return name


def _weight_files(path: Path) -> list[Path]:
    """The weight files of ``path``: the shards its index names, or its single weight file."""
    for index_name, single_name in WEIGHT_LAYOUTS:
        index = path / index_name
        if index.is_file():
            return _shards_from_index(index)
        if (path / single_name).is_file():
            return [path / single_name]
    expected = ", ".join(name for layout in WEIGHT_LAYOUTS for name in layout)
    raise FileNotFoundError(f"{path}: no weights found (looked for {expected})")


def _shards_from_index(index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        shard_names = sorted(set(weight_map.values()))
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{index}: not a valid weight index (needs a 'weight_map' object): {exc}") from exc
    shards = [index.parent / name for name in shard_names]
    for shard in shards:
        if not shard.is_file():
            raise FileNotFoundError(f"{shard}: shard named in {index.name} is missing")
    return shards


def _read_weights(file: Path) -> dict[str, torch.Tensor]:
    if file.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(file)
        except SafetensorError as exc:
            raise ValueError(f"{file}: corrupt or truncated safetensors file: {exc}") from exc
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, ValueError, OSError, pickle.UnpicklingError) as exc:
        raise ValueError(f"{file}: unreadable PyTorch weights file: {exc}") from exc
    if not isinstance(state, dict):
        raise ValueError(f"{file}: expected a state dict, got {type(state).__name__}")
    return state
