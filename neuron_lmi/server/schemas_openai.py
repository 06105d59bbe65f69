"""OpenAI request schemas (completions and chat) and their translation to engine parameters.

Unknown fields are refused by name, as OpenAI does. Fields OpenAI defines but this server cannot
honour (``tools``, penalties, ``logit_bias``...) are accepted only at their neutral value, so a
client never gets silently different behaviour. ``top_k``, ``repetition_penalty`` and
``ignore_eos`` are vLLM's extensions.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from neuron_lmi.engine.types import InvalidRequestError, SamplingParams
from neuron_lmi.server.errors import invalid

MAX_N = 16
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False

    def unsupported(self) -> dict[str, bool]:
        """Field name -> whether it asks for something this server cannot do."""
        return {
            "presence_penalty": self.presence_penalty not in (None, 0.0),
            "frequency_penalty": self.frequency_penalty not in (None, 0.0),
            "logit_bias": bool(self.logit_bias),
        }


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> dict[str, bool]:
        return {
            **super().unsupported(),
            "suffix": self.suffix is not None,
            "best_of": self.best_of not in (None, 1, self.n),
            "echo": self.echo and self.logprobs is not None,
        }


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def as_template_dict(self) -> dict[str, Any]:
        if isinstance(self.content, list):
            text = "".join(part.text for part in self.content)
        else:
            text = self.content or ""
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": text}


class ChatRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def unsupported(self) -> dict[str, bool]:
        fmt = (self.response_format or {}).get("type", "text")
        return {
            **super().unsupported(),
            "tools": bool(self.tools),
            "tool_choice": self.tool_choice not in (None, "none", "auto"),
            "response_format": fmt != "text",
        }


# SamplingParams field -> the OpenAI name a client would recognise in an error.
_FIELD_NAMES = {"max_new_tokens": "max_tokens", "top_n_tokens": "logprobs"}


def to_sampling(
    req: CompletionRequest | ChatRequest,
    max_tokens: int,
    top_n: int,
    limit: int,
) -> SamplingParams:
    """Engine parameters for one choice (the route sets ``seed + i`` per choice)."""
    for name, bad in req.unsupported().items():
        if bad:
            raise invalid("openai", f"{name} is not supported by this server", name)
    if not 1 <= req.n <= MAX_N:
        raise invalid("openai", f"n must be between 1 and {MAX_N}, got {req.n}", "n")
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    params = SamplingParams(
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
    )
    try:
        params.validate(limit)
    except InvalidRequestError as exc:
        raw = exc.field or "body"
        name = _FIELD_NAMES.get(raw, raw)
        if isinstance(req, ChatRequest) and raw == "top_n_tokens":
            name = "top_logprobs"
        if isinstance(req, ChatRequest) and raw == "max_new_tokens" and req.max_completion_tokens is not None:
            name = "max_completion_tokens"
        raise invalid("openai", str(exc).replace(raw, name, 1), name) from None
    return params


def finish_reason(name: str) -> str:
    """LMI finish reasons in OpenAI's words."""
    return {"eos_token": "stop", "stop_sequence": "stop", "length": "length"}.get(name, "stop")
