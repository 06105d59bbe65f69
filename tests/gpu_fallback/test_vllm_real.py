"""``VllmEngine`` against a real vLLM engine (vLLM's CPU build), one engine start per session.

Greedy output is compared with vLLM's own output from the same engine (bypassing our mapping) and
with transformers; stop sequences, EOS, log-probabilities, seeds, aborts and validation are checked
on SmolLM2-135M-Instruct.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math

import pytest
import pytest_asyncio

from tests.gpu_fallback.conftest import engine_config, vllm_skip_reason

_reason = vllm_skip_reason()
pytestmark = [
    pytest.mark.skipif(_reason is not None, reason=_reason or ""),
    pytest.mark.slow,
    pytest.mark.asyncio(loop_scope="session"),
]

from neuron_lmi.engine.types import (  # noqa: E402
    FinishReason,
    InvalidRequestError,
    SamplingParams,
)

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a small robot"]


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def engine(vllm_env, smollm2_safetensors):
    from gpu_fallback.engine import VllmEngine

    eng = VllmEngine(
        engine_config(
            str(smollm2_safetensors),
            served_model_name="smollm2",
            max_rolling_batch_size=8,
            n_positions=512,
            dtype="fp32",
            max_queue_size=16,
        )
    )
    await eng.start()
    yield eng
    await eng.stop(grace_s=1.0)


async def collect(engine, prompt, params, request_id=None):
    return [ev async for ev in engine.generate(engine.admit(prompt, params, request_id))]


async def vllm_direct(engine, prompt_ids, max_tokens):
    """vLLM's own greedy output for the same ids, from the same AsyncLLM, final only."""
    from vllm import SamplingParams as VSP
    from vllm.sampling_params import RequestOutputKind

    params = VSP(temperature=0.0, max_tokens=max_tokens, output_kind=RequestOutputKind.FINAL_ONLY)
    final = None
    async for out in engine._llm.generate({"prompt_token_ids": prompt_ids}, params, f"direct-{id(params)}"):
        final = out
    return list(final.outputs[0].token_ids), final.outputs[0].text


async def test_greedy_matches_vllm_own_output(engine):
    for prompt in PROMPTS:
        events = await collect(engine, prompt, SamplingParams(max_new_tokens=24))
        ids, text = await vllm_direct(engine, engine.tokenizer.encode(prompt), 24)
        assert [e.token_id for e in events if e.token_id >= 0] == ids
        assert "".join(e.text for e in events) == text
        assert [e.index for e in events] == list(range(len(events)))
        assert events[-1].finish_reason in (FinishReason.LENGTH, FinishReason.EOS_TOKEN)
        assert all(e.finish_reason is None for e in events[:-1])
        assert {e.prompt_tokens for e in events} == {len(engine.tokenizer.encode(prompt))}


async def test_greedy_matches_transformers(engine, smollm2_safetensors):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(smollm2_safetensors), dtype=torch.float32).eval()
    prompt = PROMPTS[0]
    ids = engine.tokenizer.encode(prompt)
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids) :].tolist()
    events = await collect(engine, prompt, SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert [e.token_id for e in events] == ref


async def test_length_and_eos(engine):
    events = await collect(engine, PROMPTS[0], SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert len(events) == 3 and events[-1].finish_reason is FinishReason.LENGTH
    chat = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Say hello."}], tokenize=False, add_generation_prompt=True
    )
    events = await collect(engine, chat, SamplingParams(max_new_tokens=200))
    assert events[-1].finish_reason is FinishReason.EOS_TOKEN
    assert events[-1].token_id == engine.tokenizer.eos_token_id
    assert events[-1].special and events[-1].token_text == "<|im_end|>"
    assert "<|im_end|>" not in "".join(e.text for e in events)


async def test_stop_sequence(engine):
    full = "".join(e.text for e in await collect(engine, PROMPTS[2], SamplingParams(max_new_tokens=40)))
    words = full.split()
    assert len(words) > 6, full
    stop = " " + words[4]
    expected = full[: full.index(stop)]
    events = await collect(engine, PROMPTS[2], SamplingParams(max_new_tokens=40, stop=(stop,)))
    assert events[-1].finish_reason is FinishReason.STOP_SEQUENCE
    assert "".join(e.text for e in events) == expected


async def test_logprobs_and_top_tokens(engine):
    events = await collect(engine, PROMPTS[1], SamplingParams(max_new_tokens=8, top_n_tokens=3))
    for ev in events:
        assert len(ev.top_tokens) == 3
        lps = [t.logprob for t in ev.top_tokens]
        assert lps == sorted(lps, reverse=True) and all(lp <= 0 for lp in lps)
        # Greedy: the chosen token is the most likely one and carries its log-probability.
        assert ev.top_tokens[0].id == ev.token_id
        assert math.isclose(ev.top_tokens[0].logprob, ev.logprob, abs_tol=1e-4)
        assert ev.token_text == engine.tokenizer.decode([ev.token_id])
    plain = await collect(engine, PROMPTS[1], SamplingParams(max_new_tokens=8))
    assert all(e.top_tokens == () and e.logprob <= 0 for e in plain)


async def test_seed_makes_sampling_reproducible(engine):
    params = SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.95, seed=1234)
    first = [e.token_id for e in await collect(engine, PROMPTS[2], params)]
    again = [e.token_id for e in await collect(engine, PROMPTS[2], params)]
    assert first == again


