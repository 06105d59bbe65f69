"""Calling a deployed endpoint: ``invoke_endpoint`` and ``invoke_endpoint_with_response_stream``.

The streaming response is LMI's JSON lines (one ``{"token": {...}}`` object per line, the last one
adding ``generated_text`` and ``details``) cut into ``PayloadPart`` events at arbitrary byte
offsets: a part may end in the middle of a line, of a JSON string, or of a multi-byte UTF-8
character. :class:`JsonLinesDecoder` buffers bytes and decodes only complete lines.

:func:`generate` continues a generation while the server stops with ``finish_reason == "length"``,
sending the prompt plus the text so far, up to ``max_rounds`` calls.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any


class EndpointError(RuntimeError):
    """The endpoint reported an error: a stream error event or an LMI error object."""


class JsonLinesDecoder:
    """Bytes in, complete JSON objects out. Blank lines and ``\\r\\n`` endings are accepted."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[Any]:
        self._buffer += data
        *lines, rest = self._buffer.split(b"\n")
        self._buffer = bytearray(rest)
        return [self._decode(line) for line in lines if line.strip()]

    def close(self) -> list[Any]:
        """Whatever the last line held when the stream ended without a newline."""
        rest, self._buffer = bytes(self._buffer), bytearray()
        return [self._decode(rest)] if rest.strip() else []

    @staticmethod
    def _decode(line: bytes) -> Any:
        try:
            return json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise EndpointError(f"malformed JSON line in stream: {line[:120]!r}") from exc


def iter_stream_objects(events: Iterable[dict[str, Any]]) -> Iterator[Any]:
    """Decode a ``invoke_endpoint_with_response_stream`` event stream into JSON objects."""
    decoder = JsonLinesDecoder()
    for event in events:
        if "PayloadPart" in event:
            yield from decoder.feed(event["PayloadPart"].get("Bytes", b""))
        for kind in ("ModelStreamError", "InternalStreamFailure"):
            if kind in event:
                error = event[kind]
                raise EndpointError(
                    f"{kind} {error.get('ErrorCode', '')}: {error.get('Message', '')}".strip()
                )
    yield from decoder.close()


def _check(obj: Any) -> dict[str, Any]:
    if isinstance(obj, list) and obj:
        obj = obj[0]
    if not isinstance(obj, dict):
        raise EndpointError(f"unexpected response: {str(obj)[:120]!r}")
    if obj.get("error") is not None:
        raise EndpointError(f"{obj.get('code', '')} {obj['error']}".strip())
    return obj


def _target(endpoint: str, component: str | None) -> dict[str, str]:
    target = {"EndpointName": endpoint}
    if component:
        target["InferenceComponentName"] = component
    return target


def invoke(
    runtime: Any, endpoint: str, payload: dict[str, Any], component: str | None = None
) -> dict[str, Any]:
    """One ``invoke_endpoint`` call with a JSON body; returns the decoded response object."""
    response = runtime.invoke_endpoint(
        **_target(endpoint, component),
        ContentType="application/json",
        Accept="application/json",
        Body=json.dumps(payload).encode(),
    )
    return _check(json.loads(response["Body"].read()))


def invoke_stream(
    runtime: Any, endpoint: str, payload: dict[str, Any], component: str | None = None
) -> Iterator[dict[str, Any]]:
    """One ``invoke_endpoint_with_response_stream`` call; yields each JSON-lines object."""
    response = runtime.invoke_endpoint_with_response_stream(
        **_target(endpoint, component),
        ContentType="application/json",
        Body=json.dumps({**payload, "stream": True}).encode(),
    )
    for obj in iter_stream_objects(response["Body"]):
        yield _check(obj)


@dataclass(frozen=True, slots=True)
class Generation:
    """The text of all rounds, the last round's finish reason, and how many calls it took."""

    text: str
    finish_reason: str | None
    generated_tokens: int
    rounds: int


def _round_result(final: dict[str, Any]) -> tuple[str, str | None, int]:
    if final.get("generated_text") is None:
        raise EndpointError("response has no generated_text")
    details = final.get("details") or {}
    return (
        str(final["generated_text"]),
        details.get("finish_reason"),
        int(details.get("generated_tokens") or 0),
    )


def generate(
    runtime: Any,
    endpoint: str,
    prompt: str,
    parameters: dict[str, Any] | None = None,
    *,
    stream: bool = False,
    max_rounds: int = 4,
    component: str | None = None,
    on_text: Callable[[str], None] | None = None,
) -> Generation:
    """Generate, then continue while ``finish_reason == "length"`` (at most ``max_rounds`` calls).

    Each round sends ``prompt + text so far`` with ``details: true`` (needed for the finish reason).
    With ``stream`` every token's text goes to ``on_text`` as it arrives.
    """
    if max_rounds < 1:
        raise ValueError(f"max_rounds={max_rounds}: must be >= 1")
    params = {**(parameters or {}), "details": True}
    text, reason, tokens, rounds = "", None, 0, 0
    while rounds < max_rounds:
        rounds += 1
        payload = {"inputs": prompt + text, "parameters": params}
        if stream:
            final: dict[str, Any] | None = None
            for obj in invoke_stream(runtime, endpoint, payload, component):
                token = obj.get("token") or {}
                if on_text is not None and token.get("text"):
                    on_text(str(token["text"]))
                if "generated_text" in obj:
                    final = obj
            if final is None:
                raise EndpointError("stream ended without a final generated_text line")
        else:
            final = invoke(runtime, endpoint, payload, component)
            if on_text is not None:
                on_text(str(final.get("generated_text") or ""))
        piece, reason, count = _round_result(final)
        text += piece
        tokens += count
        if reason != "length":
            break
    return Generation(text, reason, tokens, rounds)
