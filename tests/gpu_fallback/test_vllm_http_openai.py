"""The server suite's ``tests/server/test_openai.py``, unchanged, on ``neuron-lmi serve --backend vllm``.

Its fixtures are rebound here: the server is the vLLM-backed one (one start per session), the model
directory is SmolLM2 as safetensors, and the greedy reference is transformers on the same weights.
"""

from __future__ import annotations

import pytest

from tests.gpu_fallback.conftest import vllm_skip_reason

_reason = vllm_skip_reason()
if _reason is not None:
    pytest.skip(_reason, allow_module_level=True)

from tests.server.test_openai import *  # noqa: E402, F403


@pytest.fixture(scope="session")
def tiny_server(vllm_server):
    return vllm_server


@pytest.fixture(scope="session")
def tiny_llama_dir(smollm2_safetensors):
    return smollm2_safetensors


@pytest.fixture(scope="session")
def direct_engine(hf_reference):
    return hf_reference
