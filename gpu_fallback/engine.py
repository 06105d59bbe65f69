"""``VllmEngine``: vLLM's asynchronous engine (``AsyncLLM``) behind neuron-lmi's ``Engine`` protocol.

The module imports no vLLM at import time: ``VllmBackend`` does, when an engine starts. Tests in
the main environment give ``VllmEngine`` a stand-in backend to check admission, abort-on-close and
the stats without vLLM.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpu_fallback.config import VllmEngineConfig, engine_args_kwargs, load_chat_template
from gpu_fallback.mapping import delta_to_events, sampling_kwargs
from neuron_lmi.engine.types import (
    EngineDeadError,
    EngineOverloadedError,
    EngineStats,
    InvalidRequestError,
    SamplingParams,
    TokenEvent,
)

log = logging.getLogger(__name__)


@dataclass(slots=True)
class SchedulerSnapshot:
    """vLLM's latest scheduler stats, written by its stat logger after each step."""

    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0


@dataclass(slots=True)
class _Live:
    prompt_tokens: int
    generated: int = 0


class VllmBackend:
    """Everything that touches vLLM itself: build the engine, make sampling params, name its errors."""

    def __init__(self) -> None:
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.exceptions import EngineDeadError as VllmDeadError

        self._sampling_cls = VllmSamplingParams
        self._delta = RequestOutputKind.DELTA
        self.dead_errors: tuple[type[BaseException], ...] = (VllmDeadError,)

    def create(self, kwargs: dict[str, Any], snapshot: SchedulerSnapshot) -> Any:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        return AsyncLLM.from_engine_args(
            AsyncEngineArgs(**kwargs), stat_loggers=[_stat_logger_class(snapshot)]
        )

    def sampling_params(self, kwargs: dict[str, Any]) -> Any:
        return self._sampling_cls(**kwargs, output_kind=self._delta)

    @staticmethod
    def device_count() -> int:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 1


def _stat_logger_class(snapshot: SchedulerSnapshot) -> type:
    from vllm.v1.metrics.loggers import StatLoggerBase

    class SnapshotStatLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.engine_index = engine_index

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0) -> None:
            if scheduler_stats is not None:
                snapshot.running = scheduler_stats.num_running_reqs
                snapshot.waiting = scheduler_stats.num_waiting_reqs
                snapshot.kv_cache_usage = scheduler_stats.kv_cache_usage

        def log_engine_initialized(self) -> None:
            pass

    return SnapshotStatLogger


