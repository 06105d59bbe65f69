"""Qwen2, Qwen3, Qwen3-MoE and Gemma 3 served unchanged by ``neuron-lmi serve --backend vllm`` (#38).

Each family's tiny random checkpoint (``neuron_lmi.testing.checkpoints``, SmolLM2's tokenizer) is
served by vLLM's CPU build through our backend and HTTP server in fp32, one server per family in
turn, and the greedy token ids ``/generate`` returns equal transformers' own greedy ``generate`` on
the same weights in fp32. vLLM's CPU attention has no kernel for a head size of 16 ("Unsupported
CPU attention configuration: head_dim=16"), so every checkpoint here has 32. A family vLLM cannot
load here is skipped with vLLM's own error (``vllm_cannot_load``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.gpu_fallback.conftest import start_vllm_server, stop_vllm_server, vllm_skip_reason

_reason = vllm_skip_reason()
pytestmark = [pytest.mark.skipif(_reason is not None, reason=_reason or ""), pytest.mark.slow]

# name: (tiny family, make_tiny_checkpoint overrides, the architecture vLLM must resolve)
FAMILIES: dict[str, tuple[str, dict[str, Any], str]] = {
    # Two heads over a hidden size of 64: a head size of 32 (the tiny default's 16 has no CPU kernel).
    "qwen2": ("qwen2", {"num_attention_heads": 2, "num_key_value_heads": 1}, "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", {}, "Qwen3ForCausalLM"),
    "qwen3-moe": ("qwen3_moe", {}, "Qwen3MoeForCausalLM"),
    # Two sliding-window layers (window 8, shorter than every sequence below) and a global one.
    "gemma3-text": ("gemma3_text", {"head_dim": 32}, "Gemma3ForCausalLM"),
    "gemma3-vision-language": ("gemma3", {"head_dim": 32}, "Gemma3ForConditionalGeneration"),
}
# vLLM's CPU platform turns its one-process ("uni") executor into "mp" (a worker process beside the
# engine core) unless VLLM_ENABLE_V1_MULTIPROCESSING=0; with it the worker runs in the engine-core
# process, one start of vLLM fewer per family (about a minute on 2 cores). The model code is the
# same; the SmolLM2 tier keeps vLLM's default.
ONE_WORKER_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OPTION_DISTRIBUTED_EXECUTOR_BACKEND": "uni"}
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a small robot"]
MAX_NEW_TOKENS = 16


def vllm_cannot_load(architecture: str) -> str | None:
    """vLLM's own error when it cannot import its implementation of ``architecture`` here (its
    model registry makes the same call before it inspects a model); None when it can."""
    import vllm
    from vllm.model_executor.models import ModelRegistry

    registered = ModelRegistry.models[architecture]
    try:
        registered.load_model_cls()
    except Exception as exc:
        return (
            f"vLLM {vllm.__version__} cannot load {architecture} here ('Model architectures "
            f"['{architecture}'] failed to be inspected'): importing {registered.module_name} raised "
            f"{type(exc).__name__}: {exc}"
        )
    return None


def transformers_greedy(model_dir: Path, prompts: list[str]) -> dict[str, list[int]]:
    """transformers' greedy continuation of each prompt in fp32 (eager attention), up to EOS or
    MAX_NEW_TOKENS."""
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    config = transformers.AutoConfig.from_pretrained(str(model_dir))
    model_cls = getattr(transformers, config.architectures[0])
    model = model_cls.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager").eval()
    out: dict[str, list[int]] = {}
    for prompt in prompts:
        ids = tokenizer.encode(prompt)
        with torch.no_grad():
            tokens = model.generate(
                torch.tensor([ids]),
                max_new_tokens=MAX_NEW_TOKENS,
                do_sample=False,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.eos_token_id,
            )
        out[prompt] = tokens[0, len(ids) :].tolist()
    return out


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_over_http_equals_transformers(
    name: str, vllm_env, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from neuron_lmi.testing.checkpoints import make_tiny_checkpoint

    family, overrides, architecture = FAMILIES[name]
    reason = vllm_cannot_load(architecture)
    if reason is not None:
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp(f"vllm_{name}")
    model_dir = make_tiny_checkpoint(tmp / "model", family, seed=41, **overrides)
    expected = transformers_greedy(model_dir, PROMPTS)

    args = ["--max-rolling-batch-size", "4", "--n-positions", "256"]
    server = start_vllm_server({**vllm_env, **ONE_WORKER_PROCESS}, model_dir, tmp, args)
    try:
        with server.client(timeout=300) as http:
            for prompt in PROMPTS:
                body = {"inputs": prompt, "parameters": {"max_new_tokens": MAX_NEW_TOKENS, "details": True}}
                r = http.post("/generate", json=body)
                assert r.status_code == 200, r.text
                got = [token["id"] for token in r.json()["details"]["tokens"]]
                assert got == expected[prompt], (name, prompt)
        assert f"Resolved architecture: {architecture}" in server.log.read_text()  # vLLM's own model
    finally:
        stop_vllm_server(server)
