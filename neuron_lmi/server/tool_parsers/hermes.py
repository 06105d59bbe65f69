"""Hermes-style tool calls (Hermes 2/3, Qwen 2.5+, and the built-in tool prompt)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Several calls are several blocks. Text before the first block is content; the calls are the blocks
up to the first one that does not read as a call (none: the whole output is content).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence

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

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
_CLOSED = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

SYSTEM_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def _read(blocks: Iterable[tuple[str, str]]) -> list[ToolCall]:
    """The calls of (closed, unclosed) block bodies, up to the first that is not a call."""
    calls = []
    for closed, unclosed in blocks:
        try:
            calls.append(call_from_json(json.loads(closed or unclosed), ("arguments", "parameters")))
        except ValueError:  # json.JSONDecodeError is a ValueError
            break
    return calls


class HermesParser(ToolParser):
    name = "hermes"
    markers = frozenset({OPEN, CLOSE})
    start_marker = OPEN

    def parse(self, text: str) -> Parsed:
        start = text.find(OPEN)
        if start < 0:
            return Parsed(text)
        calls = _read(_BLOCK.findall(text, start))
        if not calls:
            return Parsed(text)
        head = text[:start]
        return Parsed(head if head.strip() else None, tuple(calls))

    def complete(self, region: str) -> list[ToolCall]:
        return _read((m.group(1), "") for m in _CLOSED.finditer(region))

    def grammar(self, functions: Sequence[FunctionSpec], parallel: bool) -> GrammarSpec:
        block = '"<tool_call>\\n" call "\\n</tool_call>"'
        start = f'{block} ("\\n" {block})*' if parallel else block
        return GrammarSpec.ebnf(f"start: {start}\ncall: {lark_json(one_of_calls(self, functions))}\n")

    def system_prompt(self, tools: Sequence[FunctionSpec]) -> str:
        listed = "\n".join(json.dumps(t.as_tool(), ensure_ascii=False) for t in tools)
        return SYSTEM_PROMPT.format(tools=listed)

    def render_calls(self, calls: Sequence[ToolCall]) -> str:
        return "\n".join(
            f'{OPEN}\n{{"name": {json.dumps(c.name)}, "arguments": {c.arguments}}}\n{CLOSE}' for c in calls
        )

    def render_result(self, content: str, name: str | None) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"
