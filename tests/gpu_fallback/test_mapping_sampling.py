"""Every sampling field and structured output mapped to vLLM's ``SamplingParams`` (stand-ins, and
the real class where vLLM imports)."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from gpu_fallback.mapping import prompt_tokens, sampling_kwargs, structured_outputs
from neuron_lmi.engine.types import GrammarSpec, SamplingParams

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_non_neutral_fields_are_passed_and_neutral_ones_left_to_vllm() -> None:
    params = SamplingParams(
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        logit_bias=((7, 3.0), (9, -100.0)),
        min_tokens=4,
        min_p=0.1,
        prompt_logprobs=0,
        grammar=GrammarSpec.json_schema(SCHEMA),
    )
    kw = sampling_kwargs(params)
    assert kw["presence_penalty"] == 0.5 and kw["frequency_penalty"] == -0.25
    assert kw["logit_bias"] == {7: 3.0, 9: -100.0}
    assert kw["min_tokens"] == 4 and kw["min_p"] == 0.1 and kw["prompt_logprobs"] == 0
    # vLLM's default JSON whitespace, as on the CPU engine
    assert kw["structured_outputs"] == {"json": SCHEMA}
    plain = sampling_kwargs(SamplingParams())
    for name in (
        "presence_penalty",
        "logit_bias",
        "min_tokens",
        "min_p",
        "prompt_logprobs",
        "structured_outputs",
    ):
        assert name not in plain


def test_unset_penalties_take_the_model_defaults() -> None:
    params = SamplingParams(unset=frozenset({"presence_penalty", "min_p"}))
    kw = sampling_kwargs(params, {"presence_penalty": 0.3, "min_p": 0.05})
    assert kw["presence_penalty"] == 0.3 and kw["min_p"] == 0.05


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (GrammarSpec.json_object(), {"json_object": True}),
        (
            GrammarSpec.json_schema({**SCHEMA, "x-guidance": {"whitespace_flexible": False}}),
            {"json": SCHEMA, "disable_any_whitespace": True},
        ),
        (
            GrammarSpec.json_schema({**SCHEMA, "x-guidance": {"whitespace_pattern": " ?"}}),
            {"json": SCHEMA, "whitespace_pattern": " ?"},
        ),
        (GrammarSpec.regex("[ab]+"), {"regex": "[ab]+"}),
        (GrammarSpec.ebnf('root ::= "x"'), {"grammar": 'root ::= "x"'}),
        (None, None),
    ],
)
def test_structured_outputs_per_kind(spec, expected) -> None:
    assert structured_outputs(spec) == expected


def test_prompt_logprobs_map_to_scored_prompt_tokens() -> None:
    lp = lambda v, text: NS(logprob=v, decoded_token=text)  # noqa: E731
    scored = prompt_tokens(
        [5, 6, 7],
        [None, {6: lp(-1.5, "b"), 3: lp(-0.5, "x")}, {7: lp(-2.0, None), 3: lp(-0.1, "x"), 4: lp(-0.2, "y")}],
        1,
        lambda t: f"<{t}>",
    )
    assert scored is not None
    assert [(t.id, t.text, t.logprob) for t in scored] == [(5, "<5>", None), (6, "b", -1.5), (7, "<7>", -2.0)]
    assert [[a.id for a in t.top] for t in scored] == [[], [3], [3]]
    assert prompt_tokens([5], None, 0, str) is None


def test_real_vllm_sampling_params_accept_the_mapping() -> None:
    pytest.importorskip("vllm", exc_type=ImportError)
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    params = SamplingParams(
        max_new_tokens=8,
        temperature=0.7,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        logit_bias=((7, 3.0),),
        min_tokens=2,
        min_p=0.1,
        prompt_logprobs=1,
        grammar=GrammarSpec.json_schema(SCHEMA),
    )
    kw = sampling_kwargs(params)
    kw["structured_outputs"] = StructuredOutputsParams(**kw["structured_outputs"])
    vp = VllmSamplingParams(**kw)
    assert vp.min_tokens == 2 and vp.min_p == 0.1 and vp.logit_bias == {7: 3.0}
    assert vp.structured_outputs.json == SCHEMA and vp.prompt_logprobs == 1
