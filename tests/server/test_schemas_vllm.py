"""vLLM's request fields, OpenAI's strict mode and ``null`` as unset, below HTTP: the pydantic models
and their translation to engine parameters. tests/server/test_client_requests.py sends the same
fields to a real server."""

from __future__ import annotations

import json
from typing import Any

import pytest

from neuron_lmi.engine.types import GrammarKind, StopText
from neuron_lmi.server.errors import ApiError, parse_body
from neuron_lmi.server.schemas_grammar import strict_schema, structured_outputs_grammar
from neuron_lmi.server.schemas_lmi import LmiRequest
from neuron_lmi.server.schemas_lmi import to_sampling as lmi_sampling
from neuron_lmi.server.schemas_openai import ChatRequest, CompletionRequest, to_sampling
from neuron_lmi.server.schemas_vllm import StructuredOutputs, truncated

MESSAGES = [{"role": "user", "content": "hi"}]
# vLLM 0.32's ChatCompletionRequest fields beyond OpenAI's (vllm/entrypoints/openai/chat_completion/
# protocol.py), each at a value a vLLM client may send.
VLLM_CHAT_FIELDS: dict[str, Any] = {
    "use_beam_search": False,
    "top_k": 5,
    "min_p": 0.05,
    "repetition_penalty": 1.1,
    "watermarking": False,
    "length_penalty": 1.0,
    "stop_token_ids": [7],
    "include_stop_str_in_output": True,
    "ignore_eos": False,
    "min_tokens": 1,
    "skip_special_tokens": False,
    "spaces_between_special_tokens": True,
    "truncate_prompt_tokens": 64,
    "truncation_side": "left",
    "prompt_logprobs": None,
    "logprob_token_ids": None,
    "allowed_token_ids": None,
    "bad_words": [],
    "echo": False,
    "add_generation_prompt": True,
    "continue_final_message": False,
    "add_special_tokens": False,
    "documents": [{"title": "t", "text": "x"}],
    "chat_template": None,
    "chat_template_kwargs": {"enable_thinking": False},
    "media_io_kwargs": {},
    "mm_processor_kwargs": {},
    "structured_outputs": None,
    "priority": 0,
    "request_id": "abc",
    "session_id": "s",
    "return_tokens_as_token_ids": False,
    "return_token_ids": False,
    "routed_experts_prompt_start": 0,
    "return_token_offsets": False,
    "return_prompt_text": False,
    "mm_payload": "tensors",
    "return_mm_kwargs": False,
    "cache_salt": "salt",
    "kv_transfer_params": {"a": 1},
    "ec_transfer_params": None,
    "vllm_xargs": {"x": [1, "y"]},
    "repetition_detection": {"max_pattern_size": 0},
    "stream_interval": 1,
    "reasoning_effort": "low",
    "thinking_token_budget": None,
    "include_reasoning": True,
    "stream_options": {"include_usage": True, "continuous_usage_stats": True},
}


def _chat(**fields: Any) -> ChatRequest:
    return parse_body(json.dumps({"messages": MESSAGES, **fields}).encode(), ChatRequest, "openai")


def test_every_vllm_chat_field_is_accepted_and_the_meaningful_ones_reach_the_engine() -> None:
    req = _chat(**VLLM_CHAT_FIELDS, stream=True)
    params = to_sampling(req, 16, 0)
    assert params.top_k == 5 and params.min_p == 0.05 and params.repetition_penalty == 1.1
    assert params.stop_token_ids == (7,) and params.stop_text is StopText.INCLUDE
    assert params.skip_special_tokens is False and params.min_tokens == 1
    kwargs = req.template_kwargs()
    assert kwargs["enable_thinking"] is False and kwargs["documents"] == [{"title": "t", "text": "x"}]
    assert kwargs["add_generation_prompt"] is True and kwargs["continue_final_message"] is False


