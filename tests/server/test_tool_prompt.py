"""Tool requests planned and rendered against real chat templates (no server).

SmolLM2's template (the tiny checkpoints carry its tokenizer) has no tool support: tools need
``option.tool_call_parser`` and then go through the built-in prompt. A Qwen-style template that
reads ``tools`` renders them itself, with the history's arguments as JSON objects.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from neuron_lmi.server.errors import ApiError
from neuron_lmi.server.options import AppOptions
from neuron_lmi.server.schemas_openai import ChatRequest
from neuron_lmi.server.tools import plan_tools, render_chat, template_supports_tools

TOOLS_TEMPLATE = """{%- if tools %}<|im_start|>system
# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{%- for tc in message.tool_calls %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
HISTORY: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather in Oslo?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "rain, 7C"},
]


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_llama_dir))


@pytest.fixture(scope="module")
def tools_tokenizer(tokenizer: Any) -> Any:
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = TOOLS_TEMPLATE
    return tok


def request(**fields: Any) -> ChatRequest:
    return ChatRequest.model_validate_json(json.dumps({"messages": HISTORY[:1], **fields}), strict=True)


def prompt_text(tok: Any, req: ChatRequest, options: AppOptions) -> str:
    plan = plan_tools(options, tok, req)
    return tok.decode(render_chat(tok, "m", req, plan))


def refusal(tok: Any, req: ChatRequest, options: AppOptions) -> ApiError:
    with pytest.raises(ApiError) as info:
        render_chat(tok, "m", req, plan_tools(options, tok, req))
    assert info.value.status == 400
    return info.value


def test_template_support_is_read_from_the_template(tokenizer: Any, tools_tokenizer: Any) -> None:
    assert not template_supports_tools(tokenizer)  # SmolLM2's
    assert template_supports_tools(tools_tokenizer)


def test_tools_without_template_support_need_a_parser(tokenizer: Any) -> None:
    err = refusal(tokenizer, request(tools=[WEATHER]), AppOptions())
    assert err.field == "tools" and "option.tool_call_parser" in err.message
    history = ChatRequest.model_validate({"messages": HISTORY})
    assert refusal(tokenizer, history, AppOptions()).field == "messages.1"
    # tool_choice none hides the tools: nothing needs tool support
    plan = plan_tools(AppOptions(), tokenizer, request(tools=[WEATHER], tool_choice="none"))
    assert not plan.parse and plan.functions == ()


def test_builtin_prompt_renders_tools_calls_and_results(tokenizer: Any) -> None:
    req = ChatRequest.model_validate({"messages": HISTORY, "tools": [WEATHER]})
    text = prompt_text(tokenizer, req, AppOptions(tool_call_parser="hermes"))
    assert text.startswith("<|im_start|>system\n# Tools")  # replaces SmolLM2's default system line
    assert '"name": "get_weather"' in text and "<tools>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\nrain, 7C\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_template_with_tools_renders_them_itself(tools_tokenizer: Any) -> None:
    req = ChatRequest.model_validate({"messages": HISTORY, "tools": [WEATHER]})
    text = prompt_text(tools_tokenizer, req, AppOptions())
    assert json.dumps(WEATHER) in text
    assert '{"name": "get_weather", "arguments": {"city": "Oslo"}}' in text  # arguments as an object
    assert "<tool_response>\nrain, 7C\n</tool_response>" in text


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
        ),
        ({"tools": [WEATHER, WEATHER]}, "tools.1.function.name"),
    ],
)
def test_tool_fields_are_refused_by_name(tools_tokenizer: Any, fields: dict[str, Any], field: str) -> None:
    assert refusal(tools_tokenizer, request(**fields), AppOptions()).field == field


def test_auto_can_be_disabled(tools_tokenizer: Any) -> None:
    err = refusal(tools_tokenizer, request(tools=[WEATHER]), AppOptions(enable_auto_tool_choice=False))
    assert err.field == "tool_choice"
    plan = plan_tools(
        AppOptions(enable_auto_tool_choice=False),
        tools_tokenizer,
        request(tools=[WEATHER], tool_choice="required"),
    )
    assert plan.grammar is not None


def test_history_arguments_must_be_json_objects(tools_tokenizer: Any) -> None:
    messages = copy.deepcopy(HISTORY)
    messages[1]["tool_calls"][0]["function"]["arguments"] = "{city: Oslo}"
    req = ChatRequest.model_validate({"messages": messages, "tools": [WEATHER]})
    assert refusal(tools_tokenizer, req, AppOptions()).field == "messages.1.tool_calls.0.function.arguments"
    messages[1]["tool_calls"][0]["function"]["arguments"] = "[1]"
    req = ChatRequest.model_validate({"messages": messages, "tools": [WEATHER]})
    assert "JSON object" in refusal(tools_tokenizer, req, AppOptions()).message
