"""Mistral tool calls after the ``[TOOL_CALLS]`` special token, in either of Mistral's layouts::

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]      (tokenizer v3/v7)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}                             (tokenizer v11+)

Text before the marker is content. Call ids are 9 letters and digits: Mistral's chat templates
refuse any other id in the history.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from neuron_lmi.engine.types import GrammarSpec
from neuron_lmi.server.tool_parsers.base import (
    FunctionSpec,
    Parsed,
    ToolCall,
    ToolParser,
    alnum_id,
    call_from_json,
    one_of_calls,
)

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"

SYSTEM_PROMPT = (
    "You can call functions. The available functions, with JSON Schema parameters:\n{tools}\n\n"
    "To call functions, answer with [TOOL_CALLS] followed by a JSON list: "
    '[TOOL_CALLS][{{"name": <function-name>, "arguments": <args-json-object>}}]'
)


def _calls(rest: str) -> list[ToolCall]:
    decoder = json.JSONDecoder()
    body = rest.lstrip()
    if body.startswith("["):
        items, end = decoder.raw_decode(body)
        if not isinstance(items, list) or not items or body[end:].strip():
            raise ValueError("expected a non-empty JSON list of calls")
        return [call_from_json(item, ("arguments", "parameters")) for item in items]
    calls = []
    for segment in rest.split(TOOL_CALLS):
        name, sep, args = segment.partition(ARGS)
        if not sep:
            raise ValueError("expected name[ARGS]{...}")
        obj, end = decoder.raw_decode(args.strip())
        if args.strip()[end:].strip():
            raise ValueError("text after the arguments")
        calls.append(call_from_json({"name": name.strip(), "arguments": obj}, ("arguments",)))
    return calls


class MistralParser(ToolParser):
    name = "mistral"
    markers = frozenset({TOOL_CALLS, ARGS})
    start_marker = TOOL_CALLS
    forced_prefix = TOOL_CALLS  # a special token: the grammar writes only the JSON list after it

    def parse(self, text: str) -> Parsed:
        start = text.find(TOOL_CALLS)
        if start < 0:
            return Parsed(text)
        try:
            calls = _calls(text[start + len(TOOL_CALLS) :])
        except ValueError:
            return Parsed(text)
        head = text[:start]
        return Parsed(head if head.strip() else None, tuple(calls))

    def new_id(self) -> str:
        return alnum_id(9)

    def grammar(self, functions: Sequence[FunctionSpec], parallel: bool) -> GrammarSpec:
        item = one_of_calls(self, functions)
        defs = item.pop("$defs", None)
        schema = {"type": "array", "items": item, "minItems": 1}
        if not parallel:
            schema["maxItems"] = 1
        if defs:
            schema["$defs"] = defs
        return GrammarSpec.json_schema(schema)

    def system_prompt(self, tools: Sequence[FunctionSpec]) -> str:
        listed = json.dumps([t.as_tool() for t in tools], ensure_ascii=False)
        return SYSTEM_PROMPT.format(tools=listed)

    def render_calls(self, calls: Sequence[ToolCall]) -> str:
        items = [{"name": c.name, "arguments": json.loads(c.arguments)} for c in calls]
        return TOOL_CALLS + json.dumps(items, ensure_ascii=False)