def test_completion_takes_vllm_fields_too() -> None:
    body = {"prompt": "x", "stop_token_ids": [3], "skip_special_tokens": False, "priority": 5}
    req = parse_body(json.dumps(body).encode(), CompletionRequest, "openai")
    assert to_sampling(req, 4, 0).stop_token_ids == (3,)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"use_beam_search": True}, "use_beam_search"),
        ({"allowed_token_ids": [1, 2]}, "allowed_token_ids"),
        ({"bad_words": ["no"]}, "bad_words"),
        ({"logprob_token_ids": [1]}, "logprob_token_ids"),
        ({"chat_template": "{{ messages }}"}, "chat_template"),
        ({"watermarking": True}, "watermarking"),
    ],
)
def test_what_this_engine_cannot_do_is_refused_by_name(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as info:
        to_sampling(_chat(**fields), 16, 0)
    assert info.value.status == 400 and info.value.field == param


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"stop_token_ids": "7"}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids.0"),
        ({"stream_options": {"continuous_usage_stats": "yes"}}, "stream_options.continuous_usage_stats"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
        ({"structured_outputs": {"choice": "a"}}, "structured_outputs.choice"),
        ({"priority": "high"}, "priority"),
        ({"not_a_vllm_field": 1}, "not_a_vllm_field"),
        ({"not_a_vllm_field": None}, "not_a_vllm_field"),
        ({"messages": None}, "messages"),
    ],
)
def test_wrong_types_and_unknown_fields_are_refused_by_name(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as info:
        parse_body(json.dumps({"messages": MESSAGES, **fields}).encode(), ChatRequest, "openai")
    assert info.value.status == 400 and info.value.field == param


def test_null_means_unset_for_every_optional_field() -> None:
    nulls = {name: None for name, f in ChatRequest.model_fields.items() if not f.is_required()}
    req = _chat(**nulls)
    assert req.n == 1 and req.stream is False and req.add_generation_prompt is True
    lmi = {name: None for name in LmiRequest.model_fields if name != "inputs"}
    params = {name: None for name in LmiRequest.model_fields["parameters"].annotation.model_fields}
    body = {**lmi, "inputs": "x", "parameters": params}
    parsed = parse_body(json.dumps(body).encode(), LmiRequest, "lmi")
    assert parsed.parameters.details is False and parsed.stream is False


def test_lmi_parameters_it_does_not_use_are_passed_over_and_known_ones_still_checked() -> None:
    body = {"inputs": "x", "parameters": {"max_new_tokens": 4, "sagemaker_base_url": "http://x"}}
    req = parse_body(json.dumps(body).encode(), LmiRequest, "invocations")
    assert req.parameters.model_extra == {"sagemaker_base_url": "http://x"}
    params = lmi_sampling(req.parameters, "invocations")
    assert params.max_new_tokens == 4 and params.stop_text is StopText.TOKEN
    with pytest.raises(ApiError) as info:
        parse_body(b'{"inputs": "x", "parameters": {"max_new_tokens": "4"}}', LmiRequest, "invocations")
    assert info.value.field == "parameters.max_new_tokens"


def test_strict_schema_closes_every_object_that_does_not_say_otherwise() -> None:
    schema = {
        "type": "object",
        "properties": {
            "user": {"type": "object", "properties": {"id": {"type": "integer"}}},
            "tags": {"type": "array", "items": {"type": "object", "properties": {"k": {}}}},
            "open": {"type": "object", "properties": {}, "additionalProperties": True},
        },
        "$defs": {"D": {"anyOf": [{"type": "object", "properties": {"x": {}}}, {"type": "null"}]}},
    }
    out = strict_schema(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["user"]["additionalProperties"] is False
    assert out["properties"]["tags"]["items"]["additionalProperties"] is False
    assert out["properties"]["open"]["additionalProperties"] is True
    assert out["$defs"]["D"]["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the client's schema is left as it was
    assert list(out["properties"]) == ["user", "tags", "open"]


def test_structured_outputs_kinds() -> None:
    choice = structured_outputs_grammar(StructuredOutputs(choice=["yes", 'say "no"']))
    assert choice is not None and choice.kind is GrammarKind.EBNF and '"say \\"no\\""' in choice.value
    regex = structured_outputs_grammar(StructuredOutputs(regex="[ab]+"))
    assert regex is not None and regex.kind is GrammarKind.REGEX
    so = StructuredOutputs.model_validate(
        {"json": {"type": "object", "properties": {"a": {}}}, "disable_any_whitespace": True,
         "disable_additional_properties": True}
    )  # fmt: skip
    spec = structured_outputs_grammar(so)
    assert spec is not None and spec.schema()["x-guidance"] == {"whitespace_flexible": False}
    assert spec.schema()["additionalProperties"] is False
    for bad in ({}, {"regex": "a", "choice": ["a"]}, {"structural_tag": "{}"}, {"json": "[1"}):
        with pytest.raises(ApiError) as info:
            structured_outputs_grammar(StructuredOutputs.model_validate(bad))
        assert info.value.field is not None and info.value.field.startswith("structured_outputs")


def test_truncate_prompt_tokens() -> None:
    ids = list(range(10))
    assert truncated(ids, None, None, 256) == ids
    assert truncated(ids, 3, None, 256) == [7, 8, 9]
    assert truncated(ids, 3, "right", 256) == [0, 1, 2]
    assert truncated(ids, -1, None, 4) == [6, 7, 8, 9]
    with pytest.raises(ApiError):
        truncated(ids, 0, None, 256)
