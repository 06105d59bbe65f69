"""The response bodies every route returns, as pydantic models for ``/openapi.json``.

Routes build their responses as plain dicts (fast, and shaped by each API's conventions); these
models describe those dicts, and the fuzz test (tests/server/test_openapi_fuzz.py) validates every
response the server gives against them, each streamed event and JSON line included. Error bodies
follow ``errors.py``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Doc(BaseModel):
    """Exactly the keys the server sends (``additionalProperties: false``), so drift is caught."""

    model_config = ConfigDict(extra="forbid")


# -- errors ----------------------------------------------------------------------------------------


class OpenAIErrorDetail(_Doc):
    message: str
    type: str = Field(description="invalid_request_error, not_found_error, rate_limit_exceeded, ...")
    param: str | None = Field(description="The offending field (a dotted path), when one is to blame.")
    code: str | None


class OpenAIError(_Doc):
    error: OpenAIErrorDetail


class LmiError(_Doc):
    """LMI and TGI errors (``/generate``, ``/``, ``/generate_stream``)."""

    error: str
    error_type: str = Field(description="validation, authentication, payload_too_large, overloaded, ...")
    field: str | None = Field(default=None, description="The offending field, when one is to blame.")


class InvocationsError(LmiError):
    """SageMaker's ``/invocations`` error: LMI's, plus the status and a null ``generated_text``."""

    generated_text: None = None
    code: int


# -- OpenAI ----------------------------------------------------------------------------------------

FinishReasonName = Literal["stop", "length", "tool_calls"]


class Usage(_Doc):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(_Doc):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Doc):
    content: list[TokenLogprob]


class ToolCallFunctionOut(_Doc):
    name: str
    arguments: str = Field(description="JSON text of an object.")


class ToolCallOut(_Doc):
    id: str
    type: Literal["function"]
    function: ToolCallFunctionOut


REASONING = "The thinking, with option.reasoning_parser (null when none, or include_reasoning false)."
REASONING_CONTENT = "The same as reasoning (vLLM's older, deprecated name)."


class ChatResponseMessage(_Doc):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCallOut] | None = None
    reasoning: str | None = Field(default=None, description=REASONING)
    reasoning_content: str | None = Field(default=None, description=REASONING_CONTENT)


class ChatChoice(_Doc):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReasonName


class _OpenAIHead(_Doc):
    id: str
    created: int
    model: str
    system_fingerprint: str


class ChatCompletion(_OpenAIHead):
    object: Literal["chat.completion"]
    choices: list[ChatChoice]
    usage: Usage


class ToolCallDelta(_Doc):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: ToolCallFunctionOut | dict[str, str] = Field(description="name and/or a piece of arguments")


class ChatDelta(_Doc):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None
    reasoning: str | None = Field(default=None, description="A piece of the thinking (before any content).")
    reasoning_content: str | None = Field(default=None, description=REASONING_CONTENT)


class ChatChunkChoice(_Doc):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReasonName | None


class ChatCompletionChunk(_OpenAIHead):
    """One ``data:`` event; the stream ends with ``data: [DONE]``. With ``include_usage`` every chunk
    has ``usage`` (null, or with ``continuous_usage_stats`` its choice's usage so far) and the last
    one has no choices and the totals."""

    object: Literal["chat.completion.chunk"]
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(_Doc):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(_Doc):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReasonName | None


class Completion(_OpenAIHead):
    """The response, and (with ``stream``) each ``data:`` event, which has ``finish_reason`` null until
    the last of its choice."""

    object: Literal["text_completion"]
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(_Doc):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int
    # A LoRA adapter's card: the base model it adapts, and where the adapter was read from.
    parent: str | None = None
    root: str | None = None


class ModelList(_Doc):
    object: Literal["list"]
    data: list[ModelCard]


# -- LMI and TGI -----------------------------------------------------------------------------------


class LmiToken(_Doc):
    id: int
    text: str
    log_prob: float | None
    special_token: bool


class PrefillToken(_Doc):
    id: int
    text: str
    log_prob: float | None = None
    logprob: float | None = None


class LmiDetails(_Doc):
    finish_reason: str
    generated_tokens: int
    inputs: str
    tokens: list[LmiToken]
    top_tokens: list[list[LmiToken]] | None = None
    prefill: list[PrefillToken] | None = None


class LmiResponse(_Doc):
    generated_text: str
    details: LmiDetails | None = None


class LmiStreamLine(_Doc):
    """One JSON line of an LMI stream; the last adds ``generated_text`` (and ``details``)."""

    token: LmiToken | None = None
    top_tokens: list[LmiToken] | None = None
    generated_text: str | None = None
    details: LmiDetails | None = None


class TgiToken(_Doc):
    id: int
    text: str
    logprob: float | None
    special: bool


class _TgiGenerationDetails(_Doc):
    finish_reason: str
    generated_tokens: int
    seed: int | None
    prefill: list[PrefillToken]
    tokens: list[TgiToken]
    top_tokens: list[list[TgiToken]] | None


class TgiSequence(_TgiGenerationDetails):
    """One of ``best_of_sequences``: a candidate that was not chosen, with its own details."""

    generated_text: str


class TgiDetails(_TgiGenerationDetails):
    best_of_sequences: list[TgiSequence] | None


class TgiResponse(_Doc):
    generated_text: str
    details: TgiDetails


class TgiStreamDetails(_Doc):
    finish_reason: str
    generated_tokens: int
    seed: int | None
    input_length: int


class TgiStreamEvent(_Doc):
    """One ``data:`` event of ``/generate_stream`` (or ``/`` with ``stream``)."""

    index: int
    token: TgiToken
    top_tokens: list[TgiToken] | None
    generated_text: str | None
    details: TgiStreamDetails | None


class Health(_Doc):
    status: Literal["healthy", "unhealthy"]
    reason: str | None = None


class Info(_Doc):
    """TGI's ``/info``."""

    model_id: str
    model_sha: str | None
    model_dtype: str
    model_device_type: str
    model_pipeline_tag: str
    max_concurrent_requests: int
    max_best_of: int
    max_stop_sequences: int
    max_input_tokens: int
    max_input_length: int
    max_total_tokens: int
    max_batch_size: int
    validation_workers: int
    max_client_batch_size: int
    router: str
    version: str
    sha: str | None
    docker_label: str | None
    supported_parameters: dict[str, list[str]] = Field(description="Request fields each API accepts.")
