"""What real clients send, on a real server: nulls, parameters LMI passes over, TGI's stop sequences,
TGI's ``model: "tgi"`` and vLLM's request fields (issue 26). The model is the tiny random Llama,
greedy, so a request's own output without the field under test is the reference."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from tests.server.clients import http  # noqa: F401 (fixtures)
from tests.server.conftest import ServerProcess

PROMPT = "Deep learning on Inferentia"
MESSAGES = [{"role": "user", "content": "Name a planet."}]
LMI_ROUTES = ["/invocations", "/generate", "/"]


def _lmi_tokens(out: Any) -> tuple[str, list[dict[str, Any]]]:
    one = out[0] if isinstance(out, list) else out
    return one["generated_text"], one["details"]["tokens"]


def _reference(http: httpx.Client, n: int = 16) -> tuple[str, list[dict[str, Any]]]:
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": n, "details": True}}
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return _lmi_tokens(r.json())


def _stop_after(tokens: list[dict[str, Any]]) -> tuple[str, int]:
    """A stop sequence made of two consecutive tokens' texts whose first match in the text ends at
    the second's end, and where that end is (in characters)."""
    texts = [t["text"] for t in tokens]
    for k in range(2, len(texts) - 1):
        stop = texts[k - 1] + texts[k]
        end = len("".join(texts[: k + 1]))
        if stop.strip() and "".join(texts).find(stop) == end - len(stop):
            return stop, end
    raise AssertionError(f"no usable stop sequence in {texts}")


def test_null_for_every_optional_field_on_every_route(http: httpx.Client) -> None:
    from neuron_lmi.server.schemas_lmi import LmiParameters
    from neuron_lmi.server.schemas_openai import ChatRequest, CompletionRequest

    def nulls(model: Any) -> dict[str, None]:
        return {name: None for name, field in model.model_fields.items() if not field.is_required()}

    chat = {**nulls(ChatRequest), "messages": MESSAGES, "max_tokens": 4}
    r = http.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
    completion = {**nulls(CompletionRequest), "prompt": PROMPT}
    r = http.post("/v1/completions", json=completion)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 16  # OpenAI's default max_tokens
    lmi = {"inputs": PROMPT, "stream": None, "parameters": {**nulls(LmiParameters), "max_new_tokens": 3}}
    for route in [*LMI_ROUTES, "/generate_stream"]:
        r = http.post(route, json=lmi)
        assert r.status_code == 200, (route, r.text)
    r = http.post("/v1/chat/completions", json={"messages": None})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_lmi_parameters_it_does_not_use_are_passed_over(
    tiny_server: ServerProcess, http: httpx.Client
) -> None:
    """LiteLLM's sagemaker/ provider puts its own sagemaker_base_url into parameters."""
    params = {"temperature": 0.01, "max_new_tokens": 3, "details": True, "sagemaker_base_url": "http://x"}
    r = http.post("/invocations", json={"inputs": PROMPT, "parameters": params})
    assert r.status_code == 200, r.text
    assert r.json()["details"]["generated_tokens"] == 3
    assert "passed over: sagemaker_base_url" in tiny_server.log.read_text()
    r = http.post("/invocations", json={"inputs": PROMPT, "parameters": {"max_new_tokens": "3"}})
    assert r.status_code == 400 and r.json()["field"] == "parameters.max_new_tokens"


@pytest.mark.parametrize("route", LMI_ROUTES)
def test_tgi_stop_keeps_the_sequence_and_tokens_add_up(http: httpx.Client, route: str) -> None:
    full, tokens = _reference(http)
    stop, end = _stop_after(tokens)
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 16, "details": True, "stop": [stop]}}
    r = http.post(route, json=body)
    assert r.status_code == 200, r.text
    text, got = _lmi_tokens(r.json())
    assert text == full[:end] and text.endswith(stop)
    assert "".join(t["text"] for t in got) == text
    details = (r.json()[0] if route == "/" else r.json())["details"]
    assert details["finish_reason"] == "stop_sequence"


def test_tgi_stop_streamed_tokens_add_up_to_the_text(http: httpx.Client) -> None:
    full, tokens = _reference(http)
    stop, end = _stop_after(tokens)
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 16, "stop": [stop]}}
    with http.stream("POST", "/generate_stream", json=body) as r:
        events = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]
    texts = [e["token"]["text"] for e in events]
    assert texts == [t["text"] for t in tokens[: len(texts)]]  # each token's own text, none rewritten
    assert "".join(texts) == events[-1]["generated_text"] == full[:end]
    body["stream"] = True
    with http.stream("POST", "/invocations", json=body) as r:
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert "".join(line["token"]["text"] for line in lines) == lines[-1]["generated_text"] == full[:end]


