"""``VllmEngine`` over a stand-in for vLLM's AsyncLLM: admission, abort on close, stats, shutdown."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace as NS

import pytest

from gpu_fallback.config import VllmEngineConfig
from gpu_fallback.engine import VllmEngine
from neuron_lmi.engine.protocol import Engine
from neuron_lmi.engine.types import (
    EngineDeadError,
    EngineOverloadedError,
    FinishReason,
    InvalidRequestError,
    SamplingParams,
)


class FakeDead(Exception):
    pass


class FakeLLM:
    """Emits token 100+i for i < max_tokens, one DELTA per step, like AsyncLLM.generate."""

    def __init__(self, snapshot) -> None:
        self.snapshot = snapshot
        self.model_config = NS(max_model_len=64)
        self.errored = False
        self.unfinished: set[str] = set()
        self.aborted: list[str] = []
        self.die_after: int | None = None

    async def generate(self, prompt, params, request_id):
        self.unfinished.add(request_id)
        try:
            for i in range(params["max_tokens"]):
                await asyncio.sleep(0)
                if request_id not in self.unfinished:
                    yield NS(
                        outputs=[
                            NS(token_ids=[], text="", logprobs=None, finish_reason="abort", stop_reason=None)
                        ]
                    )
                    return
                if self.die_after is not None and i >= self.die_after:
                    self.errored = True
                    raise FakeDead("engine core died")
                self.snapshot.running = len(self.unfinished)
                last = i == params["max_tokens"] - 1
                yield NS(
                    outputs=[
                        NS(
                            token_ids=[100 + i],
                            text=f"t{i}",
                            logprobs=[{100 + i: NS(logprob=-0.5, rank=1, decoded_token=f"t{i}")}],
                            finish_reason="length" if last else None,
                            stop_reason=None,
                        )
                    ]
                )
        finally:
            self.unfinished.discard(request_id)

    async def abort(self, request_id) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self.aborted.extend(ids)
        self.unfinished.difference_update(ids)

    def shutdown(self) -> None:
        self.errored = True


class FakeBackend:
    dead_errors = (FakeDead,)

    def __init__(self) -> None:
        self.llm = None
        self.kwargs = None

    def create(self, kwargs, snapshot):
        self.kwargs = kwargs
        self.llm = FakeLLM(snapshot)
        return self.llm

    def sampling_params(self, kwargs):
        return kwargs

    @staticmethod
    def device_count() -> int:
        return 1


@pytest.fixture()
async def engine(tiny_llama_dir):
    backend = FakeBackend()
    eng = VllmEngine(
        VllmEngineConfig(model=str(tiny_llama_dir), max_rolling_batch_size=2, max_queue_size=1),
        backend=backend,
    )
    await eng.start()
    yield eng
    await eng.stop(grace_s=0.1)


async def test_protocol_and_start(engine) -> None:
    assert isinstance(engine, Engine)
    assert engine.n_positions == 64 and engine.max_batch_size == 2 and engine.backend_name == "vllm"
    assert engine._backend.kwargs["max_num_seqs"] == 2
    assert engine.stats().alive and engine.stats().rows_used == 0


async def test_stream_maps_every_delta(engine) -> None:
    events = [e async for e in engine.generate("hello world", SamplingParams(max_new_tokens=4))]
    assert [e.token_id for e in events] == [100, 101, 102, 103]
    assert "".join(e.text for e in events) == "t0t1t2t3"
    assert events[-1].finish_reason is FinishReason.LENGTH
    assert engine.stats().rows_used == 0


async def test_close_mid_stream_aborts_in_vllm(engine) -> None:
    stream = engine.generate("hello", SamplingParams(max_new_tokens=30), "r1")
    await anext(stream)
    assert engine.stats().rows_used == 1 and engine.stats().positions_used > 0
    await stream.aclose()
    assert "r1" in engine._backend.llm.aborted and not engine._backend.llm.unfinished
    assert engine.stats().rows_used == 0 and engine.stats().positions_used == 0


async def test_never_iterated_stream_holds_no_row(engine) -> None:
    engine.generate("hello", SamplingParams(max_new_tokens=3))
    assert engine.stats().rows_used == 0


async def test_abort_by_id(engine) -> None:
    events = []
    async for ev in engine.generate("hello", SamplingParams(max_new_tokens=30), "r2"):
        events.append(ev)
        if len(events) == 2:
            await engine.abort("r2")
    assert events[-1].finish_reason is FinishReason.ABORT and events[-1].token_id == -1


async def test_overload_and_validation(engine) -> None:
    params = SamplingParams(max_new_tokens=30)
    streams = [engine.generate("hi", params) for _ in range(3)]
    for s in streams:  # admitted: 2 rows + 1 queue slot
        await anext(s)
    with pytest.raises(EngineOverloadedError):
        engine.generate("hi", params)
    for s in streams:
        await s.aclose()
    assert engine.stats().waiting == 0 and engine.stats().running == 0
    with pytest.raises(InvalidRequestError) as info:
        engine.generate("hi", SamplingParams(max_new_tokens=64))
    assert info.value.field == "max_new_tokens"
    with pytest.raises(InvalidRequestError) as info:
        engine.generate("hello " * 40, SamplingParams(max_new_tokens=40))
    assert info.value.field == "inputs"


async def test_dead_engine(engine) -> None:
    engine._backend.llm.die_after = 1
    with pytest.raises(EngineDeadError):
        async for _ in engine.generate("hello", SamplingParams(max_new_tokens=5)):
            pass
    assert not engine.stats().alive
    with pytest.raises(EngineDeadError):
        engine.generate("hello", SamplingParams(max_new_tokens=5))


async def test_stop_refuses_new_requests(engine) -> None:
    await engine.stop(grace_s=0.1)
    with pytest.raises(EngineDeadError):
        engine.generate("hello", SamplingParams(max_new_tokens=5))


def test_tokenizer_and_n_positions_before_start(tiny_llama_dir) -> None:
    # The server builds its context (tokenizer, special ids) before the engine starts.
    eng = VllmEngine(VllmEngineConfig(model=str(tiny_llama_dir)), backend=FakeBackend())
    assert eng.tokenizer.encode("hello") and eng.n_positions == 512
    assert not eng.stats().alive and eng.stats().rows_used == 0
