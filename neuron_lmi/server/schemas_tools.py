"""OpenAI's tool-calling request fields: ``tools``, ``tool_choice`` and the history's tool calls.

Strict like the rest of the OpenAI schemas: unknown fields are refused by name. A function name
follows OpenAI's rule (letters, digits, ``_`` and ``-``, at most 64), so it can be written into a
grammar and a prompt as it is.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FunctionDefinition(_Strict):
    name: str = Field(pattern=FUNCTION_NAME, description="The function's name (a-z, A-Z, 0-9, _ and -).")
    description: str | None = Field(default=None, description="What the function does, for the model.")
    parameters: dict[str, Any] | None = Field(
        default=None, description="The arguments as a JSON Schema object; absent means no arguments."
    )
    strict: bool | None = Field(
        default=None, description="Accepted for compatibility: forced calls always follow the schema."
    )


class ToolDefinition(_Strict):
    type: Literal["function"] = Field(description="Only function tools exist.")
    function: FunctionDefinition


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
