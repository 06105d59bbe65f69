"""OpenAI request schemas (completions and chat) and their translation to engine parameters.

Unknown fields are refused by name, as OpenAI does; ``null`` means unset for every field. Fields
OpenAI defines but this server cannot honour (``suffix``: no fill-in-the-middle) are refused by name
too, so a client never gets silently different behaviour. ``top_k``, ``repetition_penalty``,
``ignore_eos``, ``min_p`` and ``min_tokens`` are vLLM's extensions, and so is everything in
``schemas_vllm``; ``response_format`` is translated in ``schemas_grammar``.
OpenAI's ranges hold on every backend (``temperature`` 0–2, vLLM's limit too). Sampling fields
left unset are named in ``SamplingParams.unset`` so a backend with the model's
generation_config.json defaults (vLLM) applies them, as vLLM's server does.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, NonNegativeInt

from neuron_lmi.engine.types import SamplingParams, StopText
from neuron_lmi.server.errors import invalid
from neuron_lmi.server.schema_types import (
    NonEmptyStr,
    PositiveInt,
    RepetitionPenalty,
    RequestModel,
    Seed,
    Stop,
    TokenId,
    TopK,
    TopN,
    TopP,
)
from neuron_lmi.server.schemas_grammar import (
    ResponseFormat,
    parse_logit_bias,
    response_format_grammar,
    structured_outputs_grammar,
)
from neuron_lmi.server.schemas_tools import ToolCallIn, ToolChoice, ToolDefinition
from neuron_lmi.server.schemas_vllm import VllmChatFields, VllmCompletionFields, VllmFields

MAX_N = 16
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
MAX_TEMPERATURE = 2.0
# Request fields a model's generation_config.json may default.
DEFAULTABLE = (
    "temperature",
    "top_p",
    "top_k",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "min_p",
)


class StreamOptions(RequestModel):
    include_usage: bool = False
    continuous_usage_stats: bool = Field(
        default=False, description="Every chunk carries the usage so far (vLLM's extension)."
    )


class _Common(VllmFields):
    model: str | None = None
    max_tokens: PositiveInt | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=MAX_TEMPERATURE)
    top_p: TopP | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Stop | None = None
    seed: Seed | None = None
    presence_penalty: float | None = Field(
        default=None,
        ge=-2.0,
        le=2.0,
        description="Subtracted once from the logit of every token already generated (OpenAI's definition).",
    )
    frequency_penalty: float | None = Field(
        default=None,
        ge=-2.0,
        le=2.0,
        description="Subtracted from a token's logit once per time it was already generated.",
    )
    logit_bias: dict[str, float] | None = Field(
        default=None, description="Token id (as a string) -> bias in [-100, 100] added to its logit."
    )
    user: str | None = None
    top_k: TopK | None = None
    repetition_penalty: RepetitionPenalty | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0, description="EOS is not generated before this many tokens.")
    min_p: float | None = Field(
        default=None,
        ge=0.0,
        le=1.0,
        description="Drop tokens less likely than min_p times the most likely one (0 disables).",
    )
    response_format: ResponseFormat | None = Field(
        default=None, description="Constrain the output to JSON (any object, or one JSON Schema)."
    )

    def unsupported(self) -> dict[str, bool]:
        """Field name -> whether it asks for something this server cannot do."""
        return self.refused()


class CompletionRequest(_Common, VllmCompletionFields):
    prompt: (
        NonEmptyStr
        | Annotated[list[NonEmptyStr], Field(min_length=1)]
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
    )
    logprobs: TopN | None = None
    echo: bool = Field(
        default=False, description="Prepend the prompt (and, with logprobs, its log-probabilities)."
    )
    suffix: str | None = Field(default=None, description="Refused: the model has no fill-in-the-middle.")
    best_of: int | None = Field(
        default=None,
        ge=1,
        description="Generate best_of candidates per prompt and return the n with the highest "
        "cumulative log-probability (best_of >= n; not with stream).",
    )
    max_tokens: NonNegativeInt | None = Field(
        default=None,
        description="Tokens to generate (default 16); 0 only with echo and without stream: the prompt "
        "alone, scored with logprobs (how evaluation harnesses read log-likelihoods).",
    )

    def unsupported(self) -> dict[str, bool]:
        return {
            **super().unsupported(),
            **VllmCompletionFields.refused(self),
            "suffix": self.suffix is not None,
        }

    def scores_prompt_only(self) -> bool:
        """``max_tokens: 0``: nothing is generated (the engine still runs one token, dropped)."""
        if self.max_tokens != 0:
            return False
        if not self.echo or self.stream:
            message = "max_tokens=0 needs echo=true and no stream (the prompt alone is returned)"
            raise invalid("openai", message, "max_tokens")
        return True


class ContentPart(RequestModel):
    type: Literal["text"]
    text: str


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = Field(default=None, description="An assistant's earlier calls.")
    tool_call_id: str | None = Field(default=None, description="The call a tool message answers.")

    def as_template_dict(self) -> dict[str, Any]:
        if isinstance(self.content, list):
            text = "".join(part.text for part in self.content)
        else:
            text = self.content or ""
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": text}


class ChatRequest(_Common, VllmChatFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: TopN | None = None
    tools: list[ToolDefinition] | None = Field(
        default=None, description="Functions the model may call, rendered by the model's chat template."
    )
    tool_choice: ToolChoice | None = Field(
        default=None,
        description="none, auto (the default with tools), required (at least one call), or a named "
        "function; required and named constrain decoding to valid calls.",
    )
    parallel_tool_calls: bool | None = Field(
        default=None, description="false: at most one call per answer (default true)."
    )

    def unsupported(self) -> dict[str, bool]:
        return {**super().unsupported(), **VllmChatFields.refused(self)}


def to_sampling(req: CompletionRequest | ChatRequest, max_tokens: int, top_n: int) -> SamplingParams:
    """Engine parameters for one choice (the route sets ``seed + i`` per choice), as sent: admission
    checks their ranges (``Engine.admit``), and the server names a refused field as the client
    spelled it (``errors.engine_field``)."""
    for name, bad in req.unsupported().items():
        if bad:
            reason = "the model has no fill-in-the-middle support" if name == "suffix" else "this server"
            raise invalid("openai", f"{name} is not supported by {reason}", name)
    if req.response_format is not None and req.structured_outputs is not None:
        message = "response_format and structured_outputs cannot both be set"
        raise invalid("openai", message, "structured_outputs")
    if not 1 <= req.n <= MAX_N:
        raise invalid("openai", f"n must be between 1 and {MAX_N}, got {req.n}", "n")
    if isinstance(req, CompletionRequest) and req.best_of is not None:
        if not req.n <= req.best_of <= MAX_N:
            message = f"best_of must be between n={req.n} and {MAX_N}, got {req.best_of}"
            raise invalid("openai", message, "best_of")
        if req.stream and req.best_of > req.n:
            message = "best_of > n cannot be streamed (candidates are ranked at the end)"
            raise invalid("openai", message, "best_of")
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    return SamplingParams(
        max_new_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_k=0 if req.top_k is None else req.top_k,
        top_p=1.0 if req.top_p is None else req.top_p,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        stop=stop,
        seed=req.seed,
        top_n_tokens=top_n,
        ignore_eos=req.ignore_eos,
        logprobs=bool(req.logprobs) if isinstance(req, ChatRequest) else req.logprobs is not None,
        stream=req.stream,
        unset=frozenset(name for name in DEFAULTABLE if getattr(req, name) is None),
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        logit_bias=parse_logit_bias(req.logit_bias),
        min_tokens=req.min_tokens,
        min_p=req.min_p or 0.0,
        grammar=response_format_grammar(req.response_format)
        or structured_outputs_grammar(req.structured_outputs),
        prompt_logprobs=_prompt_logprobs(req),
        stop_text=StopText.INCLUDE if req.include_stop_str_in_output else StopText.CUT,
        stop_token_ids=tuple(req.stop_token_ids or ()),
        skip_special_tokens=req.skip_special_tokens,
    )


def _prompt_logprobs(req: CompletionRequest | ChatRequest) -> int | None:
    """Completions with ``echo`` and ``logprobs`` score the prompt (with that many alternatives)."""
    if isinstance(req, CompletionRequest) and req.echo and req.logprobs is not None:
        return req.logprobs
    return None


def finish_reason(name: str) -> str:
    """LMI finish reasons in OpenAI's words."""
    return {"eos_token": "stop", "stop_sequence": "stop", "length": "length"}.get(name, "stop")
