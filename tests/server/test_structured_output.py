"""Structured output on a real server: OpenAI ``response_format`` and TGI ``parameters.grammar``.

The model is the tiny random Llama: its choices are noise, so every valid output below is the
grammar's doing. Schemas bound their strings and arrays so outputs close well within
``max_tokens``; an output that still runs out must say ``finish_reason == "length"``.
"""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from text_generation import Client
from text_generation.types import Grammar, GrammarType

from tests.server.clients import client, http, model  # noqa: F401 (fixtures)
from tests.server.conftest import ServerProcess

SHORT = {"type": "string", "maxLength": 8}
SCHEMAS: dict[str, dict[str, Any]] = {
    "flat_required": {
        "type": "object",
        "properties": {"name": SHORT, "age": {"type": "integer", "minimum": 0, "maximum": 150}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "enum_and_bool": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
        "required": ["color", "ok"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99}, "tag": SHORT},
                "required": ["id", "tag"],
                "additionalProperties": False,
            },
            "level": {"enum": ["low", "high"]},
        },
        "required": ["user", "level"],
        "additionalProperties": False,
    },
    "array": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 9},
                "minItems": 1,
                "maxItems": 3,
            },
            "kind": {"const": "list"},
        },
        "required": ["items", "kind"],
        "additionalProperties": False,
    },
}


def assert_valid(text: str, finish_reason: str, schema: dict[str, Any]) -> None:
    if finish_reason == "length":
        return  # cut off by max_tokens: no promise about the text
    assert finish_reason == "stop", text
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_chat_json_schema_output_validates(client: openai.OpenAI, model: str, name: str) -> None:
    schema = SCHEMAS[name]
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Describe a person as JSON."}],
        response_format=fmt,  # type: ignore[arg-type]
        max_tokens=120,
        temperature=1.0,
        seed=3,
        n=2,
    )
    for choice in r.choices:
        assert_valid(choice.message.content or "", choice.finish_reason, schema)
    assert any(c.finish_reason == "stop" for c in r.choices)


def test_chat_json_schema_streams_valid_json(client: openai.OpenAI, model: str) -> None:
    schema = SCHEMAS["nested"]
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "JSON please"}],
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
        max_tokens=120,
        temperature=0,
        stream=True,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert_valid(text, chunks[-1].choices[0].finish_reason, schema)


def test_chat_json_object_is_a_json_object(client: openai.OpenAI, model: str) -> None:
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Any JSON object"}],
        response_format={"type": "json_object"},
        max_tokens=150,
        temperature=0,
    )
    choice = r.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content or ""), dict)
    else:
        assert choice.finish_reason == "length"


def test_completions_accept_response_format(http: httpx.Client) -> None:
    schema = SCHEMAS["enum_and_bool"]
    body = {
        "prompt": "Answer:",
        "max_tokens": 40,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
    }
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["text"]), schema)


def test_tgi_json_grammar_on_generate(http: httpx.Client) -> None:
    schema = SCHEMAS["flat_required"]
    body = {
        "inputs": "JSON:",
        "parameters": {"max_new_tokens": 80, "grammar": {"type": "json", "value": schema}, "details": True},
    }
    out = http.post("/generate", json=body).json()
    assert_valid(
        out["generated_text"], "stop" if out["details"]["finish_reason"] == "eos_token" else "length", schema
    )
    assert out["details"]["finish_reason"] == "eos_token"


def test_tgi_regex_grammar_on_generate_stream_and_client(
    tiny_server: ServerProcess, http: httpx.Client
) -> None:
    pattern = r"(yes|no), [0-9]{3}"
    body = {
        "inputs": "Q:",
        "parameters": {"max_new_tokens": 20, "grammar": {"type": "regex", "value": pattern}},
    }
    with http.stream("POST", "/generate_stream", json=body) as r:
        data = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]
    assert (
        re.fullmatch(pattern, data[-1]["generated_text"])
        and data[-1]["details"]["finish_reason"] == "eos_token"
    )
    tgi = Client(tiny_server.url, headers=dict(tiny_server.headers), timeout=60)
    grammar = Grammar(type=GrammarType.Regex, value=pattern)
    out = tgi.generate("Q:", max_new_tokens=20, grammar=grammar, do_sample=True, seed=4)
    assert re.fullmatch(pattern, out.generated_text)


def test_invocations_json_grammar_as_text_schema(http: httpx.Client) -> None:
    schema = SCHEMAS["array"]
    body = {
        "inputs": "List:",
        "parameters": {"max_new_tokens": 60, "grammar": {"type": "json", "value": json.dumps(schema)}},
    }
    out = http.post("/invocations", json=body).json()
    jsonschema.validate(json.loads(out["generated_text"]), schema)


@pytest.mark.parametrize(
    ("route", "body", "status", "field"),
    [
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "x"}],
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                },
            },
            400,
            "response_format.json_schema.schema",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
            400,
            "response_format.type",
        ),
        (
            "/v1/completions",
            {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
            400,
            "response_format.json_schema.name",
        ),
        (
            "/generate",
            {"inputs": "x", "parameters": {"grammar": {"type": "regex", "value": "[a-"}}},
            400,
            "parameters.grammar.value",
        ),
        (
            "/",
            {"inputs": "x", "parameters": {"grammar": {"type": "json", "value": "{not json"}}},
            422,
            "parameters.grammar.value",
        ),
        (
            "/generate",
            {"inputs": "x", "parameters": {"grammar": {"type": "cfg", "value": "x"}}},
            400,
            "parameters.grammar.type",
        ),
    ],
)
def test_bad_grammars_are_refused_naming_the_field(
    http: httpx.Client, route: str, body: dict[str, Any], status: int, field: str
) -> None:
    r = http.post(route, json=body)
    assert r.status_code == status, r.text
    got = r.json()["error"]["param"] if route.startswith("/v1/") else r.json()["field"]
    assert got == field, r.text
