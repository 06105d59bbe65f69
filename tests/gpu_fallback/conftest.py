"""Fixtures for the real-vLLM tier: SmolLM2 as safetensors, one vLLM engine per session.

Everything here skips (with the reason) where ``import vllm`` fails, as in the main environment;
``scripts/setup_vllm_env.sh`` builds the environment where it runs.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest

from gpu_fallback.config import VllmEngineConfig, vllm_config_from_resolved
from neuron_lmi.config.loader import load_config

# vLLM's CPU engine computes on one core unless told to bind all of them; the KV cache is sized
# explicitly so that it fits beside the other test processes.
VLLM_CPU_ENV = {
    "VLLM_CPU_OMP_THREADS_BIND": os.environ.get(
        "VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}"
    ),
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
}


def vllm_skip_reason() -> str | None:
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # any failure (missing, broken CUDA wheels) means: this tier cannot run
        return f"vLLM does not import here ({type(exc).__name__}: {exc}); run scripts/setup_vllm_env.sh"
    return None


@pytest.fixture(scope="session")
def vllm_env() -> dict[str, str]:
    for key, value in VLLM_CPU_ENV.items():
        os.environ.setdefault(key, value)
    return dict(VLLM_CPU_ENV)


@pytest.fixture(scope="session")
def smollm2_safetensors(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct dequantized from the bundled GGUF (cached across sessions)."""
    from gpu_fallback.convert import default_cache_dir, ensure_safetensors_dir
    from neuron_lmi.models.builtin import smollm2_gguf_path

    return ensure_safetensors_dir(smollm2_gguf_path(), default_cache_dir())


class _IdsChatTemplate:
    """A tokenizer whose ``apply_chat_template(tokenize=True)`` returns ids, as transformers 4.x did.

    The server suite was written against 4.x; 5.x (vLLM's pin) returns a BatchEncoding there.
    """

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def __call__(self, *args, **kwargs):
        return self._tokenizer(*args, **kwargs)

    def apply_chat_template(self, *args, **kwargs):
        out = self._tokenizer.apply_chat_template(*args, **kwargs)
        return list(out["input_ids"]) if hasattr(out, "keys") and "input_ids" in out else out


class HFGreedyReference:
    """Greedy generation by transformers on the same weights, shaped like an engine for ``direct_greedy``.

    The server suite compares every route with ``direct_greedy(direct_engine, ...)``; on the vLLM
    tier that reference is transformers itself, independent of both our engine and vLLM.
    """

    def __init__(self, model_dir: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = _IdsChatTemplate(AutoTokenizer.from_pretrained(str(model_dir)))
        self._model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        self._torch = torch

    async def start(self) -> None:
        return None

    def admit(self, prompt, params, request_id=None):
        from neuron_lmi.engine.admission import ValidRequest

        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        return ValidRequest(request_id or "reference", ids, params)

    async def generate(self, request):
        from types import SimpleNamespace

        ids, params = request.prompt_ids, request.params
        with self._torch.no_grad():
            out = self._model.generate(
                self._torch.tensor([ids]),
                max_new_tokens=params.max_new_tokens,
                do_sample=False,
                eos_token_id=self.tokenizer.eos_token_id,
                pad_token_id=self.tokenizer.eos_token_id,
            )
        new = out[0, len(ids) :].tolist()
        text = self.tokenizer.decode(new, skip_special_tokens=True)
        for i, token in enumerate(new):
            yield SimpleNamespace(token_id=token, text=text if i == len(new) - 1 else "")

    def explains(self, prompt, text: str, max_new_tokens: int, tol: float = 0.05) -> bool:
        """Whether ``text`` is a greedy continuation of ``prompt`` up to near-ties.

        At each step any token within ``tol`` nats of the most likely one may be taken. vLLM's CPU
        kernels are not batch-invariant: under concurrent load a near-tie (SmolLM2 has ones of
        0.014 nats) can flip, which is the model's numerics and not a serving error.
        """
        torch = self._torch
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        new: list[int] = []
        for _ in range(max_new_tokens):
            if self.tokenizer.decode(new, skip_special_tokens=True) == text:
                return True
            with torch.no_grad():
                logprobs = self._model(torch.tensor([ids + new])).logits[0, -1].log_softmax(-1)
            best = float(logprobs.max())
            candidates = sorted(
                (logprobs >= best - tol).nonzero().flatten().tolist(), key=lambda t: -logprobs[t]
            )
            for token in candidates:
                if token == self.tokenizer.eos_token_id:
                    continue
                if text.startswith(self.tokenizer.decode([*new, token], skip_special_tokens=True)):
                    new.append(token)
                    break
            else:
                return False
        return self.tokenizer.decode(new, skip_special_tokens=True) == text


@pytest.fixture(scope="session")
def hf_reference(smollm2_safetensors: Path) -> HFGreedyReference:
    return HFGreedyReference(smollm2_safetensors)


def start_vllm_server(env: dict[str, str], model_dir: Path, tmp: Path, args: list[str]):
    """``neuron-lmi serve --backend vllm`` on ``model_dir`` in fp32 (like the transformers reference:
    vLLM's "auto" picks bf16 on CPUs with native bf16), with ``args`` added."""
    import sys

    import tests.server.conftest as server_conftest

    server_conftest.STARTUP_TIMEOUT_S = max(server_conftest.STARTUP_TIMEOUT_S, 900.0)  # vLLM compiles first
    return server_conftest.start_server(
        model_dir,
        tmp,
        ["--backend", "vllm", "--dtype", "fp32", *args],
        # vLLM's prefix caching is on by default (as in its server); a cached prefix changes CPU numerics
        # slightly, and this suite compares greedy ids with transformers token for token.
        env={**env, "OPTION_ENABLE_PREFIX_CACHING": "false"},
        command=[sys.executable, "-m", "neuron_lmi.cli"],
    )


def stop_vllm_server(server) -> None:
    code = server.stop()
    if code != 0:
        print(server.log.read_text()[-3000:])


@pytest.fixture(scope="session")
def vllm_server(vllm_env, smollm2_safetensors: Path, tmp_path_factory: pytest.TempPathFactory):
    """``neuron-lmi serve --backend vllm`` on SmolLM2, with the server suite's 8 rows and 256 positions."""
    args = ["--max-rolling-batch-size", "8", "--n-positions", "256"]
    server = start_vllm_server(vllm_env, smollm2_safetensors, tmp_path_factory.mktemp("vllm_server"), args)
    yield server
    stop_vllm_server(server)


def engine_config(model: str, /, **changes: Any) -> VllmEngineConfig:
    """The vLLM engine configuration ``serve`` resolves for ``model`` from no other source (LMI on
    vLLM's defaults), with ``changes``: ``VllmEngineConfig`` has no defaults of its own. No engine
    argument passes through, so vLLM's own field types are not read (the main environment has none)."""
    resolved = load_config({"model_id": model}, None, {})
    config = vllm_config_from_resolved(resolved, model, None, fields={})
    return dataclasses.replace(config, **changes)
