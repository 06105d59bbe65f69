"""Tool-call parsers by vLLM's names (``option.tool_call_parser``), and which one a model uses.

hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>   Hermes, Qwen, built-in prompt
llama3_json  {"name": ..., "parameters": {...}}                          Llama 3.1/3.2/3.3
mistral      [TOOL_CALLS][{"name": ..., "arguments": {...}}]             Mistral, Mixtral
"""

from __future__ import annotations

from neuron_lmi.server.tool_parsers.base import FunctionSpec, Parsed, ToolCall, ToolParser
from neuron_lmi.server.tool_parsers.hermes import HermesParser
from neuron_lmi.server.tool_parsers.llama3_json import Llama3JsonParser
from neuron_lmi.server.tool_parsers.mistral import MistralParser

PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
}
# A chat template's text -> the format it teaches the model (first match wins).
TEMPLATE_SIGNS: tuple[tuple[str, str], ...] = (
    ("<tool_call>", "hermes"),
    ("[TOOL_CALLS]", "mistral"),
    ("<|python_tag|>", "llama3_json"),
    ("ipython", "llama3_json"),
)
DEFAULT_PARSER = "hermes"


def get_parser(name: str) -> ToolParser:
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(PARSERS)}") from None


def detect_parser(template: str) -> str:
    """The parser a chat template's own tool format needs (``hermes`` when it does not say)."""
    for sign, name in TEMPLATE_SIGNS:
        if sign in template:
            return name
    return DEFAULT_PARSER


__all__ = ["PARSERS", "FunctionSpec", "Parsed", "ToolCall", "ToolParser", "detect_parser", "get_parser"]
