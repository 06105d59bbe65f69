"""Tool calling through a real server and the official ``openai`` client.

``tool_server`` runs the tiny random Llama with ``option.tool_call_parser=hermes`` (SmolLM2's chat
template has no tool support, so the built-in Hermes prompt is used). The model's choices are
noise: every valid call below is the grammar's doing (named or required ``tool_choice``).
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

from tests.server.conftest import API_KEY, ServerProcess

PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather forecast", "parameters": PARAMETERS},
    },
    {"type": "function", "function": {"name": "get_time", "description": "The time now"}},
]
ASK = [{"role": "user", "content": "What will the weather be in Paris?"}]
NAMED: Any = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def client(tool_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tool_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def check_call(call: Any) -> dict[str, Any]:
    assert call.type == "function" and call.id
    args = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        jsonschema.validate(args, PARAMETERS)
    else:
        assert call.function.name == "get_time" and args == {}
    return args


def test_round_trip_with_a_named_tool(client: openai.OpenAI, model: str) -> None:
    first = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice=NAMED, max_tokens=80, temperature=0
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather"
    check_call(call)
    history = [
        *ASK,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 degrees."},
    ]
    second = client.chat.completions.create(
        model=model, messages=history, tools=TOOLS, max_tokens=12, temperature=0
    )
    answer = second.choices[0]
    assert answer.finish_reason in ("stop", "length", "tool_calls")
    assert answer.message.content or answer.message.tool_calls
    # The call and its result are in the second prompt.
    assert first.usage is not None and second.usage is not None
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


def test_streamed_tool_calls_reassemble_in_the_client(client: openai.OpenAI, model: str) -> None:
    kwargs: dict[str, Any] = {
        "model": model,
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_tokens": 80,
        "temperature": 0,
    }
    with client.chat.completions.stream(**kwargs) as stream:
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or []
    args = check_call(call)
    whole = client.chat.completions.create(**kwargs).choices[0]
    (same,) = whole.message.tool_calls or []
    assert same.function.name == call.function.name
    assert json.loads(same.function.arguments) == args


def test_stream_chunks_carry_the_call_by_index(client: openai.OpenAI, model: str) -> None:
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=ASK,
            tools=TOOLS,
            tool_choice=NAMED,
            max_tokens=80,
            temperature=0,
            stream=True,
        )
    )
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert deltas and all(d.index == 0 for d in deltas)
    assert deltas[0].id and deltas[0].type == "function" and deltas[0].function.name == "get_weather"
    jsonschema.validate(json.loads("".join(d.function.arguments or "" for d in deltas)), PARAMETERS)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_required_calls_validate_for_every_choice(client: openai.OpenAI, model: str) -> None:
    r = client.chat.completions.create(
        model=model,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=120,
        temperature=1.0,
        seed=5,
        n=3,
    )
    for choice in r.choices:
        if choice.finish_reason == "length" and not choice.message.tool_calls:
            continue  # cut off inside a call: no promise about the text
        assert choice.finish_reason == "tool_calls"
        for call in choice.message.tool_calls or []:
            check_call(call)


def test_auto_answers_with_content_when_the_model_does_not_call(client: openai.OpenAI, model: str) -> None:
    r = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=8, temperature=0)
    choice = r.choices[0]
    assert choice.message.tool_calls is None and choice.message.content
    assert choice.finish_reason in ("stop", "length")


def test_response_format_and_a_forced_call_do_not_mix(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=model,
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            response_format={"type": "json_object"},
            max_tokens=8,
        )
    assert info.value.body["param"] == "response_format"  # type: ignore[index]


def test_a_forced_call_cut_short_is_length_without_raw_call_text(client: openai.OpenAI, model: str) -> None:
    """As OpenAI answers: finish_reason "length", no tool_calls, no "<tool_call>" left in content."""
    kwargs: Any = {"model": model, "messages": ASK, "tools": TOOLS, "tool_choice": NAMED, "max_tokens": 4}
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.tool_calls is None and not choice.message.content
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == "" and chunks[-1].choices[0].finish_reason == "length"
    assert not any(c.choices[0].delta.tool_calls for c in chunks if c.choices)


def test_no_rows_leak(tool_server: ServerProcess) -> None:
    assert tool_server.wait_rows_free() == 0


def test_tools_need_template_support_or_a_parser(tiny_server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=4)
    body: Any = info.value.body
    assert body["param"] == "tools" and "tool_call_parser" in body["message"]
    # tool_choice none: the tools are not shown, nothing is refused
    r = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=4
    )
    assert r.choices[0].message.tool_calls is None
