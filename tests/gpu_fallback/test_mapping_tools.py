"""Forced tool calls (``tool_choice`` required or named) on vLLM: the server's tool grammar for each
format reaches vLLM's structured outputs, and vLLM's grammar backends accept it.

The server renders tools with the model's chat template and parses calls itself on every backend
(same parsers, vLLM's names, same response shape); what vLLM receives is the constraint.
"""

from __future__ import annotations

import pytest

from gpu_fallback.mapping import sampling_kwargs, structured_outputs
from neuron_lmi.engine.types import GrammarKind, SamplingParams
from neuron_lmi.server.tool_parsers import PARSERS, FunctionSpec, get_parser

PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "days": {"type": "array", "items": {"$ref": "#/$defs/d"}},
    },
    "required": ["city"],
    "$defs": {"d": {"type": "integer", "minimum": 0}},
}
FUNCTIONS = (FunctionSpec("get_weather", "weather", PARAMETERS), FunctionSpec("noargs", None, None))
CASES = [(name, parallel) for name in sorted(PARSERS) for parallel in (False, True)]


@pytest.mark.parametrize(("parser", "parallel"), CASES)
def test_tool_grammar_maps_to_structured_outputs(parser: str, parallel: bool) -> None:
    spec = get_parser(parser).grammar(FUNCTIONS, parallel)
    out = structured_outputs(spec)
    assert out is not None
    if spec.kind is GrammarKind.JSON_SCHEMA:
        assert out == {"json": spec.schema()}
    else:
        assert (
            out == {"grammar": spec.value} and "%json" in spec.value
        )  # Lark, as llguidance and xgrammar read it


@pytest.mark.parametrize(("parser", "parallel"), CASES)
def test_vllm_grammar_backends_accept_the_tool_grammar(parser: str, parallel: bool) -> None:
    pytest.importorskip("vllm", exc_type=ImportError)
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.sampling_params import StructuredOutputsParams
    from vllm.v1.structured_output.backend_guidance import validate_guidance_grammar
    from vllm.v1.structured_output.backend_xgrammar import validate_xgrammar_grammar

    kw = sampling_kwargs(
        SamplingParams(max_new_tokens=32, grammar=get_parser(parser).grammar(FUNCTIONS, parallel))
    )
    kw["structured_outputs"] = StructuredOutputsParams(**kw["structured_outputs"])
    params = VllmSamplingParams(**kw)
    validate_xgrammar_grammar(params)  # "auto" tries xgrammar first
    validate_guidance_grammar(params)  # and falls back to guidance
