"""Errors as part of the interface: one exception type, rendered in each API family's own format.

Families are chosen by path, so a failure anywhere (middleware, parsing, the engine) answers in the
format the client of that route parses:

    openai       /v1/...         {"error": {"message", "type", "param", "code"}}
    invocations  /invocations    {"generated_text": null, "error", "error_type", "code": <status>}
    tgi          /, /generate_stream   {"error", "error_type"}      (validation is 422, as TGI)
    lmi          everything else {"error", "error_type"}

LMI/TGI bodies also carry ``field`` when one parameter is to blame; OpenAI's carries it as ``param``.
"""

from __future__ import annotations

import math
import re
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.responses import JSONResponse

from neuron_lmi.engine.types import (
    EngineDeadError,
    EngineOverloadedError,
    InvalidRequestError,
    UnknownAdapterError,
)

Family = Literal["openai", "invocations", "tgi", "lmi"]
ErrorKind = Literal[
    "validation",
    "authentication",
    "not_found",
    "payload_too_large",
    "overloaded",
    "unavailable",
    "generation",
]
M = TypeVar("M", bound=BaseModel)

TGI_PATHS = frozenset({"/", "/generate_stream"})
OPENAI_TYPES: dict[str, str] = {
    "validation": "invalid_request_error",
    "payload_too_large": "invalid_request_error",
    "not_found": "not_found_error",
    "authentication": "authentication_error",
    "overloaded": "rate_limit_exceeded",
    "unavailable": "service_unavailable",
    "generation": "server_error",
}
# Pydantic puts union members and wrapper names into ``loc``; they are not field names.
_LOC_NOISE = ("[", "function-", "constrained-", "lax-", "strict-", "json-or-python")
_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "tuple"})
# Request fields are snake_case; CamelCase in a ``loc`` is a model class inside a union.
_MODEL_NAME = re.compile(r"^[A-Z][a-z0-9]+(?:[A-Z][a-z0-9]*)+$")


class ApiError(Exception):
    """A request that cannot be served; ``field`` names the offending parameter when there is one.

    Invariant: ``status`` is a 4xx/5xx HTTP status; ``retry_after_s`` is set only for overload and
    for an engine restarting.
    """

    def __init__(
        self,
        status: int,
        message: str,
        field: str | None = None,
        kind: ErrorKind = "validation",
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.field = field
        self.kind = kind
        self.retry_after_s = retry_after_s


def family_for_path(path: str) -> Family:
    """The error format a route's clients expect."""
    if path.startswith("/v1/"):
        return "openai"
    if path.rstrip("/") == "/invocations":
        return "invocations"
    if path in TGI_PATHS:
        return "tgi"
    return "lmi"


def validation_status(family: Family) -> int:
    """TGI answers invalid parameters with 422; LMI, SageMaker and OpenAI with 400."""
    return 422 if family == "tgi" else 400


def invalid(family: Family, message: str, field: str | None) -> ApiError:
    return ApiError(validation_status(family), message, field, "validation")


def engine_field(field: str | None, family: Family, path: str = "") -> str | None:
    """The engine's parameter name as the client of ``path`` spelled it."""
    if field is None or "." in field:
        return field
    if family == "openai":
        chat = path.endswith("/chat/completions")
        names = {
            "max_new_tokens": "max_tokens",
            "top_n_tokens": "top_logprobs" if chat else "logprobs",
            "prompt_logprobs": "logprobs",
            "inputs": "messages" if chat else "prompt",
            "grammar": "response_format",
            "adapter": "model",
        }
        return names.get(field, field)
    return field if field == "inputs" else f"parameters.{field}"


def from_engine_error(exc: Exception, family: Family, path: str = "") -> ApiError:
    """Map the engine boundary's exceptions onto HTTP: overload is 429 for OpenAI, 503 elsewhere."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, UnknownAdapterError):  # OpenAI: the model does not exist (as vLLM answers)
        return ApiError(404, str(exc), engine_field(exc.field, family, path), "not_found")
    if isinstance(exc, InvalidRequestError):
        field = engine_field(exc.field, family, path)
        message = str(exc)
        if family == "openai" and exc.field and field != exc.field:  # the message says what the client sent
            message = message.replace(exc.field, field or "", 1)
        return invalid(family, message, field)
    if isinstance(exc, EngineOverloadedError):
        status = 429 if family == "openai" else 503
        return ApiError(status, str(exc) or "server overloaded", None, "overloaded", exc.retry_after_s)
    if isinstance(exc, EngineDeadError):
        return ApiError(503, f"engine unavailable: {exc}", None, "unavailable", exc.retry_after_s)
    return ApiError(500, f"generation failed: {type(exc).__name__}: {exc}", None, "generation")


def error_body(family: Family, err: ApiError) -> dict[str, Any]:
    """The JSON body for ``err`` in ``family``'s format."""
    if family == "openai":
        return {
            "error": {
                "message": err.message,
                "type": OPENAI_TYPES.get(err.kind, "invalid_request_error"),
                "param": err.field,
                "code": err.kind if err.kind != "validation" else None,
            }
        }
    body: dict[str, Any] = {"error": err.message, "error_type": err.kind}
    if err.field is not None:
        body["field"] = err.field
    if family == "invocations":
        body = {"generated_text": None, **body, "code": err.status}
    return body


def error_response(family: Family, err: ApiError) -> JSONResponse:
    headers = {}
    if err.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(err.retry_after_s)))
    if err.kind == "authentication":
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(error_body(family, err), status_code=err.status, headers=headers)


