"""Checkpoint loading: HF directories (single, sharded, .bin), GGUF (synthetic and SmolLM2), errors."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from neuron_lmi.models.gguf_loader import llama3_rope_scaling, unpermute_rotary_rows
from neuron_lmi.models.loader import (
    LoadedCheckpoint,
    expected_parameter_names,
    load_checkpoint,
    load_tokenizer,
    resolve_model_path,
)


def _saved_tensors(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(ckpt_dir.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def _assert_same_tensors(loaded: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    assert sorted(loaded) == sorted(reference)
    for name, tensor in reference.items():
        torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0, msg=name)


def _llama_cpp_permute(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """What llama.cpp's convert_hf_to_gguf does to Q/K rows (written from its documented behaviour)."""
    half = weight.shape[0] // n_heads // 2
    return weight.reshape(n_heads, 2, half, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def _write_gguf(
    ckpt: LoadedCheckpoint,
    out: Path,
    tied: bool = False,
    extra: Callable[[Any], None] | None = None,
    qtype: Any = None,
) -> Path:
    """A GGUF with llama.cpp's layout of ``ckpt`` (fp32 tensors, permuted Q/K); ``extra`` adds metadata;
    ``qtype`` (a ``gguf.GGMLQuantizationType``) stores the matrices in that block format."""
    import gguf

    cfg = ckpt.config
    writer = gguf.GGUFWriter(out, "llama")
    if extra is not None:
        extra(writer)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_eos_token_id(cfg.eos_token_id)
    for name, tensor in ckpt.state_dict.items():
        if name == "lm_head.weight" and tied:
            continue
        if name.startswith("model.layers."):
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            part = rest.removesuffix(".weight")
            if part == "self_attn.q_proj":
                tensor = _llama_cpp_permute(tensor, cfg.num_attention_heads)
            elif part == "self_attn.k_proj":
                tensor = _llama_cpp_permute(tensor, cfg.num_key_value_heads)
            gguf_name = f"blk.{layer}.{_GGUF_NAMES[part]}.weight"
        else:
            gguf_name = {
                "model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight",
            }[name]
        array = tensor.float().numpy()
        if qtype is not None and array.ndim == 2:
            writer.add_tensor(gguf_name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


# --- Hugging Face directories -------------------------------------------------------------------


def test_single_safetensors_matches_saved_model(tiny_llama_dir: Path) -> None:
    ckpt = load_checkpoint(tiny_llama_dir)
    assert type(ckpt.config).__name__ == "LlamaConfig"
    assert ckpt.config.architectures == ["LlamaForCausalLM"]
    assert ckpt.config.num_key_value_heads == 2 and not ckpt.config.tie_word_embeddings
    assert ckpt.tokenizer_dir == tiny_llama_dir and ckpt.tokenizer_kwargs == {}
    assert sorted(ckpt.state_dict) == sorted(expected_parameter_names(ckpt.config))
    _assert_same_tensors(ckpt.state_dict, _saved_tensors(tiny_llama_dir))


def test_sharded_safetensors_matches_saved_model(tiny_mistral_dir: Path) -> None:
    assert (tiny_mistral_dir / "model.safetensors.index.json").is_file()
    assert len(list(tiny_mistral_dir.glob("*.safetensors"))) > 1
    ckpt = load_checkpoint(tiny_mistral_dir)
    assert type(ckpt.config).__name__ == "MistralConfig"
    assert ckpt.config.architectures == ["MistralForCausalLM"]
    assert ckpt.config.sliding_window == 16
    _assert_same_tensors(ckpt.state_dict, _saved_tensors(tiny_mistral_dir))


def test_bf16_dtype(tiny_mistral_dir: Path) -> None:
    ckpt = load_checkpoint(tiny_mistral_dir, dtype=torch.bfloat16)
    reference = _saved_tensors(tiny_mistral_dir)
    assert all(t.dtype == torch.bfloat16 for t in ckpt.state_dict.values())
    for name, tensor in reference.items():
        torch.testing.assert_close(ckpt.state_dict[name], tensor.to(torch.bfloat16), rtol=0, atol=0)


def test_pytorch_bin_is_accepted(tiny_llama_dir: Path, copy_dir) -> None:
    ckpt_dir = copy_dir(tiny_llama_dir)
    reference = load_file(ckpt_dir / "model.safetensors")
    (ckpt_dir / "model.safetensors").unlink()
    torch.save(reference, ckpt_dir / "pytorch_model.bin")
    _assert_same_tensors(load_checkpoint(ckpt_dir).state_dict, reference)


def test_tied_head_in_file_is_dropped(tiny_llama_dir: Path, copy_dir) -> None:
    ckpt_dir = copy_dir(tiny_llama_dir)
    config = json.loads((ckpt_dir / "config.json").read_text())
    (ckpt_dir / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    ckpt = load_checkpoint(ckpt_dir)
    assert ckpt.config.tie_word_embeddings and "lm_head.weight" not in ckpt.state_dict


def test_tokenizer_from_hf_dir(tiny_llama_dir: Path) -> None:
    tok = load_tokenizer(load_checkpoint(tiny_llama_dir))
    assert tok.eos_token == "<|im_end|>"
    assert tok.decode(tok("hello world", add_special_tokens=False)["input_ids"]) == "hello world"


# --- corrupt and unsupported checkpoints --------------------------------------------------------


def test_truncated_safetensors_names_file(tiny_llama_dir: Path, copy_dir) -> None:
    ckpt_dir = copy_dir(tiny_llama_dir)
    weights = ckpt_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"model\.safetensors.*(corrupt|truncated)"):
        load_checkpoint(ckpt_dir)


def test_missing_shard_names_file(tiny_mistral_dir: Path, copy_dir) -> None:
    ckpt_dir = copy_dir(tiny_mistral_dir)
    shard = sorted(ckpt_dir.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        load_checkpoint(ckpt_dir)


def test_missing_tensor_is_rejected(tiny_llama_dir: Path, copy_dir) -> None:
    ckpt_dir = copy_dir(tiny_llama_dir)
    tensors = load_file(ckpt_dir / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, ckpt_dir / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing 1 tensors.*layers\.1\.mlp\.up_proj"):
        load_checkpoint(ckpt_dir)


@pytest.mark.parametrize(
    ("edit", "error", "pattern"),
    [
        (lambda text: text[: len(text) // 2], ValueError, "config.json: not valid JSON"),
        (lambda text: text.replace('"llama"', '"gpt2"'), ValueError, "config.json: model_type 'gpt2'"),
        (
            lambda text: text.replace("LlamaForCausalLM", "LlamaForSequenceClassification"),
            ValueError,
            "config.json: architectures",
        ),
        (None, FileNotFoundError, "config.json: missing"),
    ],
    ids=["truncated-json", "unknown-model-type", "unknown-architecture", "missing"],
)
def test_bad_config_names_file(tiny_llama_dir: Path, copy_dir, edit, error, pattern) -> None:
    ckpt_dir = copy_dir(tiny_llama_dir)
    config = ckpt_dir / "config.json"
    if edit is None:
        config.unlink()
    else:
        config.write_text(edit(config.read_text()))
    with pytest.raises(error, match=pattern):
        load_checkpoint(ckpt_dir)


def test_shape_mismatch_is_rejected(tiny_llama_dir: Path, copy_dir) -> None:
    ckpt_dir = copy_dir(tiny_llama_dir)
    config = json.loads((ckpt_dir / "config.json").read_text())
    (ckpt_dir / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    with pytest.raises(ValueError, match=r"mlp\.\w+_proj\.weight has shape"):
        load_checkpoint(ckpt_dir)


@pytest.mark.parametrize("keep", [0.5, 0.0001])
def test_truncated_gguf_names_file(smollm2_gguf: Path, tmp_path: Path, keep: float) -> None:
    broken = tmp_path / "broken.gguf"
    with smollm2_gguf.open("rb") as src:
        broken.write_bytes(src.read(int(smollm2_gguf.stat().st_size * keep)))
    with pytest.raises(ValueError, match=r"broken\.gguf"):
        load_checkpoint(broken)


# --- GGUF -----------------------------------------------------------------------------------------


def test_unpermute_inverts_llama_cpp_permute() -> None:
    weight = torch.arange(6 * 8 * 3, dtype=torch.float32).reshape(6 * 8, 3)
    torch.testing.assert_close(unpermute_rotary_rows(_llama_cpp_permute(weight, 6), 6), weight)
    with pytest.raises(ValueError, match="rotary heads"):
        unpermute_rotary_rows(torch.zeros(10, 2), 3)


@pytest.mark.parametrize("tied", [False, True])
def test_gguf_round_trip_recovers_hf_tensors(tiny_llama_dir: Path, tmp_path: Path, tied: bool) -> None:
    hf = load_checkpoint(tiny_llama_dir)
    path = _write_gguf(hf, tmp_path / "tiny.gguf", tied=tied)
    ckpt = load_checkpoint(path)
    assert ckpt.tokenizer_dir == tmp_path and ckpt.tokenizer_kwargs == {"gguf_file": "tiny.gguf"}
    assert ckpt.config.tie_word_embeddings is tied
    for field in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        assert getattr(ckpt.config, field) == getattr(hf.config, field)
    assert ckpt.config.num_key_value_heads == 2 and ckpt.config.eos_token_id == hf.config.eos_token_id
    reference = {k: v for k, v in hf.state_dict.items() if not (tied and k == "lm_head.weight")}
    _assert_same_tensors(ckpt.state_dict, reference)


def test_gguf_linear_rope_scaling(tiny_llama_dir: Path, tmp_path: Path) -> None:
    import gguf

    def linear(writer: Any) -> None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(2.0)

    path = _write_gguf(load_checkpoint(tiny_llama_dir), tmp_path / "tiny.gguf", extra=linear)
    assert load_checkpoint(path).config.rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_llama3_rope_scaling_from_rope_freqs(tmp_path: Path) -> None:
    """llama.cpp's rope_freqs divisors are recovered as transformers' Llama-3 rope_scaling."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    config = LlamaConfig(hidden_size=2048, num_attention_heads=32, rope_theta=500000.0, rope_scaling=scaling)
    default, _ = ROPE_INIT_FUNCTIONS["default"](config, "cpu")
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    divisors = (default / scaled).numpy()
    fields = {"head_dim": 64, "rope_theta": 500000.0}
    assert llama3_rope_scaling(divisors, fields, tmp_path / "x.gguf") == scaling
    divisors[-1] *= 2
    with pytest.raises(ValueError, match=r"x\.gguf: rope_freqs"):
        llama3_rope_scaling(divisors, fields, tmp_path / "x.gguf")


# --- model names ----------------------------------------------------------------------------------


def test_resolve_model_path(smollm2_gguf: Path, tiny_llama_dir: Path) -> None:
    assert resolve_model_path("smollm2") == smollm2_gguf
    assert resolve_model_path("SmolLM2") == smollm2_gguf
    assert resolve_model_path(str(tiny_llama_dir)) == tiny_llama_dir
    assert resolve_model_path(str(smollm2_gguf)) == smollm2_gguf


@pytest.mark.parametrize("name", ["no-such-model", "/nonexistent/dir", "meta-llama/Llama-3-8B"])
def test_resolve_unknown_model_fails(name: str) -> None:
    with pytest.raises(FileNotFoundError, match=name):
        resolve_model_path(name)


def test_load_missing_path_fails(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nothing-here"):
        load_checkpoint(tmp_path / "nothing-here")


# --- SmolLM2 against transformers' own GGUF loader ---------------------------------------------


_COMPARED_CONFIG_FIELDS = [
    *("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads"),
    *("head_dim", "rms_norm_eps", "rope_theta", "rope_scaling", "max_position_embeddings", "vocab_size"),
    *("tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "model_type"),
]


@pytest.fixture(scope="module")
def smollm2_ckpt(smollm2_gguf: Path) -> LoadedCheckpoint:
    return load_checkpoint(smollm2_gguf)


@pytest.mark.slow
def test_smollm2_matches_transformers(smollm2_gguf: Path, smollm2_ckpt: LoadedCheckpoint) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, torch_dtype=torch.float32
    )
    reference = model.state_dict()
    ours = smollm2_ckpt.state_dict
    assert smollm2_ckpt.config.tie_word_embeddings and "lm_head.weight" not in ours
    assert set(reference) == set(ours) | {"lm_head.weight"}
    for name, tensor in ours.items():
        torch.testing.assert_close(tensor, reference[name], msg=name)
    torch.testing.assert_close(ours["model.embed_tokens.weight"], reference["lm_head.weight"])
    for field in _COMPARED_CONFIG_FIELDS:
        assert getattr(smollm2_ckpt.config, field) == getattr(model.config, field), field
    assert smollm2_ckpt.config.architectures == ["LlamaForCausalLM"]
    assert smollm2_ckpt.config.eos_token_id == 2


@pytest.mark.slow
def test_smollm2_tokenizer_eos_from_gguf(smollm2_ckpt: LoadedCheckpoint) -> None:
    assert smollm2_ckpt.tokenizer_kwargs == {
        "gguf_file": smollm2_ckpt.source.rsplit("/", 1)[-1],
        "add_bos_token": False,
    }
    tok = load_tokenizer(smollm2_ckpt)
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    assert tok.pad_token_id == 2
    assert tok.convert_ids_to_tokens(1) == "<|im_start|>"
    # The GGUF says add_bos_token=False; transformers' conversion alone would prepend <|im_start|>.
    ids = tok("Hello there")["input_ids"]
    assert ids[0] != 1 and tok.decode(ids) == "Hello there"
