"""Structured-output request fields and their translation to the engine's ``GrammarSpec``.

    OpenAI  response_format {"type": "json_object"}                       -> GrammarSpec.json_object()
            response_format {"type": "json_schema", "json_schema": {...}}  -> GrammarSpec.json_schema(schema)
    vLLM    structured_outputs {"json" | "regex" | "grammar" | "choice" | "json_object": ...}
    TGI     parameters.grammar {"type": "json", "value": schema}           -> GrammarSpec.json_schema(schema)
            parameters.grammar {"type": "regex", "value": pattern}         -> GrammarSpec.regex(pattern)

``strict: true`` is OpenAI's strict mode: an object schema that does not say otherwise gets
``additionalProperties: false`` (``strict_schema``), so the output holds only the listed properties.

Every spec is compiled once here (cached) so a schema the grammar engine cannot compile is refused
before anything is queued, naming the field it came from.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Literal

from pydantic import ConfigDict, Field

from neuron_lmi.engine.types import GrammarSpec
from neuron_lmi.server.errors import Family, invalid
from neuron_lmi.server.schema_types import RequestModel

if TYPE_CHECKING:
    from neuron_lmi.server.schemas_vllm import StructuredOutputs

# Keywords whose value is one subschema, a list of them, or a map of names to them.
_ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else", "additionalProperties")
_LIST = ("prefixItems", "anyOf", "oneOf", "allOf")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


class _Strict(RequestModel):
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
        default=None,
        description="true: objects that do not set additionalProperties get false (OpenAI's strict mode).",
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
    if fmt.json_schema.strict:
        schema = strict_schema(schema)
    return GrammarSpec.json_schema(schema).named("response_format.json_schema.schema")


def strict_schema(schema: Any) -> Any:
    """A copy of ``schema`` where every object schema that lists properties and does not say
    otherwise has ``additionalProperties: false``, in every subschema (vLLM's guidance backend does
    the same with ``disable_additional_properties``; its xgrammar backend by default)."""
    if isinstance(schema, list):
        return [strict_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = strict_schema(out[key])
    for key in _LIST:
        if isinstance(out.get(key), list):
            out[key] = strict_schema(out[key])
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {name: strict_schema(sub) for name, sub in out[key].items()}
    lists = any(isinstance(out.get(key), dict) for key in ("properties", "patternProperties"))
    if lists and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def structured_outputs_grammar(so: StructuredOutputs | None) -> GrammarSpec | None:
    """The grammar of vLLM's ``structured_outputs`` (exactly one constraint, with its options)."""
    if so is None:
        return None
    field = "structured_outputs"
    kinds = {
        "json": so.json_ is not None,
        "regex": so.regex is not None,
        "choice": so.choice is not None,
        "grammar": so.grammar is not None,
        "json_object": bool(so.json_object),
        "structural_tag": so.structural_tag is not None,
    }
    chosen = [name for name, given in kinds.items() if given]
    if len(chosen) != 1:
        message = f"{field} takes exactly one of {', '.join(kinds)}, got {len(chosen)}"
        raise invalid("openai", message, field)
    kind, where = chosen[0], f"{field}.{chosen[0]}"
    if kind == "structural_tag":
        raise invalid("openai", f"{where} is not supported by this server", where)
    if kind == "regex":
        return GrammarSpec.regex(so.regex or "").named(where)
    if kind == "grammar":
        return GrammarSpec.ebnf(so.grammar or "").named(where)
    if kind == "choice":
        if not so.choice:
            raise invalid("openai", f"{where} must list at least one string", where)
        lark = "start: " + " | ".join(json.dumps(c) for c in so.choice)
        return GrammarSpec.ebnf(lark).named(where)
    schema: Any = {"type": "object"} if kind == "json_object" else so.json_
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise invalid("openai", f"{where}: not a JSON schema: {exc}", where) from None
    if not isinstance(schema, dict):
        raise invalid("openai", f"{where}: a JSON schema must be an object", where)
    if so.disable_additional_properties:
        schema = strict_schema(schema)
    options: dict[str, Any] = {}
    if so.disable_any_whitespace:
        options["whitespace_flexible"] = False
    if so.whitespace_pattern is not None:
        options["whitespace_pattern"] = so.whitespace_pattern
    if options:  # llguidance reads its JSON options from the schema's x-guidance
        schema = {**schema, "x-guidance": {**schema.get("x-guidance", {}), **options}}
    return GrammarSpec.json_schema(schema).named(where)


def tgi_grammar(grammar: TgiGrammar | None, family: Family) -> GrammarSpec | None:
    """The grammar of TGI's ``parameters.grammar`` (None when absent)."""
    if grammar is None:
        return None
    field = "parameters.grammar.value"
    if grammar.type == "regex":
        if not isinstance(grammar.value, str):
            raise invalid(family, f"{field}: a regex grammar takes a string", field)
        return GrammarSpec.regex(grammar.value).named(field)
    value = grammar.value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise invalid(family, f"{field}: not a JSON schema: {exc}", field) from None
    if not isinstance(value, dict):
        raise invalid(family, f"{field}: a JSON schema must be an object", field)
    return GrammarSpec.json_schema(value).named(field)


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
