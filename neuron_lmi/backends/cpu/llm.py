"""The synchronous Python API: ``LLM(...).generate(prompts, params)``, configured as ``serve`` is.

``LLM(model, **options)`` resolves its configuration through ``config.load_config``, as
``neuron-lmi serve`` does: the keyword arguments (LMI's names: ``max_rolling_batch_size``,
``n_positions``, ``dtype``, ``quantize``, ``enforce_eager``, ``tensor_parallel_degree``..., or
``option.*`` keys) are the highest-precedence source, then ``properties`` (a serving.properties file
or its folder; unset: the SageMaker model folder's, when present), then ``env`` (default
``os.environ``: ``OPTION_*``, ``HF_MODEL_ID``...), then the configuration's defaults. As with vLLM's
``LLM``, the library runs what the server runs: the host's dtype and the compiled graphs unless told
otherwise (``dtype="fp32"``, ``enforce_eager=True``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from neuron_lmi.backends.cpu.engine import CpuEngineOptions, build_cpu_engine_core
from neuron_lmi.config import load_config
from neuron_lmi.config.options import ROLLING_BATCH_REQUESTS
from neuron_lmi.engine.core import EngineCore
from neuron_lmi.engine.detokenizer import TextSink, TokenTexts, text_decoder, text_stream
from neuron_lmi.engine.types import FinishReason, SamplingParams, TokenEvent

if TYPE_CHECKING:
    from neuron_lmi.config import ResolvedConfig

log = logging.getLogger(__name__)


def config_keys(model: str | Path | None, options: Mapping[str, object]) -> dict[str, object]:
    """Keyword arguments as ``load_config``'s highest-precedence source: ``model`` is
    ``option.model_id``, and ``dtype="auto"`` counts as unset (the host's dtype, or a lower source's)."""
    keys = dict(options)
    if model is not None:
        keys["model_id"] = str(model)
    dtype = keys.get("dtype")
    if isinstance(dtype, str) and dtype.strip().lower() == "auto":
        keys["dtype"] = None
    return keys


@dataclass(slots=True)
class Completion:
    """One finished generation."""

    request_id: str
    prompt_tokens: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    events: list[TokenEvent] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None


class LLM:
    """Offline batch generation on the CPU engine; all prompts share the rolling batch.

    ``options`` is the engine's view of the resolved configuration (``CpuEngineOptions``) and
    ``config`` the model's own; an unknown keyword or a bad value is a ``ConfigError`` naming it.
    """

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        properties: str | Path | None = None,
        env: Mapping[str, str] | None = None,
        **options: object,
    ) -> None:
        env = os.environ if env is None else env
        self._start(_cpu_view(load_config(config_keys(model, options), properties, env), env))

    @classmethod
    def from_config(cls, resolved: ResolvedConfig, env: Mapping[str, str] | None = None) -> LLM:
        """The engine for a configuration already resolved (``neuron-lmi generate``)."""
        return cls.from_options(_cpu_view(resolved, env))

    @classmethod
    def from_options(cls, options: CpuEngineOptions) -> LLM:
        """The engine for options already made (``dataclasses.replace`` of a resolved view)."""
        llm = cls.__new__(cls)
        llm._start(options)
        return llm

    def _start(self, options: CpuEngineOptions) -> None:
        self.options = options
        self.core, self.config = build_cpu_engine_core(options)

    @classmethod
    def from_core(cls, core: EngineCore) -> LLM:
        llm = cls.__new__(cls)
        llm.core = core
        return llm

    @property
    def tokenizer(self) -> object:
        return self.core.tokenizer

    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[Completion]:
        """Run every prompt to completion; results are in the order of ``prompts``."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        batch = list(prompts)  # type: ignore[arg-type]
        param_list = (
            list(params) if isinstance(params, list | tuple) else [params or SamplingParams()] * len(batch)
        )
        if len(param_list) != len(batch):
            raise ValueError(f"{len(batch)} prompts but {len(param_list)} sampling parameter sets")
        completions: list[Completion] = []
        stopped: list[str] = []  # ended by a stop sequence here: aborted in the core after the step
        skipping, texts = text_decoder(self.core.tokenizer), TokenTexts(self.core.tokenizer)
        for prompt, p in zip(batch, param_list, strict=True):
            completion = Completion(request_id="", prompt_tokens=0)
            request = self.core.make_request(prompt, p)
            text = text_stream(self.core.tokenizer, request.prompt_ids, p, skipping)
            stop = partial(stopped.append, request.request_id)
            request.sink = TextSink(text, texts, _collector(completion), stop)
            completion.request_id, completion.prompt_tokens = request.request_id, len(request.prompt_ids)
            completions.append(completion)
            self.core.add(request)
        while self.core.has_work():
            self.core.step()
            while stopped:
                self.core.abort(stopped.pop())
        return completions


def _collector(completion: Completion):
    def sink(event: TokenEvent) -> None:
        completion.events.append(event)
        if event.token_id >= 0:
            completion.token_ids.append(event.token_id)
            completion.logprobs.append(event.logprob)
        completion.text += event.text
        if event.finish_reason is not None:
            completion.finish_reason = event.finish_reason
            completion.error = event.error

    return sink


def _cpu_view(resolved: ResolvedConfig, env: Mapping[str, str] | None) -> CpuEngineOptions:
    """The CPU engine's options for ``resolved``; a configuration that asks for another backend
    (``option.backend``, ``option.rolling_batch``) is still run here, with a warning."""
    cfg = resolved.config
    asked = cfg.backend.backend
    if asked == "auto":
        asked = ROLLING_BATCH_REQUESTS[cfg.batching.rolling_batch]
    if asked not in ("auto", "cpu"):
        log.warning("LLM runs the CPU engine: the configuration's backend %r is not used here", asked)
    return CpuEngineOptions.from_config(resolved, env)
