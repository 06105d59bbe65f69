"""What every tool-call format shares: the parsed call, the parser contract, and the constraint.

A parser reads one model family's tool-call text (vLLM's parser names: ``hermes``, ``llama3_json``,
``mistral``). It never raises on model output: text it cannot read as tool calls is content, as in
vLLM. The same parser also writes its format, for the built-in tool prompt (models whose chat
template has no tool support) and for the grammar that forces a call (``tool_choice`` "required"
or a named function).
"""

from __future__ import annotations

import json
import secrets
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from neuron_lmi.engine.grammar import with_json_options
from neuron_lmi.engine.types import GrammarSpec

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One parsed call: the function's name and its arguments as JSON text (OpenAI's shape)."""

    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class Parsed:
    """A model output split into content (None when there is none) and tool calls, in order."""

    content: str | None
    calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True, slots=True)
class FunctionSpec:
    """A callable function as the grammar and the built-in prompt need it."""

    name: str
    description: str | None
    parameters: Mapping[str, Any] | None

    def as_tool(self) -> dict[str, Any]:
        """OpenAI's tool object, which is what chat templates take as ``tools``."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = dict(self.parameters or EMPTY_PARAMETERS)
        return {"type": "function", "function": function}


def call_from_json(obj: Any, args_keys: Sequence[str]) -> ToolCall:
    """``{"name": ..., <args key>: {...}}`` as a call; ValueError when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        raise ValueError("a tool call is an object with a string name")
    args: Any = {}
    for key in args_keys:
        if key in obj:
            args = obj[key]
            break
    if isinstance(args, str):  # some models quote the arguments object
        args = json.loads(args) if args.strip() else {}
    if not isinstance(args, dict):
        raise ValueError("tool call arguments must be an object")
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def held_prefix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker`` (held back while streaming)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolParser:
    """One tool-call format. Subclasses set the class attributes and ``parse``.

    Invariants: ``parse`` never raises; its calls are those of the tool-call region up to the first
    that does not read as a call, and with none the whole text is content. ``complete`` on a prefix
    of the region returns a prefix of those calls, so a stream can release content before the
    region (``start``, ``held``) and each call once it is closed, and still agree with ``parse``.
    """

    name = ""
    args_key = "arguments"
    # Special tokens whose text the parser must see (the detokenizer skips special tokens).
    markers: frozenset[str] = frozenset()
    # What the constraint grammar leaves out and the parser needs in front (a special token).
    forced_prefix = ""

    def parse(self, text: str) -> Parsed:
        raise NotImplementedError

    # The text that opens the tool-call region wherever it appears (formats that have one).
    start_marker = ""

    def start(self, text: str) -> int | None:
        """Where the tool-call region begins in ``text`` (None: not seen yet)."""
        index = text.find(self.start_marker)
        return None if index < 0 else index

    def held(self, text: str) -> int:
        """How many characters at the end of ``text`` might still begin a tool call."""
        return held_prefix(text, self.start_marker)

    def complete(self, region: str) -> list[ToolCall]:
        """The calls already closed in a tool-call region (a stream releases them early)."""
        return []

    def new_id(self) -> str:
        return "call_" + secrets.token_hex(12)

    # -- writing the format --------------------------------------------------------------------

    def call_schema(self, fn: FunctionSpec) -> dict[str, Any]:
        return {
            "type": "object",
            "properties": {
                "name": {"const": fn.name},
                self.args_key: dict(fn.parameters or EMPTY_PARAMETERS),
            },
            "required": ["name", self.args_key],
            "additionalProperties": False,
        }

    def grammar(self, functions: Sequence[FunctionSpec], parallel: bool) -> GrammarSpec:
        """A constraint whose every output is one call (or, with ``parallel``, several) of one of
        ``functions``, with arguments valid against its schema."""
        raise NotImplementedError

    def system_prompt(self, tools: Sequence[FunctionSpec]) -> str:
        raise NotImplementedError

    def render_calls(self, calls: Sequence[ToolCall]) -> str:
        raise NotImplementedError

    def render_result(self, content: str, name: str | None) -> str:
        return content


def one_of_calls(parser: ToolParser, functions: Sequence[FunctionSpec]) -> dict[str, Any]:
    """A schema matching a call of any of ``functions``; their ``$defs`` are hoisted to the top
    (vLLM does the same) so ``#/$defs/...`` references still resolve."""
    defs: dict[str, Any] = {}
    schemas = []
    for fn in functions:
        params = dict(fn.parameters or EMPTY_PARAMETERS)
        for key, value in (params.pop("$defs", None) or {}).items():
            if key in defs and defs[key] != value:
                raise ValueError(f"tools define $defs/{key} twice, differently")
            defs[key] = value
        schemas.append(parser.call_schema(FunctionSpec(fn.name, fn.description, params)))
    schema: dict[str, Any] = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    if defs:
        schema = {**schema, "$defs": defs}
    return schema


def lark_json(schema: Mapping[str, Any]) -> str:
    """A schema as a llguidance Lark ``%json`` rule body, with response_format's JSON options
    (the grammar's whitespace between tokens)."""
    return "%json " + json.dumps(with_json_options(dict(schema)), separators=(",", ":"))


ALNUM = string.ascii_letters + string.digits


def alnum_id(length: int = 9) -> str:
    return "".join(secrets.choice(ALNUM) for _ in range(length))
