"""Where NxD Inference's Qwen3-MoE and Gemma 3 applications compute something else than the model, held
against transformers with the library's own code (``neuron_lmi.backends.nxdi.model_checks`` names or
refuses each; the schedule tests run checkpoints configured as the released ones, where none applies).

Each test shows three things: what transformers computes, what the library computes instead (matched
by the CPU engine on the config the library acts as if it had), and the plan's word on it. Where the
plan refuses a checkpoint, the library is built for it all the same (a plan for a copy whose
config.json passes, pointed at the checkpoint) to show why.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from neuron_lmi.backends.nxdi.runner import on_cpu_application
from neuron_lmi.backends.nxdi.support import UnsupportedReleaseError
from neuron_lmi.models import build_model
from neuron_lmi.models.loader import load_checkpoint
from neuron_lmi.testing.checkpoints import make_tiny_checkpoint
from tests.backends.nxdi.test_families import TINY
from tests.backends.nxdi_library.conftest import ARCHES, nxdi_plan

N = 32
PROMPT = list(range(100, 120))  # 20 tokens
pytestmark = pytest.mark.usefixtures("one_thread", "cpu_forward")
GEMMA3_SERVED = "gemma3_text" in ARCHES  # 0.9+


def variant(checkpoint: Path, folder: Path, **config: Any) -> Path:
    """A copy of ``checkpoint`` (the same weights) whose config.json says ``config`` instead."""
    shutil.copytree(checkpoint, folder)
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text(encoding="utf-8")), **config}), encoding="utf-8")
    return folder


def library_for(checkpoint: Path, passing: Path, n_positions: int = N) -> Any:
    """The library's application for ``checkpoint``, planned for ``passing`` (a copy the plan takes)."""
    plan, _ = nxdi_plan(passing, 2, n_positions, extra="option.on_device_sampling=false\n")
    return on_cpu_application(dataclasses.replace(plan, model_path=str(checkpoint)))


def last_logits(app: Any, prompt: list[int], row: int = 0) -> torch.Tensor:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = app(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            position_ids=torch.arange(len(prompt))[None],
            seq_ids=torch.tensor([row]),
        )
    return out.logits[0, -1].float()


def next_logits(app: Any, token: int, position: int) -> torch.Tensor:
    """One token-generation step of row 0 at ``position`` (a full batch of two: row 1 rides at 1)."""
    with torch.inference_mode():
        out = app(
            input_ids=torch.tensor([[token], [token]]),
            attention_mask=(torch.arange(position)[None, :] < torch.tensor([[position], [1]])).long(),
            position_ids=torch.tensor([[position], [1]]),
            seq_ids=torch.tensor([0, 1]),
        )
    return out.logits[0, -1].float()


def transformers_logits(checkpoint: Path, prompt: list[int]) -> torch.Tensor:
    config = json.loads((checkpoint / "config.json").read_text(encoding="utf-8"))
    auto = transformers.AutoModelForCausalLM
    if config["model_type"] == "gemma3":
        auto = transformers.AutoModelForImageTextToText
    model = auto.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor([prompt])).logits[0, -1].float()


def engine_logits(checkpoint: Path, prompt: list[int], without_window: bool = False) -> torch.Tensor:
    ckpt = load_checkpoint(checkpoint, dtype=torch.float32)
    model = build_model(ckpt.config, ckpt.state_dict, n_positions=N)
    model = model.without_window() if without_window else model
    logits, _, _ = model.prefill(torch.tensor([prompt]), [len(prompt)])
    return logits[0].float()


