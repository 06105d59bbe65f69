"""The one boundary between the HTTP server and whatever generates tokens.

The CPU/Neuron rolling-batch engine (``neuron_lmi.engine.async_engine.AsyncEngine``) and the vLLM
adapter (``gpu_fallback``) both implement it; the server sees nothing else.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol, runtime_checkable

from neuron_lmi.engine.types import EngineStats, SamplingParams, TokenEvent


@runtime_checkable
class Engine(Protocol):
    """An asynchronous token generator.

    Invariants: ``generate`` validates before anything is queued (``InvalidRequestError``), refuses
    with ``EngineOverloadedError`` when its bounded queue is full, yields events in order and ends
    after the event carrying ``finish_reason``. Closing the iterator early (a client disconnect)
    aborts the request and frees its KV row.
    """

    model_name: str
    n_positions: int
    max_batch_size: int
    backend_name: str

    @property
    def tokenizer(self) -> Any:
        """A Hugging Face tokenizer (chat template, token counting)."""
        ...

    async def start(self) -> None: ...

    async def stop(self, grace_s: float = 10.0) -> None: ...

    def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
    ) -> AsyncIterator[TokenEvent]: ...

    async def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats: ...
