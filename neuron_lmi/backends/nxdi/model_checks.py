"""What an NxD Inference application does not honour of a checkpoint's ``config.json``, per release.

Each check returns ``{"config.json <field>": why}`` for the plan's ``ignored`` (logged at start-up), and
raises ``ValueError`` where the checkpoint would not load, or would load into something that is not the
model. Read from the modeling files of 0.8.0 (cd3abf3) and 0.9.0 (4bcdc54) and held against transformers
with the library's own code on the CPU (``tests/backends/nxdi_library/test_model_checks.py``)::

    application    what it fixes or ignores                        effect
    Qwen2/3/3-MoE  rope_scaling (RotaryEmbedding without scaling)  named: positions rotate unscaled
    Qwen3-MoE      norm_topk_prob (Qwen3MoeInferenceConfig sets    named: with false, every token's
                   normalize_top_k_affinities=True)                expert mix is not the model's
                   mlp_only_layers, decoder_sparse_step (every     refused: a dense layer's weights
                   layer built sparse)                             do not load
    Gemma 3 (0.9)  vocab_size (262,208 whatever config.json says)  refused: another does not load
                   rms_norm_eps 1e-6, hidden_act gelu_pytorch_     named where config.json differs
                   tanh, rope_local_base_freq 10,000, every 6th
                   layer global (Gemma3InferenceConfig)
                   the global rotary: model_base.py hands the      named where rope_theta/rope_scaling
                   first layer's cos/sin to every later layer,     differ from the local rotary: outputs
                   so global layers rotate as local ones           differ from the model's
                   final_logit_softcapping (never applied)         named where set (Gemma3ForCausalLM)
                   a vision-language checkpoint's own head         refused: tied to the embeddings, or
                   (text_config.tie_word_embeddings=false)         with a top-level false, not loaded

A released Gemma 3 config.json lists in ``text_config`` only what differs from transformers'
``Gemma3TextConfig``; its defaults stand for the rest (``GEMMA3_TEXT_DEFAULTS``).

Sliding windows (``Windows``, by application)::

    RING    Llama, 0.9's Mistral    config.sliding_window W in every layer: a ring of W-1 slots per row
                                    (the runner keeps it; ``NxdiRunner``)
    NONE    Mixtral, Qwen2/3/3-MoE  every layer attends to the whole sequence: named where n_positions
                                    exceeds the model's shortest window (as transformers reads the
                                    config: ``use_sliding_window``, ``layer_types``)
    WITHIN  Gemma 3 (0.9)           its local layers (every layer but each sixth, window W =
                                    config.sliding_window) keep a full-length cache, attend to the whole
                                    sequence, and write only the last W-1 positions of a prompt into it,
                                    in ring order (get_last_kv_window): right while n_positions <= W,
                                    so longer is refused; that gather indexes W-1 positions of the
                                    context bucket, which the CPU mode's torch.gather refuses where the
                                    bucket is shorter (XLA clamps the index), so there n_positions >= W-1
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from enum import Enum
from typing import Any

from neuron_lmi.models.args import model_args_from_config

# Qwen3-MoE's decoder layer (both releases) wraps its work in ModuleMarkerStart/EndWrapper: an XLA
# custom call (xla_hlo_call) with no CPU path.
MODULE_MARKERS = (
    "its decoder layers pass the hidden states through module markers (models/layer_boundary_marker.py),"
    " XLA custom calls that torch_xla runs on XLA tensors only"
)
# transformers 4.57's Gemma3TextConfig defaults, for what a released config.json leaves out.
GEMMA3_TEXT_DEFAULTS: Mapping[str, Any] = {
    "vocab_size": 262208, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
    "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": 256, "sliding_window": 4096,
    "sliding_window_pattern": 6, "tie_word_embeddings": True,
}  # fmt: skip
TEXT_DEFAULTS: Mapping[str, Mapping[str, Any]] = {
    "gemma3": GEMMA3_TEXT_DEFAULTS,
    "gemma3_text": GEMMA3_TEXT_DEFAULTS,
}
GEMMA3_LAYER_PATTERN = 6  # get_updated_configs: layer i is global where (i + 1) % 6 == 0
GEMMA3_VOCAB = 262208
# What Gemma3InferenceConfig.__init__ (0.9.0) sets whatever config.json says.
GEMMA3_FIXED: Mapping[str, Any] = {
    "rms_norm_eps": 1e-6,
    "hidden_activation": "gelu_pytorch_tanh",
    "rope_local_base_freq": 10000.0,
}


def text_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The language model's config (a vision-language config's ``text_config``), with transformers'
    defaults where the family's config.json leaves fields out."""
    text = config.get("text_config")
    text = text if isinstance(text, Mapping) else config
    return {**TEXT_DEFAULTS.get(str(config.get("model_type")), {}), **text}


