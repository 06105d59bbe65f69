"""The server suite's ``tests/server/test_lmi_tgi.py``, unchanged, on ``neuron-lmi serve --backend vllm``.

Its fixtures are rebound here: the server is the vLLM-backed one (one start per session), the model
directory is SmolLM2 as safetensors, and the greedy reference is transformers on the same weights.
"""

from __future__ import annotations

import pytest

from tests.gpu_fallback.conftest import vllm_skip_reason

_reason = vllm_skip_reason()
if _reason is not None:
    pytest.skip(_reason, allow_module_level=True)

from tests.server.test_lmi_tgi import *  # noqa: E402, F403
from tests.server.test_lmi_tgi import PROMPT  # noqa: E402


@pytest.fixture(scope="session")
def tiny_server(vllm_server):
    return vllm_server


@pytest.fixture(scope="session")
def tiny_llama_dir(smollm2_safetensors):
    return smollm2_safetensors


@pytest.fixture(scope="session")
def direct_engine(hf_reference):
    return hf_reference


def test_generate_list_inputs_and_full_text(http, direct_engine) -> None:
    """The suite's test, allowing a near-tie flip (the two prompts run as one vLLM batch)."""
    prompts = [PROMPT, "Hello world"]
    body = {"inputs": prompts, "parameters": {"max_new_tokens": 4, "return_full_text": True}}
    out = http.post("/generate", json=body)
    texts = [o["generated_text"] for o in out.json()]
    assert [t[: len(p)] for t, p in zip(texts, prompts, strict=True)] == prompts
    for prompt, text in zip(prompts, texts, strict=True):
        assert direct_engine.explains(prompt, text[len(prompt) :], 4), (prompt, text)
    assert all("details" not in o for o in out.json())
