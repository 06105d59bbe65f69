"""The compiled graphs' code (``graphs.StepGraph``, ``ExtendGraph``) run eagerly, uncompiled, on the
families that reach it beyond Llama/Mistral: Qwen2's q/k/v biases and Qwen3's q/k norms come
through ``DecoderLayer.qkv``, so the graphs compute what the eager model does (a real compile of
Qwen3: test_compiled_graphs.py). Families the graphs cannot hold are refused with the reason."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from neuron_lmi.backends.cpu import compiled_decode, graphs
from neuron_lmi.testing.checkpoints import make_tiny_checkpoint
from tests.backends.cpu.conftest import load_tiny

N_ROWS, N_POSITIONS = 3, 128


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_step_and_extend_graphs_compute_the_eager_model(
    family: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(graphs.ATTENTION_ENV, "inductor")  # pure torch: no native op needed
    model = load_tiny(make_tiny_checkpoint(tmp_path / family, family, seed=4))
    assert compiled_decode.decode_unsupported(model, N_ROWS, N_POSITIONS) is None
    prompt = torch.randint(3, 40000, (1, 12), generator=torch.Generator().manual_seed(1))
    eager, graphed = model.make_cache(N_ROWS, N_POSITIONS), model.make_cache(N_ROWS, N_POSITIONS)
    # A prompt as one chunk of the step graph, against the eager prefill.
    logits, keys, values = model.prefill(prompt, [12])
    eager.k[:, 1, :, :12], eager.v[:, 1, :, :12] = keys[:, 0], values[:, 0]
    step = graphs.StepGraph(model)
    rows, positions = torch.full((12,), 1), torch.arange(12)
    with torch.inference_mode():
        got = step(prompt[0], rows, positions, torch.tensor([11]), torch.arange(13), graphed.k, graphed.v)
    torch.testing.assert_close(got, logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(graphed.k, eager.k, rtol=1e-5, atol=1e-5)
    # One decode token.
    token = logits.argmax(-1)
    want = model.decode(token, torch.tensor([1]), torch.tensor([12]), eager.k, eager.v, 13)
    with torch.inference_mode():
        got = step(
            token,
            torch.tensor([1]),
            torch.tensor([12]),
            torch.tensor([0]),
            torch.arange(14),
            graphed.k,
            graphed.v,
        )
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # A chunk appended by the extend graph, against the eager extend.
    chunk = torch.randint(3, 40000, (1, 5), generator=torch.Generator().manual_seed(2))
    starts, lengths = torch.tensor([13]), torch.tensor([5])
    want = model.extend(chunk, torch.tensor([1]), starts, [5], eager.k, eager.v, 18)
    with torch.inference_mode():
        got = graphs.ExtendGraph(model)(
            chunk, torch.tensor([1]), starts, lengths, torch.arange(18), graphed.k, graphed.v
        )
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(graphed.v[:, 1, :, :18], eager.v[:, 1, :, :18], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("family", "overrides", "reason"),
    [
        ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}, "per-layer"),
        ("qwen3_moe", {}, "MoE"),
        ("gemma3_text", {}, "Gemma"),
    ],
)
def test_families_the_graphs_cannot_hold_stay_eager(
    family: str, overrides: dict[str, object], reason: str, tmp_path: Path
) -> None:
    model = load_tiny(make_tiny_checkpoint(tmp_path / family, family, **overrides))
    assert reason in (compiled_decode.decode_unsupported(model, N_ROWS, N_POSITIONS) or "")
    with pytest.raises(ValueError, match=reason):
        graphs.StepGraph(model)


@pytest.mark.slow
def test_compiled_qwen3_equals_eager_token_for_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real compile of the step (and extend) package for Qwen3: q/k norms and a head_dim of its
    own frozen into the graph; requests join and leave mid-batch, as in test_compiled_graphs.py."""
    from neuron_lmi.backends.cpu.llm import LLM
    from neuron_lmi.engine.types import SamplingParams

    monkeypatch.setenv("NEURON_LMI_CACHE_DIR", str(tmp_path / "cache"))
    path = make_tiny_checkpoint(tmp_path / "qwen3", "qwen3", seed=4)
    options = {"dtype": "fp32", "max_rolling_batch_size": 4, "n_positions": N_POSITIONS}
    eager, compiled = LLM(str(path), enforce_eager=True, **options), LLM(str(path), **options)
    package = compiled.core.runner.compiled_decode
    assert package is not None and eager.core.runner.compiled_decode is None
    ids = list(range(300, 400))
    prompts = [ids[:3], ids[:40], ids[5:6], ids[10:30], ids[:64]]
    params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in (12, 5, 28, 9, 20)]
    want = [c.token_ids for c in eager.generate(prompts, params)]
    assert [c.token_ids for c in compiled.generate(prompts, params)] == want
    assert package.steps > 10  # decode steps ran in the package, not eagerly


def test_compile_keys_tell_the_families_apart() -> None:
    """A Qwen3 graph must not answer for a Llama of the same shapes; a Llama's description keeps
    the fields it had before the families (its stored packages still match)."""
    from neuron_lmi.backends.cpu.aot import architecture_description
    from neuron_lmi.models import LlamaForCausalLM, model_args_from_config

    dims = {
        "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 4,
    }  # fmt: skip
    llama = LlamaForCausalLM(model_args_from_config({**dims, "model_type": "llama"}), 8)
    qwen3 = LlamaForCausalLM(model_args_from_config({**dims, "model_type": "qwen3"}), 8)
    assert "qk_norm" not in architecture_description(llama)
    assert architecture_description(qwen3)["qk_norm"] is True
