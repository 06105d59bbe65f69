"""Quantized models against their fp32 reference: the transform, engine use, and measured quality.

Documented tolerances (teacher-forced top-1 agreement with fp32 over fp32's greedy continuation;
perplexity change of a fixed sequence), for the quantized paths only:

    model                      int8 agreement  int4 agreement  |perplexity change| int8 / int4
    tiny random (3 layers)     >= 0.90         >= 0.60         <= 2% / 10%
    SmolLM2-135M (slow)        >= 0.90         >= 0.85         <= 3% / 3%

Random tiny weights are the worst case for 4-bit (no outliers to spend the range on, flat logits):
measured 0.99 / 0.76 (Llama) and 0.97 / 0.74 (Mixtral), perplexity within 0.3% (int8) and 6%
(int4). SmolLM2's GGUF is Q4_1 already, so its int4 run keeps the file's codes and differs from
fp32 (the dequantized file) only by the int8 head and bf16 matmuls.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from neuron_lmi.backends.cpu.llm import LLM
from neuron_lmi.engine.types import SamplingParams
from neuron_lmi.models import build_model
from neuron_lmi.models.loader import load_checkpoint
from neuron_lmi.models.quant import Int4Linear, Int8Linear, QuantizedLinear
from neuron_lmi.models.quant_eval import all_logits, perplexity, token_agreement
from neuron_lmi.models.quantize import quantize_model

TINY_BOUNDS = {"int8": (0.90, 0.02), "int4": (0.60, 0.10)}


@pytest.fixture(scope="module")
def tiny_mixtral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from neuron_lmi.testing.checkpoints import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_mixtral_q"), "mixtral")


SMOLLM2_BOUNDS = {"int8": (0.90, 0.03), "int4": (0.85, 0.03)}


def _greedy(model, prompt: list[int], n_new: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n_new):
        ids.append(int(all_logits(model, ids)[-1].argmax()))
    return ids[len(prompt) :]


def _check_quality(ref, candidate, prompts: list[list[int]], n_new: int, bounds: tuple[float, float]) -> None:
    conts = [_greedy(ref, p, n_new) for p in prompts]
    agreement = token_agreement(ref, candidate, prompts, conts)
    text = [t for p, c in zip(prompts, conts, strict=True) for t in (*p, *c)]
    change = perplexity(candidate, text) / perplexity(ref, text) - 1
    assert agreement >= bounds[0], agreement
    assert abs(change) <= bounds[1], change


def _tiny_prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(1000, 20000) for _ in range(n)] for n in (5, 17, 30, 9)]


@pytest.mark.parametrize("arch", ["llama", "mixtral"])
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_tiny_quantized_quality(arch: str, method: str, tiny_llama_dir: Path, tiny_mixtral_dir: Path) -> None:
    ckpt = load_checkpoint(tiny_llama_dir if arch == "llama" else tiny_mixtral_dir)
    ref = build_model(ckpt.config, ckpt.state_dict, 256)
    model = quantize_model(build_model(ckpt.config, ckpt.state_dict, 256), method)
    _check_quality(ref, model, _tiny_prompts(), 24, TINY_BOUNDS[method])


def test_transform_swaps_every_matmul_weight(tiny_llama_dir: Path, tiny_mixtral_dir: Path) -> None:
    ckpt = load_checkpoint(tiny_llama_dir)
    model = quantize_model(build_model(ckpt.config, ckpt.state_dict, 64), "int4")
    for layer in model.layers:
        assert all(isinstance(getattr(layer, n), Int4Linear) for n in layer.linear_weights)
    assert isinstance(model.lm_head, Int8Linear)  # the head stays 8-bit under int4
    assert isinstance(model.embed, torch.nn.Parameter) and model.embed.dtype == torch.float32
    assert quantize_model(model, "int4") is model  # a second pass leaves quantized weights alone
    with pytest.raises(ValueError, match="Neuron-only"):
        quantize_model(model, "fp8")
    moe = load_checkpoint(tiny_mixtral_dir)
    mixtral = quantize_model(build_model(moe.config, moe.state_dict, 64), "int8")
    layer = mixtral.layers[0]
    assert len(layer.experts_gate_up) == layer.router.shape[0]
    assert all(isinstance(e, Int8Linear) for e in [*layer.experts_gate_up, *layer.experts_down])
    assert isinstance(layer.router, torch.nn.Parameter)  # routing stays dense


def test_tied_head_is_quantized_and_lookups_stay_dense(tmp_path: Path) -> None:
    from neuron_lmi.testing.checkpoints import make_tiny_checkpoint

    ckpt = load_checkpoint(make_tiny_checkpoint(tmp_path / "tied", "llama", tie_word_embeddings=True))
    ref = build_model(ckpt.config, ckpt.state_dict, 64)
    model = quantize_model(build_model(ckpt.config, ckpt.state_dict, 64), "int8")
    assert isinstance(model.lm_head, Int8Linear) and isinstance(model.embed, torch.nn.Parameter)
    torch.testing.assert_close(model.embed, ref.embed, rtol=0, atol=0)


def test_tensor_parallel_then_quantize(tiny_llama_dir: Path) -> None:
    from neuron_lmi.parallel.tp_model import apply_tensor_parallel

    ckpt = load_checkpoint(tiny_llama_dir)
    ref = build_model(ckpt.config, ckpt.state_dict, 256)
    sharded = apply_tensor_parallel(build_model(ckpt.config, ckpt.state_dict, 256), 2, "shard-over-heads")
    quantize_model(sharded, "int8")
    assert any(isinstance(m, QuantizedLinear) for m in sharded.layers[0].modules())
    _check_quality(ref, sharded, _tiny_prompts(), 24, TINY_BOUNDS["int8"])


def test_quantized_engine_generates_and_frees_rows(tiny_llama_dir: Path) -> None:
    llm = LLM(
        str(tiny_llama_dir),
        dtype="fp32",
        enforce_eager=True,
        quantize="int8",
        max_rolling_batch_size=4,
        n_positions=128,
    )
    prompts = _tiny_prompts()
    results = llm.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert [len(r.token_ids) for r in results] == [8] * len(prompts)
    assert llm.core.runner.rows.occupancy().rows_used == 0


@pytest.mark.slow
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_smollm2_quantized_quality(method: str) -> None:
    ref = LLM("smollm2", dtype="fp32", enforce_eager=True, max_rolling_batch_size=1, n_positions=256)
    llm = LLM(
        "smollm2",
        dtype="fp32",
        enforce_eager=True,
        quantize=method,
        max_rolling_batch_size=1,
        n_positions=256,
    )
    model = llm.core.runner.model
    if method == "int4":  # the file's Q4_1 codes, kept: 4-bit layers, Q8_0 embedding as an int8 head
        assert isinstance(model.layers[0].wqkv, Int4Linear) and isinstance(model.lm_head, Int8Linear)
    tok = ref.tokenizer
    prompts = [tok.encode(p) for p in ("The capital of France is", "def fibonacci(n):", "Three tips for")]
    _check_quality(ref.core.runner.model, model, prompts, 16, SMOLLM2_BOUNDS[method])
