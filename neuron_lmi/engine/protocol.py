"""The one boundary between the HTTP server and whatever generates tokens.

The CPU/Neuron rolling-batch engine (``neuron_lmi.engine.async_engine.AsyncEngine``) and the vLLM
adapter (``gpu_fallback``) both implement it; the server sees nothing else.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from neuron_lmi.engine.admission import ValidRequest
from neuron_lmi.engine.types import EngineStats, SamplingParams, TokenEvent


@runtime_checkable
class Engine(Protocol):
    """An asynchronous token generator.

    Invariants: ``admit`` is a request's one validation (``engine.admission``): it raises
    ``InvalidRequestError`` naming the field, ``EngineOverloadedError`` when the bounded queue is
    full, ``EngineDeadError`` when the engine is down, and returns a ``ValidRequest``. ``generate``
    takes only that, trusts it, yields events in order and ends after the event carrying
    ``finish_reason``. Closing the iterator early (a client disconnect) aborts the request and frees
    its KV row.
    """

    model_name: str
    n_positions: int
    max_batch_size: int
    backend_name: str
    model_dtype: str | None  # what /info reports as model_dtype; None: the configuration's

    @property
    def tokenizer(self) -> Any:
        """A Hugging Face tokenizer (chat template, token counting)."""
        ...

    async def start(self) -> None: ...

    async def stop(self, grace_s: float = 10.0) -> None: ...

    def admit(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
    ) -> ValidRequest: ...

    def generate(self, request: ValidRequest) -> AsyncIterator[TokenEvent]: ...

    async def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats: ...

    def prometheus_collectors(self) -> list[Any]:
        """Collectors of the backend's own series (vLLM's ``vllm:*``), served beside the server's."""
        ...


@runtime_checkable
class AdapterHost(Protocol):
    """An engine that serves LoRA adapters chosen per request (``SamplingParams.adapter``) and
    loads them at run time (the CPU engine's ``ProcessEngine``); the server's adapter routes answer
    400 for an engine that is not one.

    Invariants: ``adapters`` maps each served adapter's name to where it was read from;
    ``load_adapter`` returns once the adapter serves requests, or raises ``InvalidRequestError``
    naming it and why; ``unload_adapter`` refuses new requests for it at once (``UnknownAdapterError``
    for a name not served) and lets those already running finish.
    """

    adapters: Mapping[str, str]

    @property
    def serves_adapters(self) -> bool:
        """Whether this engine was started with LoRA on (``option.enable_lora``)."""
        ...

    async def load_adapter(self, name: str, path: str) -> None: ...

    async def unload_adapter(self, name: str) -> None: ...
