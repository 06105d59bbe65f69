"""Structured output side by side: the share of a fixed set of JSON-schema requests that end within
``max_tokens`` with JSON that validates (issue 26), against any OpenAI-compatible server.

Each case is a chat request with ``response_format`` ``json_schema`` (``strict: true``) or
``json_object``, greedy. A case passes when ``finish_reason`` is ``stop`` and the content parses
and validates against its schema. Run it against each server on the same model:

    .venv/bin/neuron-lmi serve --model smollm2 --port 8080 &
    .venv/bin/python bench/structured_output.py --url http://127.0.0.1:8080 --out ours.json

Prints one line per case and the share; ``--out`` writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import httpx
import jsonschema

SHORT = {"type": "string", "maxLength": 40}
CASES: list[tuple[str, str, dict[str, Any] | None]] = [
    (
        "person_required",
        "Describe a fictional person: name, age and city.",
        {
            "type": "object",
            "properties": {"name": SHORT, "age": {"type": "integer"}, "city": SHORT},
            "required": ["name", "age", "city"],
        },
    ),
    (
        "reasoning_first",
        "What is 7 + 5? Think first, then answer.",
        {
            "type": "object",
            "properties": {
                "reasoning": {"type": "string", "maxLength": 200},
                "answer": {"type": "integer"},
                "confidence": {"type": "number", "minimum": 0, "maximum": 1},
            },
            "required": ["reasoning", "answer", "confidence"],
        },
    ),
    (
        "nested",
        "Give a user profile with an address.",
        {
            "type": "object",
            "properties": {
                "user": {
                    "type": "object",
                    "properties": {"name": SHORT, "email": SHORT},
                    "required": ["name", "email"],
                },
                "address": {
                    "type": "object",
                    "properties": {"street": SHORT, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["street", "zip"],
                },
            },
            "required": ["user", "address"],
        },
    ),
    (
        "enum",
        "Is the sky blue? Answer with a sentiment and a color.",
        {
            "type": "object",
            "properties": {
                "sentiment": {"enum": ["positive", "neutral", "negative"]},
                "color": {"enum": ["red", "green", "blue"]},
            },
            "required": ["sentiment", "color"],
        },
    ),
    (
        "array_enum_min2",
        "List your favourite colors.",
        {
            "type": "object",
            "properties": {
                "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 2}
            },
            "required": ["colors"],
        },
    ),
    (
        "array_max_items",
        "Name some cities in California.",
        {
            "type": "object",
            "properties": {"cities": {"type": "array", "items": SHORT, "maxItems": 5}},
            "required": ["cities"],
        },
    ),
    (
        "array_unbounded",
        "Name some cities in California.",
        {
            "type": "object",
            "properties": {"cities": {"type": "array", "items": SHORT}},
            "required": ["cities"],
        },
    ),
    ("json_object", "Describe a cat as a JSON object.", None),
]


def run_case(client: httpx.Client, model: str | None, case: tuple[str, str, Any], max_tokens: int) -> dict:
    name, prompt, schema = case
    if schema is None:
        fmt: dict[str, Any] = {"type": "json_object"}
    else:
        fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "response_format": fmt,
    }
    if model:
        body["model"] = model
    r = client.post("/v1/chat/completions", json=body)
    r.raise_for_status()
    choice = r.json()["choices"][0]
    content = choice["message"]["content"] or ""
    valid = False
    if choice["finish_reason"] == "stop":
        try:
            value = json.loads(content)
            jsonschema.validate(value, schema or {"type": "object"})
            valid = True
        except (ValueError, jsonschema.ValidationError):
            valid = False
    return {"case": name, "finish_reason": choice["finish_reason"], "valid": valid, "content": content}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--model", default=None, help="the model name to send (default: none)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with httpx.Client(base_url=args.url, headers=headers, timeout=600) as client:
        results = [run_case(client, args.model, case, args.max_tokens) for case in CASES]
    for r in results:
        print(f"{r['case']:18} {r['finish_reason']:7} valid={r['valid']!s:5} {r['content'][:100]!r}")
    share = sum(r["valid"] for r in results) / len(results)
    passed = sum(r["valid"] for r in results)
    print(f"valid within max_tokens={args.max_tokens}: {share:.2f} ({passed}/{len(results)})")
    if args.out:
        record = {"url": args.url, "max_tokens": args.max_tokens, "share": share, "results": results}
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