async def test_close_aborts_and_frees_the_row(engine):
    stream = engine.generate(
        engine.admit(PROMPTS[2], SamplingParams(max_new_tokens=400, ignore_eos=True), "to-close")
    )
    got = [await anext(stream) for _ in range(3)]
    assert engine.stats().rows_used == 1
    await stream.aclose()
    assert engine.stats().rows_used == 0 and engine.stats().positions_used == 0
    for _ in range(100):
        if engine._llm.get_num_unfinished_requests() == 0:
            break
        await asyncio.sleep(0.05)
    assert engine._llm.get_num_unfinished_requests() == 0
    assert len(got) == 3
    # The engine serves the next request normally.
    assert len(await collect(engine, PROMPTS[0], SamplingParams(max_new_tokens=4, ignore_eos=True))) == 4


async def test_abort_by_id_ends_the_stream(engine):
    events = []

    async def consume():
        async for ev in engine.generate(
            engine.admit(PROMPTS[2], SamplingParams(max_new_tokens=400, ignore_eos=True), "ab1")
        ):
            events.append(ev)
            if len(events) == 2:
                await engine.abort("ab1")

    await asyncio.wait_for(consume(), timeout=60)
    assert len(events) < 400
    assert events[-1].finish_reason is FinishReason.ABORT
    assert engine.stats().rows_used == 0


async def test_concurrent_greedy_equals_solo(engine):
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    solo = [[e.token_id for e in await collect(engine, p, params)] for p in PROMPTS]
    together = await asyncio.gather(*(collect(engine, p, params) for p in PROMPTS * 3))
    assert [[e.token_id for e in evs] for evs in together] == solo * 3
    assert engine.stats().rows_used == 0


@pytest.mark.parametrize(
    ("prompt", "params", "field"),
    [
        ("", SamplingParams(), "inputs"),
        ([], SamplingParams(), "inputs"),
        ([10**9], SamplingParams(), "inputs"),
        ("hi", SamplingParams(max_new_tokens=0), "max_new_tokens"),
        ("hi", SamplingParams(max_new_tokens=512), "max_new_tokens"),
        ("hi " * 300, SamplingParams(max_new_tokens=300), "inputs"),
        ("hi", SamplingParams(top_p=0.0), "top_p"),
        ("hi", SamplingParams(temperature=-1.0), "temperature"),
    ],
)
async def test_invalid_requests_name_the_field(engine, prompt, params, field):
    with pytest.raises(InvalidRequestError) as info:
        engine.generate(engine.admit(prompt, params))
    assert info.value.field == field
    assert engine.stats().rows_used == 0


async def test_vllm_own_limits_are_refused_by_name(engine):
    # vLLM 0.32's SamplingParams refuses temperature > 2 (our engine allows up to 100): a 4xx naming it.
    with pytest.raises(InvalidRequestError) as info:
        engine.generate(engine.admit("hi", SamplingParams(temperature=2.5)))
    assert info.value.field == "temperature" and "2" in str(info.value)
    assert engine.stats().rows_used == 0


async def test_final_only_output_equals_the_stream(engine):
    """Non-streaming requests ask vLLM for RequestOutputKind.FINAL_ONLY, as vLLM's server does."""
    params = SamplingParams(max_new_tokens=12, top_n_tokens=2, ignore_eos=True)
    streamed = await collect(engine, PROMPTS[1], params)
    final = await collect(engine, PROMPTS[1], dataclasses.replace(params, stream=False))
    assert [e.token_id for e in final] == [e.token_id for e in streamed]
    assert "".join(e.text for e in final) == "".join(e.text for e in streamed)
    assert [e.index for e in final] == list(range(12)) and final[-1].finish_reason is FinishReason.LENGTH
    assert [[t.id for t in e.top_tokens] for e in final] == [[t.id for t in e.top_tokens] for e in streamed]
    assert engine.stats().rows_used == 0