def honours_all(config: Mapping[str, Any], version: str) -> dict[str, str]:
    return {}


def _rope_scaling(config: Mapping[str, Any], where: str) -> dict[str, str]:
    scaling = config.get("rope_scaling")
    if not scaling:
        return {}
    return {
        "config.json rope_scaling": f"{where} rotates positions without scaling (RotaryEmbedding(base="
        f"rope_theta)); rope_scaling={scaling!r} is not applied, so outputs differ from the model's "
        "where it scales"
    }


def qwen(config: Mapping[str, Any], version: str) -> dict[str, str]:
    return _rope_scaling(config, f"NxD Inference {version}'s {config.get('model_type')} application")


def qwen3_moe(config: Mapping[str, Any], version: str) -> dict[str, str]:
    where = f"NxD Inference {version}'s NeuronQwen3MoeForCausalLM"
    dense = config.get("mlp_only_layers") or []
    step = config.get("decoder_sparse_step", 1)
    if dense or step not in (1, None):
        raise ValueError(
            f"config.json mlp_only_layers={dense!r}, decoder_sparse_step={step!r}: {where} builds every "
            "layer with experts, so a dense layer's weights would not load; it serves Qwen3-MoE "
            "checkpoints whose every layer is sparse"
        )
    out = _rope_scaling(config, where)
    if not config.get("norm_topk_prob", False):
        out["config.json norm_topk_prob"] = (
            f"{where} renormalises the top-k expert weights (Qwen3MoeInferenceConfig sets "
            "normalize_top_k_affinities=True) whatever the config says; with norm_topk_prob=false every "
            "token's expert mix differs from the model's"
        )
    return out


def global_layers(text: Mapping[str, Any]) -> list[int]:
    """The layers a Gemma 3 attends globally with (transformers: ``layer_types``, else every
    ``sliding_window_pattern``-th layer)."""
    n_layers = int(text.get("num_hidden_layers", 0))
    types = text.get("layer_types")
    if types:
        return [i for i, kind in enumerate(types) if kind == "full_attention"]
    pattern = int(text.get("sliding_window_pattern", GEMMA3_LAYER_PATTERN))
    return [i for i in range(n_layers) if (i + 1) % pattern == 0]


def _gemma3_refusals(config: Mapping[str, Any], text: Mapping[str, Any], where: str) -> None:
    if text["vocab_size"] != GEMMA3_VOCAB:
        raise ValueError(
            f"config.json vocab_size={text['vocab_size']}: {where} builds a {GEMMA3_VOCAB}-token embedding "
            "whatever the config says (Gemma3InferenceConfig), so this checkpoint's would not load; it "
            f"serves the Gemma 3 checkpoints of {GEMMA3_VOCAB} tokens (4B, 12B, 27B)"
        )
    if isinstance(config.get("text_config"), Mapping) and text["tie_word_embeddings"] is False:
        raise ValueError(
            "config.json text_config.tie_word_embeddings=false: this vision-language Gemma 3 has its own "
            f"output head (language_model.lm_head.weight), which {where} does not load: it ties the head to "
            "the embeddings, or with a top-level tie_word_embeddings=false leaves it unloaded; it serves "
            "Gemma 3's released (tied) checkpoints"
        )


