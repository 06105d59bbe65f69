"""The engine core in its own process: text made in the API process, refusals, death, host metrics."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from neuron_lmi.backends.cpu.engine import cpu_process_engine
from neuron_lmi.backends.cpu.llm import LLM
from neuron_lmi.engine.process_front import RESTART_RETRY_AFTER_S, ProcessEngine
from neuron_lmi.engine.types import (
    EngineDeadError,
    FinishReason,
    GrammarSpec,
    InvalidRequestError,
    SamplingParams,
    TokenEvent,
)
from tests.conftest import cpu_options

from .conftest import random_prompts


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> Iterator[ProcessEngine]:
    eng = cpu_process_engine(cpu_options(tiny_llama_dir, max_rolling_batch_size=4, n_positions=256))
    yield eng
    asyncio.run(eng.stop(grace_s=1.0))


async def _run(engine: ProcessEngine, prompt: list[int], params: SamplingParams) -> list[TokenEvent]:
    await engine.start()
    return [e async for e in engine.generate(engine.admit(prompt, params))]


async def test_text_and_stop_sequences_match_the_in_process_engine(
    engine: ProcessEngine, tiny_llm: LLM
) -> None:
    """Detokenization and stop sequences run in the API process; what a client reads is the same."""
    prompts = random_prompts([7, 12, 20], seed=11)
    plain = tiny_llm.generate(prompts, SamplingParams(max_new_tokens=24))
    for prompt, done in zip(prompts, plain, strict=True):
        events = await _run(engine, prompt, SamplingParams(max_new_tokens=24))
        assert [e.token_id for e in events] == done.token_ids
        assert "".join(e.text for e in events) == done.text
        assert [e.token_text for e in events] == [e.token_text for e in done.events]
        assert events[-1].finish_reason is done.finish_reason
        # A stop sequence from the middle of that text ends both engines at the same place.
        middle = done.text[len(done.text) // 2 :][:3]
        if not middle.strip():
            continue
        params = SamplingParams(max_new_tokens=24, stop=(middle,))
        expected = tiny_llm.generate([prompt], params)[0]
        events = await _run(engine, prompt, params)
        assert "".join(e.text for e in events) == expected.text
        assert events[-1].finish_reason is expected.finish_reason is FinishReason.STOP_SEQUENCE
        assert [e.token_id for e in events] == expected.token_ids


async def test_a_request_the_engine_refuses_fails_its_stream(engine: ProcessEngine) -> None:
    """What only the engine process can check (a grammar against its tokenizer: a token id past the
    vocabulary passes admission's tokenizer-free check) surfaces from the stream's first step."""
    await engine.start()
    params = SamplingParams(max_new_tokens=4, grammar=GrammarSpec.ebnf('start: <[99999999]> "a"'))
    stream = engine.generate(engine.admit([5, 6, 7], params))
    with pytest.raises(InvalidRequestError) as info:
        await anext(stream)
    assert info.value.field == "grammar" and "Token range" in str(info.value)
    events = await _run(engine, [5, 6, 7], SamplingParams(max_new_tokens=3))
    assert len(events) == 3  # the engine carries on


async def test_invalid_and_too_long_requests_are_refused_before_submission(engine: ProcessEngine) -> None:
    await engine.start()
    with pytest.raises(InvalidRequestError) as info:
        engine.generate(engine.admit([1, 2], SamplingParams(max_new_tokens=300)))
    assert info.value.field == "max_new_tokens"
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        engine.generate(engine.admit([engine.vocab_size], SamplingParams(max_new_tokens=2)))
    with pytest.raises(InvalidRequestError, match="exceeds n_positions"):
        engine.generate(engine.admit([3] * 250, SamplingParams(max_new_tokens=10)))
    with pytest.raises(InvalidRequestError) as info:  # the API process knows the vocabulary
        engine.admit([5, 6, 7], SamplingParams(max_new_tokens=4, logit_bias=((10**7, 1.0),)))
    assert info.value.field == "logit_bias"


async def test_host_time_per_step_is_reported(engine: ProcessEngine) -> None:
    await asyncio.gather(
        *(_run(engine, p, SamplingParams(max_new_tokens=16)) for p in random_prompts([9] * 4, seed=5))
    )
    extra = engine.stats().extra
    assert extra["steps"] > 0 and extra["decode_batch"] >= 1
    assert extra["host_ms_per_step"] > 0 and extra["model_ms_per_step"] > 0
    assert extra["host_cpu_ms_per_step"] >= 0


async def test_a_dead_engine_process_ends_every_stream_and_is_reported(tiny_llama_dir: Path) -> None:
    # SERVING_FAIL_FAST: no restart.
    engine = cpu_process_engine(
        cpu_options(tiny_llama_dir, max_rolling_batch_size=2, n_positions=256, fail_fast=True)
    )
    deaths: list[BaseException] = []
    engine.on_death.append(deaths.append)
    await engine.start()
    stream = engine.generate(engine.admit(random_prompts([8], seed=3)[0], SamplingParams(max_new_tokens=200)))
    first = await anext(stream)
    assert first.finish_reason is None
    engine._proc.kill()  # as the OOM killer would
    with pytest.raises(EngineDeadError) as died:
        async for _ in stream:
            pass
    assert died.value.retry_after_s is None  # no restart is coming
    assert not engine.stats().alive
    assert deaths and isinstance(deaths[0], EngineDeadError)
    with pytest.raises(EngineDeadError):
        engine.generate(engine.admit([1, 2, 3], SamplingParams(max_new_tokens=2)))
    await engine.stop(grace_s=0.1)


async def _alive_within(engine: ProcessEngine, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not engine.stats().alive and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    return engine.stats().alive


async def test_a_dead_engine_process_is_restarted_a_bounded_number_of_times(tiny_llama_dir: Path) -> None:
    options = cpu_options(tiny_llama_dir, max_rolling_batch_size=2, n_positions=256)
    engine = cpu_process_engine(replace(options, max_restarts=1))
    deaths: list[BaseException] = []
    engine.on_death.append(deaths.append)
    await engine.start()
    prompt, params = random_prompts([8], seed=3)[0], SamplingParams(max_new_tokens=200)
    stream = engine.generate(engine.admit(prompt, params))
    await anext(stream)
    first = engine._proc
    first.kill()
    with pytest.raises(EngineDeadError) as died:
        async for _ in stream:
            pass
    assert died.value.retry_after_s == RESTART_RETRY_AFTER_S  # the client is told when to retry
    assert await _alive_within(engine, 120) and engine._proc is not first and engine.restarts == 1
    done = [
        e
        async for e in engine.generate(
            engine.admit(prompt, SamplingParams(max_new_tokens=3, temperature=0.0))
        )
    ]
    assert [e.finish_reason for e in done if e.finish_reason] == [FinishReason.LENGTH] and not deaths
    assert engine.stats().rows_used == 0  # the new process's rows, none leaked
    engine._proc.kill()  # the restart is spent: this death is final
    deadline = time.monotonic() + 30
    while not deaths and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert deaths and not engine.stats().alive
    with pytest.raises(EngineDeadError) as refused:
        engine.generate(engine.admit([1, 2, 3], SamplingParams(max_new_tokens=2)))
    assert refused.value.retry_after_s is None
    await engine.stop(grace_s=0.1)


def test_a_model_that_cannot_load_fails_the_constructor(tmp_path: Path) -> None:
    with pytest.raises((FileNotFoundError, ValueError, OSError)):
        cpu_process_engine(cpu_options(tmp_path / "no-such-model", max_rolling_batch_size=1))
