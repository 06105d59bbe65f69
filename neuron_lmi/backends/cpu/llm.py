"""The synchronous Python API: ``LLM(...).generate(prompts, params)``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial

from neuron_lmi.backends.cpu.engine import CpuEngineOptions, build_cpu_engine_core
from neuron_lmi.config.options import DEFAULT_MODEL
from neuron_lmi.engine.core import EngineCore
from neuron_lmi.engine.detokenizer import TextSink, TokenTexts, text_decoder, text_stream
from neuron_lmi.engine.types import FinishReason, SamplingParams, TokenEvent


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
    """Offline batch generation on the CPU engine; all prompts share the rolling batch."""

    def __init__(self, model: str = DEFAULT_MODEL, **options: object) -> None:
        self.options = CpuEngineOptions(model=model, **options)  # type: ignore[arg-type]
        self.core, self.config = build_cpu_engine_core(self.options)

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
