"""Structured output and the sampling fields on ``neuron-lmi serve --backend vllm``: the server
suite's ``test_structured_output.py`` unchanged, plus a few of ``test_sampling_fields_http.py``
(the ones that need no fp32 CPU server), passed through to vLLM's own structured outputs."""

from __future__ import annotations

import pytest

from tests.gpu_fallback.conftest import vllm_skip_reason

_reason = vllm_skip_reason()
if _reason is not None:
    pytest.skip(_reason, allow_module_level=True)

from tests.server.test_sampling_fields_http import (  # noqa: E402, F401
    test_bad_sampling_values_are_refused_by_name,
    test_best_of_returns_the_n_most_likely_candidates,
    test_logit_bias_forces_and_forbids_tokens,
)
from tests.server.test_structured_output import *  # noqa: E402, F403


@pytest.fixture(scope="session")
def tiny_server(vllm_server):
    return vllm_server


@pytest.fixture(scope="session")
def tiny_llama_dir(smollm2_safetensors):
    return smollm2_safetensors
