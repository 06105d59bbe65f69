"""LMI/SageMaker routes over plain HTTP and TGI routes through Hugging Face's ``text_generation`` client."""

from __future__ import annotations

import json

import httpx
import pytest
from text_generation import Client

from tests.server.clients import http  # noqa: F401 (fixtures)
from tests.server.conftest import ServerProcess, direct_greedy

PROMPT = "Deep learning on Inferentia"
# text_generation 0.7 still calls pydantic's deprecated ``.dict()``; not our concern here.
pytestmark = pytest.mark.filterwarnings("ignore:The `dict` method is deprecated")


def test_ping_health_info(tiny_server: ServerProcess, http: httpx.Client) -> None:
    assert httpx.get(f"{tiny_server.url}/ping", timeout=5).status_code == 200  # no key needed
    assert httpx.get(f"{tiny_server.url}/health", timeout=5).json()["status"] == "healthy"
    info = http.get("/info").json()
    assert info["max_total_tokens"] == 256 and info["model_pipeline_tag"] == "text-generation"
    spec = http.get("/openapi.json").json()
    body = spec["paths"]["/invocations"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/LmiRequest"}


def test_invocations_details_match_engine(http: httpx.Client, direct_engine) -> None:
    expected, ids = direct_greedy(direct_engine, PROMPT, 6)
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 6, "details": True, "top_n_tokens": 2}}
    r = http.post("/invocations", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["generated_text"] == expected
    details = out["details"]
    assert set(details) == {"finish_reason", "generated_tokens", "inputs", "tokens", "top_tokens"}
    assert details["inputs"] == PROMPT and details["generated_tokens"] == len(ids)
    assert [t["id"] for t in details["tokens"]] == ids
    assert set(details["tokens"][0]) == {"id", "text", "log_prob", "special_token"}
    assert all(len(top) == 2 for top in details["top_tokens"])


def test_generate_list_inputs_and_full_text(http: httpx.Client, direct_engine) -> None:
    prompts = [PROMPT, "Hello world"]
    expected = [direct_greedy(direct_engine, p, 4)[0] for p in prompts]
    body = {"inputs": prompts, "parameters": {"max_new_tokens": 4, "return_full_text": True}}
    out = http.post("/generate", json=body).json()
    assert [o["generated_text"] for o in out] == [p + e for p, e in zip(prompts, expected, strict=True)]
    assert all("details" not in o for o in out)


def test_invocations_jsonlines_stream(http: httpx.Client, direct_engine) -> None:
    expected, ids = direct_greedy(direct_engine, PROMPT, 5)
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 5, "details": True}, "stream": True}
    with http.stream("POST", "/invocations", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("application/jsonlines")
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert [line["token"]["id"] for line in lines] == ids
    assert all("generated_text" not in line for line in lines[:-1])
    assert "".join(line["token"]["text"] for line in lines) == expected
    assert lines[-1]["generated_text"] == expected
    assert lines[-1]["details"]["generated_tokens"] == len(ids)


def test_tgi_client_generate_with_details(tiny_server: ServerProcess, direct_engine) -> None:
    expected, ids = direct_greedy(direct_engine, PROMPT, 6)
    client = Client(tiny_server.url, headers=dict(tiny_server.headers), timeout=60)
    r = client.generate(PROMPT, max_new_tokens=6, decoder_input_details=True, top_n_tokens=2)
    assert r.generated_text == expected
    assert r.details.generated_tokens == len(ids) and [t.id for t in r.details.tokens] == ids
    assert r.details.finish_reason.value in ("length", "eos_token")
    assert r.details.prefill and r.details.prefill[-1].text
    assert r.details.top_tokens is not None and len(r.details.top_tokens[0]) == 2


def test_tgi_client_generate_stream(tiny_server: ServerProcess, direct_engine) -> None:
    expected, ids = direct_greedy(direct_engine, PROMPT, 5)
    client = Client(tiny_server.url, headers=dict(tiny_server.headers), timeout=60)
    events = list(client.generate_stream(PROMPT, max_new_tokens=5))
    assert [e.token.id for e in events] == ids
    assert "".join(e.token.text for e in events if not e.token.special) == expected
    assert events[-1].generated_text == expected and events[-1].details.generated_tokens == len(ids)
    assert all(e.details is None for e in events[:-1])


def test_generate_stream_route_sse(http: httpx.Client) -> None:
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 3}}
    with http.stream("POST", "/generate_stream", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        data = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]
    assert len(data) == 3 and data[-1]["details"]["finish_reason"] == "length"


def test_sampling_is_reproducible_with_seed(http: httpx.Client) -> None:
    body = {
        "inputs": PROMPT,
        "parameters": {"max_new_tokens": 6, "do_sample": True, "temperature": 1.0, "seed": 11},
    }
    first = http.post("/generate", json=body).json()["generated_text"]
    assert http.post("/generate", json=body).json()["generated_text"] == first


def test_lmi_decoder_input_details_lists_prompt_tokens(http: httpx.Client, direct_engine) -> None:
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 2, "decoder_input_details": True}}
    details = http.post("/generate", json=body).json()["details"]
    prefill = details["prefill"]
    assert [t["id"] for t in prefill] == list(direct_engine.tokenizer(PROMPT)["input_ids"])
    assert all(set(t) == {"id", "text", "log_prob"} for t in prefill)
    assert prefill[0]["log_prob"] is None  # nothing precedes the first token
    assert all(isinstance(t["log_prob"], float) and t["log_prob"] <= 0 for t in prefill[1:])
