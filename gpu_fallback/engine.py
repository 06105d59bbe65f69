"""``VllmEngine``: vLLM's asynchronous engine (``AsyncLLM``) behind neuron-lmi's ``Engine`` protocol.

The module imports no vLLM at import time: ``VllmBackend`` does, when an engine starts, after
setting the spawn start method (vLLM would otherwise fork its engine core). Nothing here calls
``torch.cuda``: GPUs are counted through NVML, so this process never initialises CUDA. The engine is
built as vLLM's OpenAI server builds it (``UsageContext.OPENAI_API_SERVER``), non-streaming
requests ask for the final output only, and the model's generation_config.json defaults fill what a
request leaves unset. With ``option.enable_lora`` it serves LoRA adapters
(``engine.protocol.AdapterHost``): each request's adapter becomes vLLM's ``LoRARequest``
(``gpu_fallback.adapters``). Tests in the main environment give ``VllmEngine`` a stand-in backend to check
admission, abort-on-close and the stats without vLLM.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpu_fallback.adapters import VllmAdapters, start_adapters
from gpu_fallback.config import VllmEngineConfig, engine_args_kwargs, load_chat_template, use_spawn
from gpu_fallback.convert import ensure_safetensors_dir
from gpu_fallback.mapping import delta_to_events, prompt_tokens, refusal, sampling_kwargs
from gpu_fallback.metrics import SchedulerSnapshot, VllmMetricsCollector, stat_logger_class
from neuron_lmi.backends.dispatch import cuda_device_count
from neuron_lmi.backends.lora import LoraSettings
from neuron_lmi.engine.admission import (
    HOST_SAMPLING,
    Admission,
    AdmissionLimits,
    Capacity,
    ValidRequest,
    check_accepting,
)
from neuron_lmi.engine.types import (
    EngineDeadError,
    EngineStats,
    InvalidRequestError,
    SamplingParams,
    TokenEvent,
)

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Live:
    prompt_tokens: int
    generated: int = 0


class VllmBackend:
    """Everything that touches vLLM itself: build the engine, make sampling params, name its errors.

    ``client_errors`` are what vLLM raises for a request it refuses (``VLLMClientError``, and the
    ``ValueError``/``TypeError`` of ``SamplingParams``), mapped to 4xx as vLLM's server does.
    """

    def __init__(self) -> None:
        use_spawn(os.environ)  # before vLLM's first import: its engine core must not be forked
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.exceptions import GracefulHTTPError, VLLMClientError
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
        from vllm.v1.engine.exceptions import EngineDeadError as VllmDeadError

        self._sampling_cls = VllmSamplingParams
        self._structured_cls = StructuredOutputsParams
        self._kinds = {True: RequestOutputKind.DELTA, False: RequestOutputKind.FINAL_ONLY}
        self.dead_errors: tuple[type[BaseException], ...] = (VllmDeadError,)
        self.client_errors: tuple[type[BaseException], ...] = (
            VLLMClientError,
            GracefulHTTPError,
            ValueError,
            TypeError,
        )

    def create(self, kwargs: dict[str, Any], snapshot: SchedulerSnapshot) -> Any:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        # The OpenAI server's context: it sizes the prefill budget per step as `vllm serve` does.
        return AsyncLLM.from_engine_args(
            AsyncEngineArgs(**kwargs),
            usage_context=UsageContext.OPENAI_API_SERVER,
            stat_loggers=[stat_logger_class(snapshot)],
        )

    def sampling_params(self, kwargs: dict[str, Any], stream: bool = True) -> Any:
        structured = kwargs.get("structured_outputs")
        if structured is not None:  # mapping gives its keyword arguments
            kwargs = {**kwargs, "structured_outputs": self._structured_cls(**structured)}
        return self._sampling_cls(**kwargs, output_kind=self._kinds[stream])

    @staticmethod
    def lora_request(name: str, lora_id: int, path: str) -> Any:
        """vLLM's ``LoRARequest`` for an adapter (``lora_id`` >= 1: vLLM's own ids start at 1)."""
        from vllm.lora.request import LoRARequest

        return LoRARequest(name, lora_id, path)

    @staticmethod
    def on_cpu() -> bool:
        """Whether vLLM runs on its CPU platform (a CPU build of vLLM)."""
        from vllm.platforms import current_platform

        return bool(current_platform.is_cpu())

    @staticmethod
    def device_count() -> int:
        """Visible CUDA GPUs, counted without initialising CUDA (NVML, ``CUDA_VISIBLE_DEVICES``)."""
        return cuda_device_count(os.environ)[0]


class VllmEngine:
    """An ``Engine`` on vLLM's ``AsyncLLM``.

    Invariants: ``generate`` validates and admits synchronously (so a refused request never reaches
    vLLM); a request is in ``_active`` from admission until its stream ends or is closed, and a
    stream closed before its last event aborts the request in vLLM. KV rows in use are reported as
    the running sequences, never more than the requests this engine still has open.
    """

    backend_name = "vllm"
    model_dtype = None  # /info reports the configuration's

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
        self._adapters: VllmAdapters | None = None  # with option.enable_lora, set by start()
        self.admission: Admission  # set by start(), once vLLM has settled max_model_len
        # The model's sampling defaults (generation_config.json), read from vLLM once it started.
        self.sampling_defaults: dict[str, Any] = {}

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer, available before ``start()`` (the server reads it when it is built)."""
        self._prepare()
        return self._tokenizer

    def _prepare(self) -> Path:
        """Resolve the model directory (converting a GGUF once), load the tokenizer; idempotent."""
        if self._model_dir is not None:
            return self._model_dir

        from transformers import AutoTokenizer  # heavy: only when a model is opened

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
        model_config = self._llm.model_config
        self.n_positions = int(model_config.max_model_len)
        # Admission against what vLLM settled on (``max_model_len`` is known only now).
        lora = self.config.lora
        capabilities = HOST_SAMPLING
        if lora is not None:
            capabilities = dataclasses.replace(
                HOST_SAMPLING, lora_slots=lora.max_loras, lora_rank=lora.max_lora_rank
            )
        limits = AdmissionLimits(
            self.n_positions,
            len(self.tokenizer),
            self.max_batch_size,
            self.config.max_queue_size,
            capabilities,
            "the vLLM backend",
        )
        self.admission = Admission(self.tokenizer.encode, limits)
        if lora is not None:
            await self._start_adapters(lora, model_dir)
        diff = getattr(model_config, "get_diff_sampling_param", None)
        self.sampling_defaults = dict(diff()) if diff is not None else {}
        if self.sampling_defaults:
            log.info("model sampling defaults for unset request fields: %s", self.sampling_defaults)

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

    async def _start_adapters(self, lora: LoraSettings, model_dir: Path) -> None:
        """The adapter table, with the start-up adapters loaded (``ValueError`` naming a bad one)."""
        if self._backend.on_cpu():
            log.warning(
                "LoRA on vLLM's CPU build: a base-model request batched with adapter requests may run "
                "with the last LoRA slot's adapter (vLLM marks 'no adapter' as index -1 in its CPU "
                "LoRA kernels); see docs/lora.md"
            )
        llm = self._llm
        self._adapters = await start_adapters(
            lora, model_dir, self._backend.lora_request, llm.add_lora, llm.remove_lora
        )
        self.admission.adapters = self._adapters.served

    # -- adapters (AdapterHost) ---------------------------------------------------------------
    @property
    def serves_adapters(self) -> bool:
        return self.config.lora is not None

    @property
    def adapters(self) -> Mapping[str, str]:
        """Served adapters: name -> the directory it was read from."""
        return self._adapters.names() if self._adapters is not None else {}

    async def load_adapter(self, name: str, path: str) -> None:
        """Check an adapter and load it into vLLM; raises ``InvalidRequestError`` naming it."""
        if self._adapters is None:
            raise InvalidRequestError("this engine serves no LoRA adapters (option.enable_lora)", "lora_name")
        await self._adapters.register(name, path)

    async def unload_adapter(self, name: str) -> None:
        """Stop serving an adapter at once (``UnknownAdapterError`` if not served); its running
        requests finish, then vLLM frees it."""
        if self._adapters is None:
            raise InvalidRequestError("this engine serves no LoRA adapters (option.enable_lora)", "lora_name")
        await self._adapters.unregister(name)

    def _alive(self) -> bool:
        return self._llm is not None and not self._llm.errored

    def admit(
        self, prompt: str | Sequence[int], params: SamplingParams, request_id: str | None = None
    ) -> ValidRequest:
        """The request's one validation: admission, then vLLM's own limits (temperature <= 2...) as
        vLLM's ``SamplingParams``, which the ``ValidRequest`` carries to ``generate``."""
        check_accepting(self._alive(), self._stopping, "the vLLM engine")
        capacity = Capacity.of_in_flight(len(self._active), self.max_batch_size)
        valid = self.admission.admit(prompt, params, request_id, self._active, capacity)
        try:
            vparams = self._backend.sampling_params(
                sampling_kwargs(params, self.sampling_defaults), params.stream
            )
        except self._backend.client_errors as exc:
            raise refusal(exc) from exc
        return dataclasses.replace(valid, backend_params=vparams)

    def generate(self, request: ValidRequest) -> AsyncIterator[TokenEvent]:
        """Stream an admitted request through vLLM."""
        params = request.params
        return self._stream(
            request.request_id,
            request.prompt_ids,
            request.backend_params,
            params.top_n_tokens,
            params.prompt_logprobs,
            params.adapter,
        )

    def prometheus_collectors(self) -> list[VllmMetricsCollector]:
        """Collectors the server registers beside its own metrics."""
        return [VllmMetricsCollector()]

    async def _stream(
        self,
        rid: str,
        ids: list[int],
        vparams: Any,
        top_n: int,
        prompt_top_n: int | None = None,
        adapter: str | None = None,
    ) -> AsyncIterator[TokenEvent]:
        # Held here, not in generate(), for the same reason as the row below; an adapter unloaded
        # since admission is refused now (404), before anything reaches vLLM.
        adapters = self._adapters
        lora_request = adapters.hold(adapter) if adapter is not None and adapters is not None else None
        # Registered here, not in generate(): a stream that is never iterated never runs its
        # finally, and must not hold a row in the stats.
        live = self._active[rid] = _Live(prompt_tokens=len(ids))
        finished = False
        outputs = self._llm.generate({"prompt_token_ids": ids}, vparams, rid, lora_request=lora_request)
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
                if prompt_top_n is not None and events and live.generated == 0:  # the scored prompt
                    scored = prompt_tokens(ids, out.prompt_logprobs, prompt_top_n, self._decode_one)
                    events[0] = dataclasses.replace(events[0], prompt=scored)
                live.generated += sum(1 for e in events if e.token_id >= 0)
                for event in events:
                    finished = finished or event.finish_reason is not None
                    yield event
        except self._backend.dead_errors as exc:
            raise EngineDeadError(f"the vLLM engine died: {exc!r}") from exc
        except self._backend.client_errors as exc:
            if live.generated:
                raise
            # Refused when added (a prompt vLLM will not take): nothing runs, nothing to abort.
            finished = True
            raise refusal(exc) from exc
        finally:
            self._active.pop(rid, None)
            # Closing vLLM's generator early aborts the request there (its GeneratorExit path);
            # the explicit abort also covers a generator closed before it started.
            await outputs.aclose()
            if not finished and self._alive():
                await self._llm.abort(rid)
            if lora_request is not None and adapters is not None:
                await adapters.release(lora_request)

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
