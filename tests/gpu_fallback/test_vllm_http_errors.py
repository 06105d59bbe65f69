"""The server suite's ``tests/server/test_errors.py``, unchanged, on ``neuron-lmi serve --backend vllm``.

Its fixtures are rebound here: the server is the vLLM-backed one (one start per session), the model
directory is SmolLM2 as safetensors, and the greedy reference is transformers on the same weights.
"""

from __future__ import annotations

import pytest

from tests.gpu_fallback.conftest import vllm_skip_reason

_reason = vllm_skip_reason()
if _reason is not None:
    pytest.skip(_reason, allow_module_level=True)

from tests.server.test_errors import *  # noqa: E402, F403


@pytest.fixture(scope="session")
def tiny_server(vllm_server):
    return vllm_server


@pytest.fixture(scope="session")
def tiny_llama_dir(smollm2_safetensors):
    return smollm2_safetensors


@pytest.fixture(scope="session")
def direct_engine(hf_reference):
    return hf_reference


@pytest.mark.parametrize(
    ("route", "body", "status", "field"),
    [
        ("/invocations", {"inputs": "x", "parameters": {"do_sample": True, "temperature": 3.0}}, 400, None),
        ("/", {"inputs": "x", "parameters": {"do_sample": True, "temperature": 3.0}}, 422, None),
        ("/v1/completions", {"prompt": "x", "temperature": 3.0}, 400, "temperature"),
    ],
)
def test_vllm_refusals_are_4xx_naming_the_field(vllm_server, route, body, status, field) -> None:
    """vLLM refuses temperature > 2 (LMI/TGI allow more on the CPU engine): the client gets its
    route's 4xx naming the field, not a 500."""
    with vllm_server.client() as http:
        r = http.post(route, json=body)
        assert r.status_code == status, r.text
        if route.startswith("/v1/"):
            assert r.json()["error"]["param"] == field
        else:
            assert r.json()["field"] == "parameters.temperature" and r.json()["error_type"] == "validation"
    assert vllm_server.wait_rows_free() == 0


def test_vllm_prometheus_series_beside_ours(vllm_server) -> None:
    with vllm_server.client() as http:
        assert (
            http.post(
                "/invocations", json={"inputs": "hello", "parameters": {"max_new_tokens": 2}}
            ).status_code
            == 200
        )
        text = http.get("/metrics").text
    assert "neuron_lmi_requests_total" in text
    assert "vllm:num_requests_running" in text and "vllm:prompt_tokens_total" in text
