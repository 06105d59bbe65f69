"""``VllmEngine`` over a stand-in for vLLM's AsyncLLM: admission, abort on close, stats, shutdown,
vLLM's refusals as 4xx, final-only output for non-streaming requests, the model's sampling
defaults, and GPU counting that never touches ``torch.cuda``."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace as NS

import pytest

from gpu_fallback.engine import VllmEngine
from neuron_lmi.engine.protocol import Engine
from neuron_lmi.engine.types import (
    EngineDeadError,
    EngineOverloadedError,
    FinishReason,
    InvalidRequestError,
    SamplingParams,
)
from tests.gpu_fallback.conftest import engine_config


class FakeDead(Exception):
    pass


class FakeClientError(Exception):
    """Shaped as vLLM's ``VLLMValidationError``: a message and the parameter to blame, if known."""

    def __init__(self, message: str, parameter: str | None = None) -> None:
        super().__init__(message)
        self.parameter = parameter


MODEL_DEFAULTS = {"temperature": 0.6, "top_p": 0.9, "min_p": 0.05}


class FakeLLM:
    """Emits token 100+i for i < max_tokens, one DELTA per step, like AsyncLLM.generate."""

    def __init__(self, snapshot) -> None:
        self.snapshot = snapshot
        self.model_config = NS(max_model_len=64, get_diff_sampling_param=lambda: dict(MODEL_DEFAULTS))
        self.errored = False
        self.unfinished: set[str] = set()
        self.aborted: list[str] = []
        self.die_after: int | None = None

    async def generate(self, prompt, params, request_id, lora_request=None):
        if len(prompt["prompt_token_ids"]) > 20:  # as vLLM's input processor refuses a prompt
            raise FakeClientError("The decoder prompt (length 21) is longer than the maximum model length")
        self.unfinished.add(request_id)
        if params["final_only"]:  # FINAL_ONLY: one output with every token, at the end
            n = params["max_tokens"]
            ids = [100 + i for i in range(n)]
            lps = [{t: NS(logprob=-0.5, rank=1, decoded_token=f"t{i}")} for i, t in enumerate(ids)]
            text = "".join(f"t{i}" for i in range(n))
            self.unfinished.discard(request_id)
            yield NS(
                outputs=[NS(token_ids=ids, text=text, logprobs=lps, finish_reason="length", stop_reason=None)]
            )
            return
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
    client_errors = (FakeClientError, ValueError)

    def __init__(self) -> None:
        self.llm = None
        self.kwargs = None
        self.sampling: list[dict] = []
        self.streams: list[bool] = []

    def create(self, kwargs, snapshot):
        self.kwargs = kwargs
        self.llm = FakeLLM(snapshot)
        return self.llm

    def sampling_params(self, kwargs, stream=True):
        if kwargs["temperature"] > 2:  # vLLM 0.32's SamplingParams limit
            raise FakeClientError(
                f"temperature must be in [0, 2], got {kwargs['temperature']}.", "temperature"
            )
        if kwargs["repetition_penalty"] > 50:  # a refusal naming no parameter
            raise ValueError(f"repetition_penalty must be at most 50, got {kwargs['repetition_penalty']}")
        self.sampling.append(kwargs)
        self.streams.append(stream)
        return {**kwargs, "final_only": not stream}

    @staticmethod
    def device_count() -> int:
        return 1


