"""The asyncio engines: streaming, aborts on disconnect, bounded queue, shutdown.

Each test runs on both: ``AsyncEngine`` (the core on a thread) and ``ProcessEngine`` (the core in its
own process, text in this one)."""

from __future__ import annotations

import asyncio

import pytest

from neuron_lmi.backends.cpu.engine import cpu_process_engine, cpu_thread_engine
from neuron_lmi.engine.types import EngineOverloadedError, FinishReason, InvalidRequestError, SamplingParams
from tests.conftest import cpu_options

from .conftest import random_prompts

ENGINES = {"thread": cpu_thread_engine, "process": cpu_process_engine}


@pytest.fixture(params=sorted(ENGINES))
async def engine(request, tiny_llama_dir):
    # Its own core: the session's sync LLM must never be stepped from two threads.
    options = cpu_options(tiny_llama_dir, max_queue_size=4, max_rolling_batch_size=4, n_positions=256)
    eng = ENGINES[request.param](options)
    await eng.start()
    yield eng
    await eng.stop(grace_s=1.0)


async def test_streams_events_in_order_and_matches_sync_output(engine, tiny_llm):
    prompt = random_prompts([15], seed=31)[0]
    expected = tiny_llm.generate([prompt], SamplingParams(max_new_tokens=12))
    events = [e async for e in engine.generate(engine.admit(prompt, SamplingParams(max_new_tokens=12)))]
    assert [e.index for e in events] == list(range(12))
    assert [e.token_id for e in events] == expected[0].token_ids
    assert events[-1].finish_reason is FinishReason.LENGTH
    assert all(e.finish_reason is None for e in events[:-1])


async def test_closing_the_stream_aborts_and_frees_the_row(engine):
    stream = engine.generate(
        engine.admit(random_prompts([10], seed=1)[0], SamplingParams(max_new_tokens=200))
    )
    async for _ in stream:
        break
    await stream.aclose()
    for _ in range(100):
        if engine.stats().rows_used == 0:
            break
        await asyncio.sleep(0.02)
    assert engine.stats().rows_used == 0
    assert engine.stats().alive


async def test_invalid_requests_raise_before_anything_is_queued(engine):
    with pytest.raises(InvalidRequestError) as info:
        engine.generate(engine.admit("hello", SamplingParams(top_p=2.0)))
    assert info.value.field == "top_p"
    assert engine.stats().waiting == 0


async def test_queue_beyond_its_bound_is_refused(engine):
    rows, queue_size = engine.max_batch_size, engine.max_queue_size
    params = SamplingParams(max_new_tokens=200)
    running = [engine.generate(engine.admit(p, params)) for p in random_prompts([8] * rows, seed=2)]
    await asyncio.gather(*(s.__anext__() for s in running))  # every row is now busy
    queued = [engine.generate(engine.admit(p, params)) for p in random_prompts([8] * queue_size, seed=3)]
    waiters = [asyncio.create_task(s.__anext__()) for s in queued]
    for _ in range(200):
        if engine.stats().waiting == queue_size:
            break
        await asyncio.sleep(0.01)
    assert engine.stats().waiting == queue_size
    with pytest.raises(EngineOverloadedError, match="max_queue_size=4"):
        engine.generate(engine.admit("one more", SamplingParams(max_new_tokens=4)))
    for task in waiters:
        task.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)
    for s in running + queued:
        await s.aclose()


async def test_concurrent_streams_all_finish_and_rows_return(engine):
    async def run(prompt):
        return [e async for e in engine.generate(engine.admit(prompt, SamplingParams(max_new_tokens=6)))]

    results = await asyncio.gather(*(run(p) for p in random_prompts([5, 9, 13, 17, 21, 25], seed=3)))
    assert all(r[-1].finish_reason is FinishReason.LENGTH and len(r) == 6 for r in results)
    assert engine.stats().rows_used == 0 and engine.stats().waiting == 0
