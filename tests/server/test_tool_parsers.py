"""Tool-call parsers fed outputs in each model family's format, whole and token by token.

The outputs are shaped as the families write them (Qwen 2.5 / Hermes 3, Llama 3.1, Mistral v3 and
v11 tokenizers); a stream must agree with the parse of the whole output however it is cut.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from neuron_lmi.engine.grammar import check_grammar
from neuron_lmi.engine.types import GrammarKind, TokenEvent
from neuron_lmi.server.tool_parsers import PARSERS, FunctionSpec, ToolCall, detect_parser, get_parser
from neuron_lmi.server.tool_parsers.base import Parsed
from neuron_lmi.server.tool_parsers.stream import ToolCallStream, parse_output

WEATHER = {"city": "Dallas", "state": "TX", "unit": "fahrenheit"}
W = json.dumps(WEATHER)
TIME = {"timezone": "America/Chicago"}

# parser -> (output, expected content, expected calls as (name, arguments dict))
RECORDED: dict[str, list[tuple[str, str | None, list[tuple[str, dict[str, Any]]]]]] = {
    "hermes": [
        (
            f'<tool_call>\n{{"name": "get_weather", "arguments": {W}}}\n</tool_call>',
            None,
            [("get_weather", WEATHER)],
        ),
        (
            f'Let me check.\n<tool_call>\n{{"name": "get_weather", "arguments": {W}}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "America/Chicago"}}\n</tool_call>',
            "Let me check.\n",
            [("get_weather", WEATHER), ("get_time", TIME)],
        ),
        # cut off before the closing tag: the call is still complete JSON
        (f'<tool_call>\n{{"name": "get_weather", "arguments": {W}}}', None, [("get_weather", WEATHER)]),
        ("The weather in Dallas is sunny.", "The weather in Dallas is sunny.", []),
        ('<tool_call>\n{"name": "get_weather", "argu', '<tool_call>\n{"name": "get_weather", "argu', []),
        ("Use <tool_call> tags? No.", "Use <tool_call> tags? No.", []),
    ],
    "llama3_json": [
        (f'{{"name": "get_weather", "parameters": {W}}}', None, [("get_weather", WEATHER)]),
        (f'<|python_tag|>{{"name": "get_weather", "parameters": {W}}}', None, [("get_weather", WEATHER)]),
        (
            f'{{"name": "get_weather", "parameters": {W}}}; '
            f'{{"name": "get_time", "parameters": {json.dumps(TIME)}}}',
            None,
            [("get_weather", WEATHER), ("get_time", TIME)],
        ),
        ('  {"name": "noargs", "arguments": {}}', None, [("noargs", {})]),
        ("It is sunny in Dallas {today}.", "It is sunny in Dallas {today}.", []),
        ('{"city": "Dallas"}', '{"city": "Dallas"}', []),
    ],
    "mistral": [
        (f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {W}}}]', None, [("get_weather", WEATHER)]),
        (
            f'Sure. [TOOL_CALLS] [{{"name": "get_weather", "arguments": {W}}}, '
            f'{{"name": "get_time", "arguments": {json.dumps(TIME)}}}]',
            "Sure. ",
            [("get_weather", WEATHER), ("get_time", TIME)],
        ),
        (
            f"[TOOL_CALLS]get_weather[ARGS]{W}[TOOL_CALLS]get_time[ARGS]{json.dumps(TIME)}",
            None,
            [
                ("get_weather", WEATHER),
                ("get_time", TIME),
            ],
        ),
        ("It is sunny.", "It is sunny.", []),
        (
            '[TOOL_CALLS][{"name": "get_weather", "arguments": {"ci',
            '[TOOL_CALLS][{"name": "get_weather", "arguments": {"ci',
            [],
        ),
    ],
}
CASES = [(name, *case) for name, cases in RECORDED.items() for case in cases]


def _calls(calls: tuple[ToolCall, ...] | list[ToolCall]) -> list[tuple[str, dict[str, Any]]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_parse_recorded_outputs(parser: str, text: str, content: str | None, calls: list[Any]) -> None:
    parsed = get_parser(parser).parse(text)
    assert parsed.content == content
    assert _calls(parsed.calls) == calls


@pytest.mark.parametrize("step", [1, 2, 5, 11])
@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_stream_agrees_with_parse(
    parser: str, text: str, content: str | None, calls: list[Any], step: int
) -> None:
    stream = ToolCallStream(get_parser(parser))
    streamed_text, streamed_calls = "", []
    for i in range(0, len(text), step):
        piece, new = stream.feed(text[i : i + step])
        streamed_text += piece
        streamed_calls += new
        assert not (new and content is None and streamed_text.strip())  # no content leaks before calls
    piece, new = stream.finish()
    streamed_text += piece
    streamed_calls += new
    assert _calls(streamed_calls) == calls
    assert streamed_text == (content or "") if calls else streamed_text == text


def test_stream_releases_a_closed_call_before_the_end() -> None:
    stream = ToolCallStream(get_parser("hermes"))
    _, calls = stream.feed('<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n{"na')
    assert _calls(calls) == [("a", {})]
    assert stream.feed('me": "b", "arguments": {"x": 1}}') == ("", [])
    assert stream.feed("\n</tool_call>") == ("", [ToolCall("b", '{"x": 1}')])
    assert stream.finish() == ("", [])


def test_forced_output_gets_the_parsers_prefix() -> None:
    mistral = get_parser("mistral")
    assert _calls(parse_output(mistral, '[{"name": "f", "arguments": {"a": 1}}]', forced=True).calls) == [
        ("f", {"a": 1})
    ]
    # Cut short inside a forced call: neither a call nor content (OpenAI: finish_reason "length").
    assert parse_output(mistral, '[{"name": "f", "argu', forced=True) == Parsed(None)
    stream = ToolCallStream(get_parser("hermes"), forced=True)
    assert stream.feed('<tool_call>\n{"name": "f", "argu') == ("", [])
    assert stream.finish() == ("", [])


def test_special_token_markers_reach_the_parser() -> None:
    """The detokenizer skips special tokens; a format's own markers are put back for the parser."""
    from neuron_lmi.server.tools import ToolChoiceStream, ToolPlan

    def event(i: int, text: str, token_text: str, special: bool, finish: Any = None) -> TokenEvent:
        return TokenEvent("r", i, i, token_text, text, 0.0, special, 3, finish_reason=finish)

    from neuron_lmi.engine.types import FinishReason

    stream = ToolChoiceStream(ToolPlan(get_parser("mistral"), parse=True))
    chunks = []
    chunks += stream.chunks(0, event(0, "", "[TOOL_CALLS]", True), None, None)
    chunks += stream.chunks(0, event(1, '[{"name": "f", ', '[{"', False), None, None)
    chunks += stream.chunks(
        0, event(2, '"arguments": {}}]', "}]", False, FinishReason.EOS_TOKEN), None, "stop"
    )
    deltas = [d for c in chunks for d in c["delta"].get("tool_calls", [])]
    assert deltas[0]["index"] == 0 and deltas[0]["function"] == {"name": "f", "arguments": ""}
    assert len(deltas[0]["id"]) == 9 and deltas[0]["id"].isalnum()  # Mistral's templates insist
    assert deltas[1] == {"index": 0, "function": {"arguments": "{}"}}
    assert chunks[-1]["finish_reason"] == "tool_calls"
    assert "".join(c["delta"].get("content") or "" for c in chunks) == ""


SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"enum": ["c", "f"]},
        "days": {"type": "array", "items": {"$ref": "#/$defs/day"}, "maxItems": 2},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
    "$defs": {"day": {"type": "integer", "minimum": 0, "maximum": 6}},
}
FUNCTIONS = (FunctionSpec("get_weather", "weather", SCHEMA), FunctionSpec("noargs", None, None))


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("parser", sorted(PARSERS))
def test_grammar_compiles_and_rendered_calls_parse(parser: str, parallel: bool) -> None:
    """The constraint compiles (with $defs hoisted), and the format the parser writes (the built-in
    prompt's history) reads back as the same calls."""
    p = get_parser(parser)
    spec = p.grammar(FUNCTIONS, parallel)
    check_grammar(spec)
    if spec.kind is GrammarKind.JSON_SCHEMA:
        schema = spec.schema()
        instance = (
            [{"name": "noargs", "arguments": {}}]
            if parser == "mistral"
            else {"name": "noargs", "parameters": {}}
        )
        jsonschema.validate(instance, schema)
    calls = [ToolCall("get_weather", json.dumps({"city": "Oslo", "unit": "c"})), ToolCall("noargs", "{}")]
    assert _calls(p.parse(p.render_calls(calls)).calls) == _calls(calls)
    assert "get_weather" in p.system_prompt(FUNCTIONS)


def test_detect_parser_from_template_text() -> None:
    assert detect_parser("{{ '<tool_call>' }}") == "hermes"
    assert detect_parser("{{ '[TOOL_CALLS]' + tool_calls|tojson }}") == "mistral"
    assert detect_parser("{%- if message.role == 'ipython' %}") == "llama3_json"
    assert detect_parser("{{ messages }}") == "hermes"
    with pytest.raises(ValueError, match="unknown tool call parser"):
        get_parser("pythonic")
