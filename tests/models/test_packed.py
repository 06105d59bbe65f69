"""oneDNN-packed bf16 weights (``models.packed``): the same logits as plain tensors, every matmul
weight swapped, the embedding table left plain, and fp32 left alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from neuron_lmi.models import build_model
from neuron_lmi.models.loader import load_checkpoint
from neuron_lmi.models.packed import PackedLinear, pack_model, packing_pays
from neuron_lmi.testing.checkpoints import make_tiny_checkpoint

needs_bf16_packing = pytest.mark.skipif(
    not packing_pays(torch.bfloat16), reason="this CPU/torch build has no native oneDNN bf16 matmul"
)


def _model(path: Path, dtype: torch.dtype) -> torch.nn.Module:
    ckpt = load_checkpoint(path, dtype=dtype)
    return build_model(ckpt.config, ckpt.state_dict, n_positions=64, dtype=dtype)


@pytest.fixture(scope="module")
def tied_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # hidden 64 and a tied head: the head shares the embedding table the lookup needs plain.
    return make_tiny_checkpoint(tmp_path_factory.mktemp("packed"), "llama", tie_word_embeddings=True)


@needs_bf16_packing
def test_packed_model_gives_the_plain_models_logits(tied_llama: Path) -> None:
    plain, packed = _model(tied_llama, torch.bfloat16), _model(tied_llama, torch.bfloat16)
    n_layers = len(packed.layers)
    assert pack_model(packed) == 4 * n_layers + 1  # wqkv, wo, w_gate_up, w_down per layer + lm_head
    assert all(isinstance(getattr(layer, name), PackedLinear) for layer in packed.layers
               for name in ("wqkv", "wo", "w_gate_up", "w_down"))  # fmt: skip
    assert isinstance(packed.lm_head, PackedLinear)
    assert isinstance(packed.embed, torch.Tensor) and packed.embed.dtype == torch.bfloat16

    tokens = torch.randint(0, packed.args.vocab_size, (3, 17), generator=torch.Generator().manual_seed(0))
    lengths = [17, 9, 4]
    want, k_want, v_want = plain.prefill(tokens, lengths)
    got, k_got, v_got = packed.prefill(tokens, lengths)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(k_got, k_want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(v_got, v_want, atol=2e-2, rtol=2e-2)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    torch.testing.assert_close(
        packed.layers[0].wqkv.dequantize(), plain.layers[0].wqkv, atol=0, rtol=0
    )  # the packed copy holds the same values


def test_fp32_is_never_packed(tied_llama: Path) -> None:
    model = _model(tied_llama, torch.float32)
    assert pack_model(model) == 0
    assert isinstance(model.layers[0].wqkv, torch.Tensor)


@needs_bf16_packing
def test_quantized_weights_and_expert_stacks_stay_as_they_are(tmp_path: Path) -> None:
    from neuron_lmi.models.quantize import quantize_model

    model = _model(make_tiny_checkpoint(tmp_path / "mixtral", "mixtral"), torch.bfloat16)
    quantize_model(model, "int8")
    assert pack_model(model) == 0  # every matmul weight is a quantized module already
    dense = _model(make_tiny_checkpoint(tmp_path / "mixtral2", "mixtral"), torch.bfloat16)
    pack_model(dense)
    layer = dense.layers[0]
    assert isinstance(layer.wqkv, PackedLinear)
    assert isinstance(layer.experts_gate_up, torch.Tensor) and layer.experts_gate_up.dim() == 3