class VllmEngine:
    """An ``Engine`` on vLLM's ``AsyncLLM``.

    Invariants: ``generate`` validates and admits synchronously (so a refused request never reaches
    vLLM); a request is in ``_active`` from admission until its stream ends or is closed, and a
    stream closed before its last event aborts the request in vLLM. KV rows in use are reported as
    the running sequences, never more than the requests this engine still has open.
    """

    backend_name = "vllm"

    def __init__(self, config: VllmEngineConfig, backend: Any | None = None) -> None:
        self.config = config
        self.model_name = config.served_model_name or Path(config.model).stem
        self.n_positions = config.n_positions or 0
        self.max_batch_size = config.max_rolling_batch_size
        self._backend = backend
        self._llm: Any = None
        self._tokenizer: Any = None
        self._model_dir: Path | None = None
        self._special_ids: frozenset[int] = frozenset()
        self._active: dict[str, _Live] = {}
        self._snapshot = SchedulerSnapshot()
        self._stopping = False

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer, available before ``start()`` (the server reads it when it is built)."""
        self._prepare()
        return self._tokenizer

    def _prepare(self) -> Path:
        """Resolve the model directory (converting a GGUF once), load the tokenizer; idempotent."""
        if self._model_dir is not None:
            return self._model_dir
        import json

        from transformers import AutoTokenizer

        from gpu_fallback.convert import ensure_safetensors_dir

        model_dir = ensure_safetensors_dir(self.config.model)
        tokenizer = AutoTokenizer.from_pretrained(
            str(model_dir), trust_remote_code=self.config.trust_remote_code
        )
        template = load_chat_template(self.config.chat_template)
        if template is not None:
            tokenizer.chat_template = template
        self._tokenizer = tokenizer
        self._special_ids = frozenset(int(i) for i in tokenizer.all_special_ids)
        if not self.n_positions:
            # vLLM's own default, until start() reads the value it settled on.
            hf_config = json.loads((model_dir / "config.json").read_text())
            self.n_positions = int(hf_config.get("max_position_embeddings") or 0)
        self._model_dir = model_dir
        return model_dir

    async def start(self) -> None:
        """Convert the model if needed, then start vLLM (minutes on CPU: it compiles its graphs)."""
        if self._llm is not None:
            return
        backend = self._backend = self._backend or VllmBackend()
        model_dir = await asyncio.to_thread(self._prepare)
        kwargs = engine_args_kwargs(self.config, model_dir, backend.device_count())
        log.info("starting vLLM with %s", kwargs)
        started = time.monotonic()
        # AsyncLLM must be built on the event loop's thread (its ZMQ client binds to the loop).
        self._llm = backend.create(kwargs, self._snapshot)
        log.info("vLLM engine ready in %.1f s", time.monotonic() - started)
        self.n_positions = int(self._llm.model_config.max_model_len)

    async def stop(self, grace_s: float = 10.0) -> None:
        """Refuse new requests, let open ones finish for ``grace_s``, abort the rest, shut vLLM down."""
        self._stopping = True
        deadline = time.monotonic() + grace_s
        while self._active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._llm is None:
            return
        if self._active:
            await self._llm.abort(list(self._active))
        llm, self._llm = self._llm, None
        await asyncio.to_thread(llm.shutdown)

    def _alive(self) -> bool:
        return self._llm is not None and not self._llm.errored

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("inputs must not be empty", "inputs")
            return list(self.tokenizer.encode(prompt))
        ids = list(prompt)
        vocab = len(self.tokenizer)
        if not ids:
            raise InvalidRequestError("inputs must not be empty", "inputs")
        bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad!r} is outside the vocabulary [0, {vocab})", "inputs")
        return ids

    def _admit(self, prompt: str | Sequence[int], params: SamplingParams, request_id: str) -> list[int]:
        if not self._alive():
            raise EngineDeadError("the vLLM engine is not running")
        if self._stopping:
            raise EngineOverloadedError("the server is shutting down", retry_after_s=5.0)
        params.validate(max_new_tokens_limit=self.n_positions - 1)
        ids = self._prompt_ids(prompt)
        if len(ids) + params.max_new_tokens > self.n_positions:
            raise InvalidRequestError(
                f"prompt of {len(ids)} tokens plus max_new_tokens={params.max_new_tokens} exceeds "
                f"n_positions={self.n_positions}",
                "inputs",
            )
        if request_id in self._active:
            raise InvalidRequestError(f"request id {request_id!r} is already running", "request_id")
        if len(self._active) >= self.max_batch_size + self.config.max_queue_size:
            raise EngineOverloadedError(
                f"{len(self._active)} requests open (rolling batch {self.max_batch_size} + queue "
                f"{self.config.max_queue_size})"
            )
        return ids

    def generate(
        self, prompt: str | Sequence[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[TokenEvent]:
        """Validate and admit now (``InvalidRequestError``, ``EngineOverloadedError``); stream later."""
        rid = request_id or uuid.uuid4().hex
        ids = self._admit(prompt, params, rid)
        vparams = self._backend.sampling_params(sampling_kwargs(params))
        return self._stream(rid, ids, vparams, params.top_n_tokens)

    async def _stream(self, rid: str, ids: list[int], vparams: Any, top_n: int) -> AsyncIterator[TokenEvent]:
        # Registered here, not in generate(): a stream that is never iterated never runs its
        # finally, and must not hold a row in the stats.
        live = self._active[rid] = _Live(prompt_tokens=len(ids))
        finished = False
        outputs = self._llm.generate({"prompt_token_ids": ids}, vparams, rid)
        try:
            async for out in outputs:
                events = delta_to_events(
                    rid,
                    live.generated,
                    live.prompt_tokens,
                    out.outputs[0],
                    top_n,
                    self._special_ids,
                    self._decode_one,
                )
                live.generated += sum(1 for e in events if e.token_id >= 0)
                for event in events:
                    finished = finished or event.finish_reason is not None
                    yield event
        except self._backend.dead_errors as exc:
            raise EngineDeadError(f"the vLLM engine died: {exc!r}") from exc
        finally:
            self._active.pop(rid, None)
            # Closing vLLM's generator early aborts the request there (its GeneratorExit path);
            # the explicit abort also covers a generator closed before it started.
            await outputs.aclose()
            if not finished and self._alive():
                await self._llm.abort(rid)

    def _decode_one(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    async def abort(self, request_id: str) -> None:
        if self._llm is not None:
            await self._llm.abort(request_id)

    def stats(self) -> EngineStats:
        open_requests = len(self._active)
        if open_requests == 0:
            running = waiting = 0  # vLLM reports only after a step; an idle engine holds no rows
        else:
            running = min(self._snapshot.running or open_requests, open_requests, self.max_batch_size)
            waiting = open_requests - running
        return EngineStats(
            rows_total=self.max_batch_size,
            rows_used=running,
            positions_used=sum(r.prompt_tokens + r.generated for r in self._active.values()),
            waiting=waiting,
            running=running,
            alive=self._alive(),
            extra={"kv_cache_usage": float(self._snapshot.kv_cache_usage) if open_requests else 0.0},
        )
