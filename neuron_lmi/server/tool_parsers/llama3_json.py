"""Llama 3.x JSON tool calls: the whole output is one JSON object (or several joined by ``;``),
optionally after the ``<|python_tag|>`` special token::

    {"name": "get_weather", "parameters": {"city": "Paris"}}

An output that does not begin that way is content (tool calls never follow text in this format).
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
    call_from_json,
    lark_json,
    one_of_calls,
)

PYTHON_TAG = "<|python_tag|>"
ARG_KEYS = ("parameters", "arguments")

SYSTEM_PROMPT = (
    "Given the following functions, please respond with a JSON for a function call with its proper "
    "arguments that best answers the given prompt.\n\n"
    'Respond in the format {{"name": function name, "parameters": dictionary of argument name and its '
    "value}}. Do not use variables.\n\n{tools}"
)


def _decode_all(body: str) -> list[ToolCall]:
    """Successive JSON calls separated by ``;`` and whitespace, up to the first that is not one."""
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    i = 0
    while True:
        while i < len(body) and (body[i].isspace() or body[i] == ";"):
            i += 1
        if i >= len(body):
            return calls
        try:
            obj, i = decoder.raw_decode(body, i)
            calls.append(call_from_json(obj, ARG_KEYS))
        except ValueError:
            return calls


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    args_key = "parameters"
    markers = frozenset({PYTHON_TAG})

    def _body(self, text: str) -> str | None:
        stripped = text.lstrip()
        if stripped.startswith(PYTHON_TAG):
            return stripped[len(PYTHON_TAG) :]
        return stripped if stripped.startswith("{") else None

    def parse(self, text: str) -> Parsed:
        body = self._body(text)
        if body is None:
            return Parsed(text)
        calls = _decode_all(body)
        return Parsed(None, tuple(calls)) if calls else Parsed(text)

    def start(self, text: str) -> int | None:
        return 0 if self._body(text) is not None else None  # leading whitespace is no content

    def held(self, text: str) -> int:
        stripped = text.lstrip()
        return len(text) if not stripped or PYTHON_TAG.startswith(stripped) else 0

    def complete(self, region: str) -> list[ToolCall]:
        return _decode_all(self._body(region) or "")

    def grammar(self, functions: Sequence[FunctionSpec], parallel: bool) -> GrammarSpec:
        schema = one_of_calls(self, functions)
        if not parallel:
            return GrammarSpec.json_schema(schema)
        return GrammarSpec.ebnf(f'start: call ("; " call)*\ncall: {lark_json(schema)}\n')

    def system_prompt(self, tools: Sequence[FunctionSpec]) -> str:
        listed = "\n\n".join(json.dumps(t.as_tool()["function"], ensure_ascii=False) for t in tools)
        return SYSTEM_PROMPT.format(tools=listed)

    def render_calls(self, calls: Sequence[ToolCall]) -> str:
        return "; ".join(f'{{"name": {json.dumps(c.name)}, "parameters": {c.arguments}}}' for c in calls)
