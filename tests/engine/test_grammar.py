"""JSON grammars as vLLM configures llguidance: the schema's property order, whitespace allowed.

Each case feeds a text's tokens to a fresh grammar state and reads whether the grammar took them
all and is complete, which is what decides what a constrained model can write.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from neuron_lmi.engine.grammar import MAX_INDENT, GrammarCompiler
from neuron_lmi.engine.types import GrammarSpec

ORDERED: dict[str, Any] = {
    "type": "object",
    "properties": {
        "reasoning": {"type": "string"},
        "answer": {"type": "integer"},
        "confidence": {"type": "number"},
    },
    "required": ["reasoning", "answer", "confidence"],
}
VALUE = {"reasoning": "two and two", "answer": 4, "confidence": 0.5}


@pytest.fixture(scope="module")
def compiler(tiny_llama_dir) -> GrammarCompiler:
    """Against SmolLM2's tokenizer (saved with the tiny checkpoint)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    return GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def takes(compiler: GrammarCompiler, spec: GrammarSpec, text: str) -> bool:
    """Whether the grammar accepts every token of ``text`` and is complete after it."""
    state = compiler.state(spec)
    ids = compiler.tokenizer.encode(text, add_special_tokens=False)
    return all(state.accept(t) for t in ids) and bool(state.matcher.is_accepting())


def test_schema_keeps_the_clients_property_order() -> None:
    spec = GrammarSpec.json_schema(ORDERED)
    assert list(json.loads(spec.value)["properties"]) == ["reasoning", "answer", "confidence"]
    alphabetical = {**ORDERED, "properties": dict(sorted(ORDERED["properties"].items()))}
    assert spec != GrammarSpec.json_schema(alphabetical)


def test_properties_come_in_the_schemas_order(compiler: GrammarCompiler) -> None:
    spec = GrammarSpec.json_schema(ORDERED)
    assert takes(compiler, spec, json.dumps(VALUE, separators=(",", ":")))
    alphabetical = json.dumps(dict(sorted(VALUE.items())), separators=(",", ":"))
    assert not takes(compiler, spec, alphabetical)


@pytest.mark.parametrize("indent", [None, 2])
def test_json_may_be_written_with_whitespace_as_under_vllm(
    compiler: GrammarCompiler, indent: int | None
) -> None:
    pretty = json.dumps(VALUE, indent=indent)  # ", " and ": " separators, or newlines and indentation
    assert takes(compiler, GrammarSpec.json_schema(ORDERED), pretty)
    assert takes(compiler, GrammarSpec.json_object(), pretty)


def test_a_schema_can_still_forbid_whitespace(compiler: GrammarCompiler) -> None:
    compact = GrammarSpec.json_schema({**ORDERED, "x-guidance": {"whitespace_flexible": False}})
    assert takes(compiler, compact, json.dumps(VALUE, separators=(",", ":")))
    assert not takes(compiler, compact, json.dumps(VALUE, indent=2))


def test_a_gap_holds_one_line_break_and_bounded_indentation(compiler: GrammarCompiler) -> None:
    """Enough for pretty-printed JSON, not for a run a model could spin on until max_tokens."""
    spec = GrammarSpec.json_schema(ORDERED)
    deep = '{\n' + " " * MAX_INDENT + '"reasoning": "x", "answer": 1, "confidence": 1}'
    assert takes(compiler, spec, deep)
    too_deep = "{" + " " * (MAX_INDENT + 1) + '"reasoning": "x", "answer": 1, "confidence": 1}'
    assert not takes(compiler, spec, too_deep)
    assert not takes(compiler, spec, '{\n\n"reasoning": "x", "answer": 1, "confidence": 1}')