def test_openai_stop_is_cut_unless_vllm_include_stop_str_in_output(http: httpx.Client) -> None:
    full, tokens = _reference(http)
    stop, end = _stop_after(tokens)
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "stop": [stop]}
    assert http.post("/v1/completions", json=body).json()["choices"][0]["text"] == full[: end - len(stop)]
    body["include_stop_str_in_output"] = True
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    assert choice["text"] == full[:end] and choice["finish_reason"] == "stop"


def test_tgi_messages_api_takes_model_tgi(http: httpx.Client) -> None:
    body = {"model": "tgi", "messages": MESSAGES, "max_tokens": 3, "n": None, "logit_bias": None}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    r = http.post("/v1/chat/completions", json={**body, "model": "not-served"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_continuous_usage_stats_put_usage_on_every_chunk(http: httpx.Client) -> None:
    """guidellm's streamed requests; each choice counts its own tokens, as vLLM's do."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {"messages": MESSAGES, "max_tokens": 5, "n": 2, "stream": True, "stream_options": options}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    counts = {0: 0, 1: 0}
    prompt = chunks[-1]["usage"]["prompt_tokens"]  # one prompt, counted once (as vLLM does)
    for chunk in chunks[:-1]:
        usage, index = chunk["usage"], chunk["choices"][0]["index"]
        assert usage["completion_tokens"] >= counts[index] and usage["prompt_tokens"] == prompt
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        counts[index] = usage["completion_tokens"]
    assert counts == {0: 5, 1: 5} and chunks[-1]["usage"]["completion_tokens"] == 10
    body["stream_options"] = {"include_usage": False, "continuous_usage_stats": True}  # vLLM: needs both
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: {")]
    assert lines and all("usage" not in json.loads(line[6:]) for line in lines)


def test_skip_special_tokens_and_stop_token_ids(tiny_llama_dir, http: httpx.Client) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    special = tokenizer.convert_tokens_to_ids("<|im_start|>")
    forced = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "logit_bias": {str(special): 100}}
    assert http.post("/v1/completions", json=forced).json()["choices"][0]["text"] == ""
    shown = http.post("/v1/completions", json={**forced, "skip_special_tokens": False}).json()
    assert shown["choices"][0]["text"] == "<|im_start|>" * 2
    _, tokens = _reference(http, 8)
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stop_token_ids": [tokens[3]["id"]]}
    first = next(i for i, t in enumerate(tokens) if t["id"] == tokens[3]["id"])
    out = http.post("/v1/completions", json=body).json()
    assert out["choices"][0]["text"] == "".join(t["text"] for t in tokens[:first])
    assert out["choices"][0]["finish_reason"] == "stop" and out["usage"]["completion_tokens"] == first + 1


def test_truncate_prompt_tokens_and_structured_outputs(http: httpx.Client) -> None:
    body = {"prompt": PROMPT, "max_tokens": 2, "truncate_prompt_tokens": 3}
    assert http.post("/v1/completions", json=body).json()["usage"]["prompt_tokens"] == 3
    choices = ["yes", "no", "maybe"]
    body = {"messages": MESSAGES, "max_tokens": 8, "structured_outputs": {"choice": choices}}
    assert http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"] in choices


def test_schema_order_and_strict_on_response_format(http: httpx.Client) -> None:
    props = {name: {"enum": ["a", "b"]} for name in ("zeta", "alpha", "mid")}
    schema = {"type": "object", "properties": props, "required": list(props)}
    fmt = {"type": "json_schema", "json_schema": {"name": "o", "schema": schema, "strict": True}}
    body = {"messages": MESSAGES, "max_tokens": 160, "temperature": 0, "response_format": fmt}
    choice = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    assert list(json.loads(choice["message"]["content"])) == ["zeta", "alpha", "mid"]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"stop_token_ids": "7"}, "stop_token_ids"),
        ({"stream_options": {"continuous_usage_stats": 1}}, "stream_options.continuous_usage_stats"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"not_a_field_anywhere": None}, "not_a_field_anywhere"),
    ],
)
def test_bad_new_fields_are_400_naming_them_and_leak_nothing(
    tiny_server: ServerProcess, http: httpx.Client, fields: dict[str, Any], param: str
) -> None:
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, **fields})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert tiny_server.wait_rows_free() == 0
    assert http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1}).status_code == 200
