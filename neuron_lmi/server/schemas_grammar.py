"""Structured-output request fields and their translation to the engine's ``GrammarSpec``.

    OpenAI  response_format {"type": "json_object"}                       -> GrammarSpec.json_object()
            response_format {"type": "json_schema", "json_schema": {...}}  -> GrammarSpec.json_schema(schema)
    TGI     parameters.grammar {"type": "json", "value": schema}           -> GrammarSpec.json_schema(schema)
            parameters.grammar {"type": "regex", "value": pattern}         -> GrammarSpec.regex(pattern)

Every spec is compiled once here (cached) so a schema the grammar engine cannot compile is refused
before anything is queued, naming the field it came from.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from neuron_lmi.engine.grammar import check_grammar
from neuron_lmi.engine.types import GrammarSpec, InvalidRequestError
from neuron_lmi.server.errors import Family, invalid


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class JsonSchemaFormat(_Strict):
    name: str = Field(description="A name for the schema (letters, digits, '_' and '-').")
    description: str | None = Field(default=None, description="What the response is for.")
    schema_: dict[str, Any] | None = Field(
        default=None,
        alias="schema",
        description="The JSON Schema the output must validate against; absent means any JSON object.",
    )
    strict: bool | None = Field(
        default=None, description="Accepted for compatibility: the output always follows the schema."
    )


class ResponseFormat(_Strict):
    """OpenAI's ``response_format``: ``text``, ``json_object``, or ``json_schema`` with ``json_schema``.

    One model rather than a tagged union, so a validation error names the field plainly
    (``response_format.json_schema.name``)."""

    type: Literal["text", "json_object", "json_schema"] = Field(
        description="text: no constraint; json_object: any JSON object; json_schema: JSON that "
        "validates against json_schema.schema."
    )
    json_schema: JsonSchemaFormat | None = Field(default=None, description="Required for json_schema.")


class TgiGrammar(_Strict):
    """TGI's ``parameters.grammar``: ``{"type": "json", "value": <JSON Schema>}`` (``json_object``
    is an alias) or ``{"type": "regex", "value": "<pattern>"}``."""

    type: Literal["json", "json_object", "regex"] = Field(description="What `value` holds.")
    value: dict[str, Any] | str = Field(
        description="A JSON Schema (object, or its JSON text) for json; a regular expression for regex."
    )


def _checked(spec: GrammarSpec, family: Family, field: str) -> GrammarSpec:
    try:
        check_grammar(spec)
    except InvalidRequestError as exc:
        raise invalid(family, f"{field}: {exc}", field) from None
    return spec


def response_format_grammar(fmt: ResponseFormat | None) -> GrammarSpec | None:
    """The grammar an OpenAI ``response_format`` asks for (None for text)."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return GrammarSpec.json_object()
    if fmt.json_schema is None:
        message = "response_format.json_schema is required with type json_schema"
        raise invalid("openai", message, "response_format.json_schema")
    schema = fmt.json_schema.schema_
    if schema is None:
        return GrammarSpec.json_object()
    return _checked(GrammarSpec.json_schema(schema), "openai", "response_format.json_schema.schema")


def tgi_grammar(grammar: TgiGrammar | None, family: Family) -> GrammarSpec | None:
    """The grammar of TGI's ``parameters.grammar`` (None when absent)."""
    if grammar is None:
        return None
    field = "parameters.grammar.value"
    if grammar.type == "regex":
        if not isinstance(grammar.value, str):
            raise invalid(family, f"{field}: a regex grammar takes a string", field)
        return _checked(GrammarSpec.regex(grammar.value), family, field)
    value = grammar.value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise invalid(family, f"{field}: not a JSON schema: {exc}", field) from None
    if not isinstance(value, dict):
        raise invalid(family, f"{field}: a JSON schema must be an object", field)
    return _checked(GrammarSpec.json_schema(value), family, field)


def parse_logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``{"<token id>": bias}`` as (id, bias) pairs, sorted by id."""
    pairs = []
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise invalid("openai", f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
        pairs.append((token, float(value)))
    return tuple(sorted(pairs))