def differ(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def test_qwen3_moe_renormalises_whatever_norm_topk_prob_says(tmp_path: Path) -> None:
    """norm_topk_prob=false (transformers' default): the library renormalises the top-k weights anyway."""
    checkpoint = make_tiny_checkpoint(tmp_path / "raw", arch="qwen3_moe", norm_topk_prob=False)
    normalised = variant(checkpoint, tmp_path / "normalised", norm_topk_prob=True)
    plan, _ = nxdi_plan(checkpoint, 2, N, extra="option.on_device_sampling=false\n")
    assert "renormalises the top-k expert weights" in plan.ignored["config.json norm_topk_prob"]
    got = last_logits(on_cpu_application(plan), PROMPT)
    assert differ(got, transformers_logits(checkpoint, PROMPT)) > 1e-2
    torch.testing.assert_close(got, engine_logits(normalised, PROMPT), rtol=0, atol=1e-4)
    assert differ(engine_logits(checkpoint, PROMPT), transformers_logits(checkpoint, PROMPT)) < 1e-4


def gemma3(tmp_path: Path, name: str, arch: str = "gemma3_text", **config: Any) -> Path:
    return make_tiny_checkpoint(tmp_path / name, arch=arch, **{**TINY[arch], "sliding_window": N, **config})


def test_gemma3_global_layers_rotate_as_local_ones(tmp_path: Path) -> None:
    """A released Gemma 3's global rotary (rope_theta 1e6, linear factor 8): the library hands the first
    (local) layer's cos/sin to the global layer, so it computes the model with the local rotary
    everywhere."""
    if not GEMMA3_SERVED:
        return
    released = {"rope_theta": 1e6, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    checkpoint = gemma3(tmp_path, "released", **released)
    local = variant(checkpoint, tmp_path / "local", rope_theta=10000.0, rope_scaling=None)
    plan, _ = nxdi_plan(checkpoint, 2, N, extra="option.on_device_sampling=false\n")
    assert "rotate with the local layers' rotary" in plan.ignored["config.json rope_theta/rope_scaling"]
    got = last_logits(on_cpu_application(plan), PROMPT)
    assert differ(got, transformers_logits(checkpoint, PROMPT)) > 1e-1
    torch.testing.assert_close(got, engine_logits(local, PROMPT), rtol=0, atol=1e-4)


def test_gemma3_past_its_window_is_refused(tmp_path: Path) -> None:
    """n_positions 32 over a window of 8: a 20-token prompt attends to all 20 positions (the CPU engine
    without a window) and leaves a cache the next token misreads (neither with a window nor without)."""
    if not GEMMA3_SERVED:
        return
    checkpoint = gemma3(tmp_path, "w8", sliding_window=8)
    with pytest.raises(ValueError, match=r"option\.n_positions=32 exceeds the model's sliding_window=8"):
        nxdi_plan(checkpoint, 2, N)
    app = library_for(checkpoint, variant(checkpoint, tmp_path / "w32", sliding_window=N))
    got = last_logits(app, PROMPT)
    assert differ(got, transformers_logits(checkpoint, PROMPT)) > 1e-1
    torch.testing.assert_close(got, engine_logits(checkpoint, PROMPT, without_window=True), rtol=0, atol=1e-4)
    step = next_logits(app, 7, len(PROMPT))
    longer = [*PROMPT, 7]
    assert differ(step, transformers_logits(checkpoint, longer)) > 1e-1
    assert differ(step, engine_logits(checkpoint, longer, without_window=True)) > 1e-1


def test_gemma3_cpu_mode_needs_a_bucket_as_long_as_the_window(tmp_path: Path) -> None:
    if not GEMMA3_SERVED:
        return
    checkpoint = gemma3(tmp_path, "w64", sliding_window=64)
    with pytest.raises(
        ValueError, match=r"on_cpu=true with option\.n_positions=32: .* set option\.n_positions"
    ):
        nxdi_plan(checkpoint, 2, N)
    app = library_for(checkpoint, variant(checkpoint, tmp_path / "w32", sliding_window=N))
    with pytest.raises(RuntimeError, match="index 32 is out of bounds"):  # get_last_kv_window's gather
        last_logits(app, PROMPT[:5])


def test_gemma3_has_one_vocabulary(tmp_path: Path) -> None:
    if not GEMMA3_SERVED:
        return
    checkpoint = gemma3(tmp_path, "smollm", vocab_size=49152)
    with pytest.raises(ValueError, match=r"vocab_size=49152: .* builds a 262208-token embedding"):
        nxdi_plan(checkpoint, 2, N)
    with pytest.raises(RuntimeError, match=r"expected shape torch\.Size\(\[262208, 64\]\)"):
        library_for(checkpoint, variant(checkpoint, tmp_path / "passing", vocab_size=262208))


def test_a_vision_language_gemma3_with_its_own_head_is_refused(tmp_path: Path) -> None:
    """Released vision-language Gemma 3 checkpoints tie their head (the tier's ``gemma3``); one that
    does not is served by the library with the embeddings as its head."""
    if not GEMMA3_SERVED:
        return
    checkpoint = gemma3(tmp_path, "untied", arch="gemma3", tie_word_embeddings=False)
    with pytest.raises(ValueError, match=r"text_config\.tie_word_embeddings=false"):
        nxdi_plan(checkpoint, 2, N)
    text = json.loads((checkpoint / "config.json").read_text(encoding="utf-8"))["text_config"]
    passing = variant(checkpoint, tmp_path / "tied", text_config={**text, "tie_word_embeddings": True})
    got = last_logits(library_for(checkpoint, passing), PROMPT)
    assert differ(got, transformers_logits(checkpoint, PROMPT)) > 1e-1


def test_gemma3_starts_at_0_9(tmp_path: Path) -> None:
    """0.8.0 lists no gemma3 in MODEL_TYPES (its models/gemma3 does not scale attention by
    query_pre_attn_scalar): the plan names the release that serves it."""
    checkpoint = gemma3(tmp_path, "gemma3")
    if GEMMA3_SERVED:
        assert nxdi_plan(checkpoint, 2, N)[0].application.application == "NeuronGemma3ForCausalLM"
        return
    with pytest.raises(UnsupportedReleaseError, match=r"has no gemma3_text application.*0\.9\+"):
        nxdi_plan(checkpoint, 2, N)