def _field_path(loc: tuple[Any, ...]) -> str | None:
    parts: list[str] = []
    for item in loc:
        text = str(item)
        if isinstance(item, str) and (text in _TYPE_NAMES or any(n in text for n in _LOC_NOISE)):
            continue
        if isinstance(item, str) and _MODEL_NAME.match(text):  # a union member's class, not a field
            continue
        parts.append(text)
    return ".".join(parts) or None


def _most_specific(errors: list[Any]) -> Any:
    """The error that says most: a value that failed every member of a union (``inputs: str |
    list[str]``) gets one error per member; the one that went deepest into the value, preferring
    a broken constraint to a wrong type, names the real field (``inputs.1``, not ``inputs``)."""

    def rank(error: Any) -> tuple[int, bool]:
        field = _field_path(tuple(error.get("loc", ()))) or ""
        return (len(field.split(".")) if field else 0, not str(error.get("type", "")).endswith("_type"))

    return max(errors, key=rank)  # max keeps the first of equals: pydantic's own order breaks ties


def from_validation_error(exc: ValidationError, family: Family) -> ApiError:
    """The most specific pydantic error as an ``ApiError`` naming the field path (``parameters.top_p``)."""
    errors = exc.errors(include_url=False)
    first = next((e for e in errors if e.get("type") == "json_invalid"), None) or _most_specific(errors)
    if first.get("type") == "json_invalid":
        return invalid(family, f"request body is not valid JSON: {first.get('msg')}", "body")
    field = _field_path(tuple(first.get("loc", ())))
    message = str(first.get("msg", "invalid value"))
    if first.get("type") == "extra_forbidden":
        message = "unknown field"
    return invalid(family, f"{field or 'body'}: {message}", field or "body")


def parse_body(raw: bytes, model: type[M], family: Family) -> M:
    """Decode and validate a JSON body strictly (no type coercion); every failure names a field."""
    if not raw.strip():
        raise invalid(family, "request body is empty; expected a JSON object", "body")
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise invalid(family, f"request body is not valid UTF-8 (byte {exc.start})", "body") from None
    try:
        return model.model_validate_json(raw, strict=True)
    except ValidationError as exc:
        raise from_validation_error(exc, family) from None
