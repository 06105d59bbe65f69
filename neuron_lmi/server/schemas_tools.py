"""OpenAI's tool-calling request fields: ``tools``, ``tool_choice`` and the history's tool calls.

Strict like the rest of the OpenAI schemas: unknown fields are refused by name. A function name
follows OpenAI's rule (letters, digits, ``_`` and ``-``, at most 64), so it can be written into a
grammar and a prompt as it is.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from neuron_lmi.server.schema_types import RequestModel

FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"


class _Strict(RequestModel):
    pass


class FunctionDefinition(_Strict):
    name: str = Field(pattern=FUNCTION_NAME, description="The function's name (a-z, A-Z, 0-9, _ and -).")
    description: str | None = Field(default=None, description="What the function does, for the model.")
    parameters: dict[str, Any] | None = Field(
        default=None, description="The arguments as a JSON Schema object; absent means no arguments."
    )
    strict: bool | None = Field(
        default=None,
        description="true: objects that do not set additionalProperties get false (OpenAI's strict mode).",
    )
    defer_loading: bool | None = Field(default=None, description="No effect (vLLM's field).")


class ToolDefinition(_Strict):
    type: Literal["function"] = Field(description="Only function tools exist.")
    function: FunctionDefinition
    defer_loading: bool | None = Field(default=None, description="No effect (vLLM's field).")


class FunctionName(_Strict):
    name: str = Field(pattern=FUNCTION_NAME)


class NamedToolChoice(_Strict):
    """``{"type": "function", "function": {"name": ...}}``: the answer is a call of that function."""

    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolCallFunction(_Strict):
    name: str = Field(description="The function called.")
    arguments: str = Field(description="Its arguments, as JSON text (an object).")


class ToolCallIn(_Strict):
    """A call an assistant made earlier in the conversation."""

    id: str = Field(description="Referred to by the tool message that answers it (tool_call_id).")
    type: Literal["function"]
    function: ToolCallFunction
