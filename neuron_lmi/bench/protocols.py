"""Request bodies and response parsers for the three wire formats the load generator speaks.

* ``openai``: ``/v1/chat/completions`` or ``/v1/completions``; streaming is server-sent events
  (``data: {...}`` lines, ``data: [DONE]`` at the end); the token count comes from the final usage
  chunk that ``stream_options.include_usage`` asks for.
* ``tgi``: ``/generate`` and ``/generate_stream``; streaming is server-sent events whose data is
  ``{"token": {...}, "generated_text": null|str, "details": null|{...}}``.
* ``lmi``: ``/invocations`` with ``"stream": true``; JSON lines, one ``{"token": {...}}`` object per
  token, the last adding ``generated_text`` (and ``details`` when asked for).

Parsers are fed one line at a time (the HTTP client re-assembles lines across network chunks) and
return a :class:`Chunk` or ``None`` for lines that carry nothing (blank lines, SSE comments).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

from neuron_lmi.bench.workload import BenchRequest


class ServerError(Exception):
    """The server reported an error inside a 200 response (an error event or error object)."""


@dataclass(slots=True)
class Chunk:
    """What one line (or one whole non-streamed response) carried."""

    text: str = ""
    tokens: int = 0  # tokens this chunk delivered as seen on the wire (0 for role/usage-only chunks)
    reported_output_tokens: int | None = None  # from usage or details, authoritative when present
    reported_prompt_tokens: int | None = None
    finish_reason: str | None = None
    done: bool = False


class StreamParser(Protocol):
    def feed(self, line: str) -> Chunk | None: ...


@dataclass(frozen=True, slots=True)
class RequestOptions:
    """Options common to every request of a run."""

    models: tuple[str, ...] = ()  # OpenAI ``model``: request i asks for models[i % len] (adapters)
    ignore_eos: bool = False
    openai_endpoint: str = "chat"  # chat | completions


def _loads(payload: str) -> Any:
    try:
        return json.loads(payload)
    except json.JSONDecodeError as exc:
        raise ServerError(f"malformed JSON in stream: {payload[:80]!r}") from exc


def _sse_data(line: str) -> str | None:
    """The payload of an SSE ``data:`` line; None for blank, comment and other field lines."""
    if not line.startswith("data:"):
        return None
    payload = line[5:]
    return payload[1:] if payload.startswith(" ") else payload


def _error_text(obj: dict[str, Any]) -> str | None:
    error = obj.get("error")
    if error is None:
        return None
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error)


class OpenAIStreamParser:
    def feed(self, line: str) -> Chunk | None:
        payload = _sse_data(line)
        if payload is None:
            return None
        if payload.strip() == "[DONE]":
            return Chunk(done=True)
        obj = _loads(payload)
        if (error := _error_text(obj)) is not None:
            raise ServerError(error)
        chunk = Chunk()
        usage = obj.get("usage") or {}
        chunk.reported_output_tokens = usage.get("completion_tokens")
        chunk.reported_prompt_tokens = usage.get("prompt_tokens")
        for choice in obj.get("choices") or []:
            delta = choice.get("delta")
            piece = (delta or {}).get("content") if delta is not None else choice.get("text")
            if piece:
                chunk.text += piece
                chunk.tokens += 1
            chunk.finish_reason = choice.get("finish_reason") or chunk.finish_reason
        return chunk


class _TokenObjectParser:
    """TGI and LMI streams carry the same objects; they differ only in framing (SSE vs lines)."""

    sse: bool = False

    def feed(self, line: str) -> Chunk | None:
        payload = _sse_data(line) if self.sse else (line if line.strip() else None)
        if payload is None:
            return None
        return _token_object(_loads(payload))


class TGIStreamParser(_TokenObjectParser):
    sse = True


class LMIStreamParser(_TokenObjectParser):
    sse = False


def _token_object(obj: Any) -> Chunk:
    if not isinstance(obj, dict):
        raise ServerError(f"unexpected stream object: {str(obj)[:80]!r}")
    if (error := _error_text(obj)) is not None:
        raise ServerError(error)
    chunk = Chunk()
    token = obj.get("token")
    if isinstance(token, dict):
        chunk.text = str(token.get("text") or "")
        chunk.tokens = 1
    if obj.get("generated_text") is not None:
        chunk.done = True
        details = obj.get("details") or {}
        chunk.reported_output_tokens = details.get("generated_tokens")
        chunk.finish_reason = details.get("finish_reason")
    return chunk


def _whole_response(obj: Any, api: str) -> Chunk:
    """Parse a non-streamed response body into one Chunk with ``done`` set."""
    if isinstance(obj, list) and obj:
        obj = obj[0]
    if not isinstance(obj, dict):
        raise ServerError(f"unexpected response: {str(obj)[:80]!r}")
    if (error := _error_text(obj)) is not None:
        raise ServerError(error)
    chunk = Chunk(done=True)
    if api == "openai":
        choice = (obj.get("choices") or [{}])[0]
        chunk.text = str((choice.get("message") or {}).get("content") or choice.get("text") or "")
        chunk.finish_reason = choice.get("finish_reason")
        usage = obj.get("usage") or {}
        chunk.reported_output_tokens = usage.get("completion_tokens")
        chunk.reported_prompt_tokens = usage.get("prompt_tokens")
    else:
        if obj.get("generated_text") is None:
            raise ServerError(f"response without generated_text: {str(obj)[:80]!r}")
        chunk.text = str(obj["generated_text"])
        details = obj.get("details") or {}
        chunk.reported_output_tokens = details.get("generated_tokens")
        chunk.finish_reason = details.get("finish_reason")
    return chunk


class Api:
    """One wire format: where to send, what to send, how to read the answer."""

    def __init__(self, name: str, options: RequestOptions) -> None:
        if name not in ("openai", "lmi", "tgi"):
            raise ValueError(f"--api {name!r}: expected openai, lmi or tgi")
        if options.openai_endpoint not in ("chat", "completions"):
            raise ValueError(f"openai endpoint {options.openai_endpoint!r}: expected chat or completions")
        self.name = name
        self.options = options

    def path(self, stream: bool) -> str:
        if self.name == "openai":
            return "/v1/chat/completions" if self.options.openai_endpoint == "chat" else "/v1/completions"
        if self.name == "tgi":
            return "/generate_stream" if stream else "/generate"
        return "/invocations"

    def body(self, request: BenchRequest, stream: bool) -> dict[str, Any]:
        opts = self.options
        if self.name == "openai":
            body: dict[str, Any] = {"max_tokens": request.max_tokens, "stream": stream}
            if opts.openai_endpoint == "chat":
                body["messages"] = [{"role": "user", "content": request.prompt}]
            else:
                body["prompt"] = request.prompt
            if opts.models:
                body["model"] = opts.models[request.index % len(opts.models)]
            if stream:
                body["stream_options"] = {"include_usage": True}
            if opts.ignore_eos:
                body["ignore_eos"] = True  # vLLM's extension; strict OpenAI servers reject it
            return body
        params: dict[str, Any] = {"max_new_tokens": request.max_tokens, "details": True}
        if opts.ignore_eos:
            params["ignore_eos"] = True
        body = {"inputs": request.prompt, "parameters": params}
        if self.name == "lmi":
            body["stream"] = stream
        return body

    def stream_parser(self) -> StreamParser:
        if self.name == "openai":
            return OpenAIStreamParser()
        return TGIStreamParser() if self.name == "tgi" else LMIStreamParser()

    def parse_response(self, obj: Any) -> Chunk:
        return _whole_response(obj, self.name)