def gemma3(config: Mapping[str, Any], version: str) -> dict[str, str]:
    text = text_config(config)
    where = f"NxD Inference {version}'s NeuronGemma3ForCausalLM"
    _gemma3_refusals(config, text, where)
    out = {
        f"config.json {field}": f"{where} uses {fixed!r} whatever the config says: {text[field]!r} is "
        "not applied"
        for field, fixed in GEMMA3_FIXED.items()
        if text[field] != fixed
    }
    n_layers = int(text.get("num_hidden_layers", 0))
    library = [i for i in range(n_layers) if (i + 1) % GEMMA3_LAYER_PATTERN == 0]
    if global_layers(text) != library:
        out["config.json layer_types"] = (
            f"{where} makes every {GEMMA3_LAYER_PATTERN}th layer global (layers {library}); this model's "
            f"global layers are {global_layers(text)}"
        )
    theta, scaling = text["rope_theta"], text.get("rope_scaling")
    if library and (theta != text["rope_local_base_freq"] or scaling):
        out["config.json rope_theta/rope_scaling"] = (
            f"{where} hands the first layer's rotary cos/sin to every later layer (model_base.py), so its "
            "global layers rotate with the local layers' rotary (rope_local_base_freq, unscaled) instead of "
            f"rope_theta={theta!r} with rope_scaling={scaling!r}: outputs differ from the model's after the "
            "first position"
        )
    cap = text.get("final_logit_softcapping")
    if cap is not None and "Gemma3ForConditionalGeneration" not in (config.get("architectures") or []):
        out["config.json final_logit_softcapping"] = f"{where} does not cap the logits ({cap!r})"
    return out


class Windows(Enum):
    """What an application does with a model's sliding window (see the module docstring)."""

    RING = "ring"
    NONE = "none"
    WITHIN = "within"


def model_window(config: Mapping[str, Any]) -> int | None:
    """The shortest window any layer of the model attends within, as transformers reads the config."""
    args = model_args_from_config({**text_config(config), "architectures": config.get("architectures") or []})
    return min((w for w in map(args.window, range(args.n_layers)) if w), default=None)


def _ring(config: Mapping[str, Any], n_positions: int, on_cpu: bool, where: str) -> tuple[int | None, dict]:
    window = config.get("sliding_window")
    if not isinstance(window, int) or window <= 0 or window >= n_positions:
        return None, {}
    return window, {}


def _none(config: Mapping[str, Any], n_positions: int, on_cpu: bool, where: str) -> tuple[int | None, dict]:
    window = model_window(config)
    if window is None or window >= n_positions:
        return None, {}
    return None, {
        "config.json sliding_window": f"{where} has no sliding window: with n_positions={n_positions} > "
        f"sliding_window={window}, tokens past the first {window} attend to the whole sequence, not the "
        f"last {window} as the model was trained; set option.n_positions <= {window} to stay within the "
        "window"
    }


def _within(config: Mapping[str, Any], n_positions: int, on_cpu: bool, where: str) -> tuple[int | None, dict]:
    # The application's own local layers (every layer but each sixth) take config.sliding_window,
    # whatever the model's layer_types say.
    window = text_config(config).get("sliding_window")
    if not isinstance(window, int) or window <= 0:
        return None, {}
    if n_positions > window:
        raise ValueError(
            f"option.n_positions={n_positions} exceeds the model's sliding_window={window}: {where} keeps a "
            "full-length cache for its sliding-window layers, attends over the whole sequence there, and "
            f"writes only the last {window - 1} positions of a prompt into that cache, in ring order: a "
            f"prompt of {window} tokens or more leaves a cache the next tokens misread, and past {window} "
            f"tokens the layers do not slide. Set option.n_positions <= {window}"
        )
    if on_cpu and n_positions < window - 1:
        raise ValueError(
            f"override_neuron_config.on_cpu=true with option.n_positions={n_positions}: {where} gathers the "
            f"last {window - 1} positions (sliding_window={window} less one) of each context bucket, and the "
            f"CPU mode's one bucket of {n_positions} is shorter (torch.gather fails; a device clamps the "
            f"index); set option.n_positions to {window - 1} or {window}"
        )
    return None, {}


# Windows -> (config, n_positions, on_cpu, "NxD Inference <version>'s <application>") -> (the ring the
# runner keeps, ignored entries); raises ValueError where the application cannot serve the window.
WINDOW_RULES: Mapping[Windows, Callable[..., tuple[int | None, dict[str, str]]]] = {
    Windows.RING: _ring,
    Windows.NONE: _none,
    Windows.WITHIN: _within,
}


def sliding_window(
    kind: Windows, config: Mapping[str, Any], n_positions: int, on_cpu: bool, where: str
) -> tuple[int | None, dict[str, str]]:
    return WINDOW_RULES[kind](config, n_positions, on_cpu, where)
