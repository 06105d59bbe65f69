"""Bad input is refused with 4xx in the route's own error format, naming the field, and changes nothing."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.server.conftest import ServerProcess

OK_LMI = {"inputs": "hello", "parameters": {"max_new_tokens": 2}}
OK_CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _raw(obj: Any) -> bytes:
    return json.dumps(obj).encode()


# (route, body bytes, expected status, expected field)
CASES: list[tuple[str, bytes, int, str]] = [
    ("/invocations", b"{not json", 400, "body"),
    ("/invocations", b"", 400, "body"),
    ("/invocations", b'{"inputs": "caf\xe9"}', 400, "body"),
    ("/invocations", _raw({"inputs": ""}), 400, "inputs"),
    ("/invocations", _raw({"inputs": []}), 400, "inputs"),
    ("/invocations", _raw({"inputs": 42}), 400, "inputs"),
    ("/invocations", _raw({"inputs": "x", "bogus": 1}), 400, "bogus"),
    (
        "/invocations",
        _raw({"inputs": "x", "parameters": {"max_new_tokens": 0}}),
        400,
        "parameters.max_new_tokens",
    ),
    (
        "/invocations",
        _raw({"inputs": "x", "parameters": {"max_new_tokens": 10**6}}),
        400,
        "parameters.max_new_tokens",
    ),
    (
        "/invocations",
        _raw({"inputs": "x", "parameters": {"max_new_tokens": "5"}}),
        400,
        "parameters.max_new_tokens",
    ),
    (
        "/invocations",
        _raw({"inputs": "x", "parameters": {"temperature": -0.5}}),
        400,
        "parameters.temperature",
    ),
    ("/invocations", _raw({"inputs": "x", "parameters": {"top_p": 0}}), 400, "parameters.top_p"),
    ("/invocations", _raw({"inputs": "x", "parameters": {"top_p": 1.01}}), 400, "parameters.top_p"),
    ("/invocations", _raw({"inputs": ["a", "b"], "stream": True}), 400, "inputs"),
    ("/invocations", _raw({"inputs": "x " * 300, "parameters": {"max_new_tokens": 10}}), 400, "inputs"),
    ("/generate", _raw({"inputs": "x", "parameters": {"watermark": True}}), 400, "parameters.watermark"),
    ("/generate_stream", _raw({"inputs": "x", "parameters": {"top_p": 2}}), 422, "parameters.top_p"),
    ("/", _raw({"inputs": ""}), 422, "inputs"),
    ("/v1/completions", b"{", 400, "body"),
    ("/v1/completions", _raw({"prompt": ""}), 400, "prompt"),
    ("/v1/completions", _raw({"prompt": "x", "max_tokens": 0}), 400, "max_tokens"),
    ("/v1/completions", _raw({"prompt": "x", "temperature": -1}), 400, "temperature"),
    # OpenAI's range (and vLLM's limit), on every backend.
    ("/v1/completions", _raw({"prompt": "x", "temperature": 2.5}), 400, "temperature"),
    ("/v1/chat/completions", _raw({**OK_CHAT, "temperature": 3}), 400, "temperature"),
    ("/v1/completions", _raw({"prompt": "x", "top_p": 0}), 400, "top_p"),
    ("/v1/completions", _raw({"prompt": "x", "n": 0}), 400, "n"),
    ("/v1/completions", _raw({"prompt": "x", "logprobs": 50}), 400, "logprobs"),
    ("/v1/completions", _raw({"prompt": "x", "unknown_field": True}), 400, "unknown_field"),
    ("/v1/chat/completions", _raw({"messages": []}), 400, "messages"),
    ("/v1/chat/completions", _raw({"messages": [{"role": "robot", "content": "x"}]}), 400, "messages.0.role"),
    ("/v1/chat/completions", _raw({**OK_CHAT, "max_completion_tokens": -3}), 400, "max_completion_tokens"),
    ("/v1/chat/completions", _raw({**OK_CHAT, "top_logprobs": 2}), 400, "top_logprobs"),
    ("/v1/chat/completions", _raw({**OK_CHAT, "max_tokens": 10**6}), 400, "max_tokens"),
    ("/v1/chat/completions", _raw({**OK_CHAT, "tools": [{"type": "function"}]}), 400, "tools.0.function"),
]


def _field_of(route: str, body: dict[str, Any]) -> str | None:
    if route.startswith("/v1/"):
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
        return body["error"]["param"]
    assert isinstance(body["error"], str) and body["error_type"] == "validation"
    if route == "/invocations":
        assert body["generated_text"] is None and body["code"] == 400
    return body.get("field")


@pytest.mark.parametrize(("route", "raw", "status", "field"), CASES, ids=[f"{c[0]}:{c[3]}" for c in CASES])
def test_bad_input_is_refused_by_name(
    tiny_server: ServerProcess, route: str, raw: bytes, status: int, field: str
) -> None:
    with tiny_server.client() as http:
        r = http.post(route, content=raw, headers={"Content-Type": "application/json"})
        assert r.status_code == status, r.text
        assert _field_of(route, r.json()) == field, r.text
        ok = http.post("/invocations", json=OK_LMI)
        assert ok.status_code == 200 and ok.json()["generated_text"] is not None
    assert tiny_server.wait_rows_free() == 0


def test_auth_is_required_except_ping_and_health(tiny_server: ServerProcess) -> None:
    url = tiny_server.url
    assert httpx.post(f"{url}/invocations", json=OK_LMI).status_code == 401
    wrong = httpx.post(f"{url}/generate", json=OK_LMI, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error_type"] == "authentication"
    assert httpx.get(f"{url}/metrics").status_code == 401
    assert httpx.get(f"{url}/ping").status_code == 200
    assert httpx.get(f"{url}/health").status_code == 200


def test_oversized_body_is_413_before_parsing(tiny_server: ServerProcess) -> None:
    big = b'{"inputs": "' + b"a" * (7 * 1024 * 1024) + b'"}'
    with tiny_server.client() as http:
        r = http.post("/invocations", content=big)
        assert r.status_code == 413 and r.json()["code"] == 413

        def chunks():
            for _ in range(8):
                yield b"a" * (1024 * 1024)

        r = http.post("/v1/completions", content=chunks())  # chunked: no Content-Length
        assert r.status_code == 413 and r.json()["error"]["param"] == "body"


def test_metrics_exposes_required_series(tiny_server: ServerProcess) -> None:
    with tiny_server.client() as http:
        http.post("/invocations", json=OK_LMI)
        text = http.get("/metrics").text
    for name in (
        "neuron_lmi_requests_total",
        "neuron_lmi_queue_length",
        "neuron_lmi_kv_rows_used",
        "neuron_lmi_kv_rows_total",
        "neuron_lmi_time_to_first_token_seconds_bucket",
        "neuron_lmi_inter_token_latency_seconds_bucket",
        "neuron_lmi_e2e_request_latency_seconds_bucket",
        "neuron_lmi_prompt_tokens_total",
        "neuron_lmi_generation_tokens_total",
    ):
        assert name in text, name
    assert tiny_server.metric("neuron_lmi_kv_rows_total") == 8
    assert 'neuron_lmi_requests_total{route="/invocations",status="200"}' in text