@pytest.fixture()
async def engine(tiny_llama_dir):
    backend = FakeBackend()
    eng = VllmEngine(
        engine_config(str(tiny_llama_dir), max_rolling_batch_size=2, max_queue_size=1),
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
    events = [e async for e in engine.generate(engine.admit("hello world", SamplingParams(max_new_tokens=4)))]
    assert [e.token_id for e in events] == [100, 101, 102, 103]
    assert "".join(e.text for e in events) == "t0t1t2t3"
    assert events[-1].finish_reason is FinishReason.LENGTH
    assert engine.stats().rows_used == 0


async def test_close_mid_stream_aborts_in_vllm(engine) -> None:
    stream = engine.generate(engine.admit("hello", SamplingParams(max_new_tokens=30), "r1"))
    await anext(stream)
    assert engine.stats().rows_used == 1 and engine.stats().positions_used > 0
    await stream.aclose()
    assert "r1" in engine._backend.llm.aborted and not engine._backend.llm.unfinished
    assert engine.stats().rows_used == 0 and engine.stats().positions_used == 0


async def test_never_iterated_stream_holds_no_row(engine) -> None:
    engine.generate(engine.admit("hello", SamplingParams(max_new_tokens=3)))
    assert engine.stats().rows_used == 0


async def test_abort_by_id(engine) -> None:
    events = []
    async for ev in engine.generate(engine.admit("hello", SamplingParams(max_new_tokens=30), "r2")):
        events.append(ev)
        if len(events) == 2:
            await engine.abort("r2")
    assert events[-1].finish_reason is FinishReason.ABORT and events[-1].token_id == -1


async def test_overload_and_validation(engine) -> None:
    params = SamplingParams(max_new_tokens=30)
    streams = [engine.generate(engine.admit("hi", params)) for _ in range(3)]
    for s in streams:  # admitted: 2 rows + 1 queue slot
        await anext(s)
    with pytest.raises(EngineOverloadedError):
        engine.generate(engine.admit("hi", params))
    for s in streams:
        await s.aclose()
    assert engine.stats().waiting == 0 and engine.stats().running == 0
    with pytest.raises(InvalidRequestError) as info:
        engine.generate(engine.admit("hi", SamplingParams(max_new_tokens=64)))
    assert info.value.field == "max_new_tokens"
    with pytest.raises(InvalidRequestError) as info:
        engine.generate(engine.admit("hello " * 40, SamplingParams(max_new_tokens=40)))
    assert info.value.field == "inputs"


async def test_dead_engine(engine) -> None:
    engine._backend.llm.die_after = 1
    with pytest.raises(EngineDeadError):
        async for _ in engine.generate(engine.admit("hello", SamplingParams(max_new_tokens=5))):
            pass
    assert not engine.stats().alive
    with pytest.raises(EngineDeadError):
        engine.generate(engine.admit("hello", SamplingParams(max_new_tokens=5)))


async def test_stop_refuses_new_requests(engine) -> None:
    await engine.stop(grace_s=0.1)
    with pytest.raises(EngineDeadError):
        engine.generate(engine.admit("hello", SamplingParams(max_new_tokens=5)))


def test_tokenizer_and_n_positions_before_start(tiny_llama_dir) -> None:
    # The server builds its context (tokenizer, special ids) before the engine starts.
    eng = VllmEngine(engine_config(str(tiny_llama_dir)), backend=FakeBackend())
    assert eng.tokenizer.encode("hello") and eng.n_positions == 512
    assert not eng.stats().alive and eng.stats().rows_used == 0


async def test_vllm_refusals_become_invalid_request_errors(engine) -> None:
    with pytest.raises(InvalidRequestError) as info:
        engine.generate(engine.admit("hi", SamplingParams(max_new_tokens=3, temperature=2.5)))
    assert info.value.field == "temperature" and "[0, 2]" in str(info.value)
    with pytest.raises(InvalidRequestError) as info:
        engine.generate(engine.admit("hi", SamplingParams(max_new_tokens=3, repetition_penalty=60.0)))
    assert info.value.field == "repetition_penalty"
    # Refused when vLLM adds it (the server primes the first event, so this is still a 4xx).
    with pytest.raises(InvalidRequestError) as info:
        await anext(engine.generate(engine.admit(list(range(21)), SamplingParams(max_new_tokens=3))))
    assert info.value.field == "inputs"
    assert engine.stats().rows_used == 0 and not engine._backend.llm.aborted


async def test_non_streaming_requests_ask_for_the_final_output_only(engine) -> None:
    streamed = [e async for e in engine.generate(engine.admit("hello", SamplingParams(max_new_tokens=3)))]
    final = [
        e
        async for e in engine.generate(engine.admit("hello", SamplingParams(max_new_tokens=3, stream=False)))
    ]
    assert [e.token_id for e in final] == [e.token_id for e in streamed] == [100, 101, 102]
    assert "".join(e.text for e in final) == "".join(e.text for e in streamed) == "t0t1t2"
    assert [e.index for e in final] == [0, 1, 2] and final[-1].finish_reason is FinishReason.LENGTH
    assert engine._backend.streams[-2:] == [True, False]  # DELTA, then FINAL_ONLY
    assert engine.stats().rows_used == 0


async def test_model_sampling_defaults_fill_only_unset_fields(engine) -> None:
    assert engine.sampling_defaults == MODEL_DEFAULTS  # read from vLLM's model_config at start
    params = SamplingParams(
        max_new_tokens=2, temperature=1.0, top_p=1.0, unset=frozenset({"temperature", "min_p"})
    )
    [_ async for _ in engine.generate(engine.admit("hello", params))]
    sent = engine._backend.sampling[-1]
    assert sent["temperature"] == 0.6 and sent["min_p"] == 0.05  # unset: the model's
    assert sent["top_p"] == 1.0  # set by the request: kept
    [
        _
        async for _ in engine.generate(
            engine.admit("hello", SamplingParams(max_new_tokens=2, temperature=0.0))
        )
    ]
    assert engine._backend.sampling[-1]["temperature"] == 0.0 and "min_p" not in engine._backend.sampling[-1]


def test_gpu_count_never_touches_torch_cuda(monkeypatch) -> None:
    """The real backend counts GPUs through NVML: a server that called torch.cuda would leave
    vLLM's forked engine core unable to use CUDA."""
    import sys
    import types

    import torch

    from gpu_fallback.engine import VllmBackend

    def forbidden(*args, **kwargs):
        raise AssertionError("torch.cuda must not be called in the server process")

    for name in ("is_available", "device_count", "init", "current_device"):
        monkeypatch.setattr(torch.cuda, name, forbidden)
    nvml = types.ModuleType("pynvml")
    nvml.nvmlInit = lambda: None
    nvml.nvmlDeviceGetCount = lambda: 8
    nvml.nvmlShutdown = lambda: None
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    assert VllmBackend.device_count() == 4
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert VllmBackend.device_count() == 8
    assert not torch.cuda.is_initialized()


def test_vllm_metrics_are_served_beside_ours(tiny_llama_dir) -> None:
    """/metrics renders the app's registry; the engine's collectors (vLLM's vllm:* series) join it."""
    from prometheus_client import generate_latest
    from prometheus_client.core import GaugeMetricFamily

    from neuron_lmi.server.metrics import ServerMetrics

    class Engine(VllmEngine):
        def prometheus_collectors(self):
            class Own:
                def describe(self):
                    return ()

                def collect(self):
                    yield GaugeMetricFamily("vllm:num_requests_running", "running", value=3.0)

            return [Own()]

    text = generate_latest(ServerMetrics(Engine(engine_config(str(tiny_llama_dir)))).registry).decode()
    assert "vllm:num_requests_running 3.0" in text and "neuron_lmi_kv_rows_used" in text
    # Without vLLM imported (the main environment) the real collector yields nothing and imports nothing.
    real = ServerMetrics(VllmEngine(engine_config(str(tiny_llama_dir))))
    assert "vllm:" not in generate_latest(real.registry).decode()
