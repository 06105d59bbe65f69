"""``/openapi.json``: the request and response bodies of every route, errors included.

Routes read their bodies themselves (strict parsing, errors in each API's format), so FastAPI cannot
infer the schemas; this adds them from the same pydantic models the routes validate with, and the
response models of ``schemas_responses``. Each route lists the statuses it can answer with, in its
API family's error format (``errors.py``). Streams are documented per item: an event stream's
schema is one event's (OpenAPI 3.1), its ``data`` JSON text validated by ``contentSchema``; JSON
lines are read as the array of their values. The fuzz test (tests/server/test_openapi_fuzz.py)
holds the server to this document.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from neuron_lmi.server import schemas_responses as r
from neuron_lmi.server.errors import Family
from neuron_lmi.server.schemas_lmi import LmiRequest
from neuron_lmi.server.schemas_openai import ChatRequest, CompletionRequest

JSON, SSE, JSON_LINES, TEXT = "application/json", "text/event-stream", "application/jsonlines", "text/plain"
REF = "#/components/schemas/{model}"
# Statuses each family answers with besides 200 (validation is 422 for TGI, 400 elsewhere).
ERROR_STATUSES: dict[Family, tuple[int, ...]] = {
    "openai": (400, 401, 404, 413, 429, 500, 503),
    "invocations": (400, 401, 413, 500, 503),
    "lmi": (400, 401, 413, 500, 503),
    "tgi": (401, 413, 422, 500, 503),
}
ERROR_MODELS: dict[Family, type[BaseModel]] = {
    "openai": r.OpenAIError,
    "invocations": r.InvocationsError,
    "lmi": r.LmiError,
    "tgi": r.LmiError,
}


def ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": REF.format(model=model.__name__)}


def one_or_list(model: type[BaseModel]) -> dict[str, Any]:
    return {"anyOf": [ref(model), {"type": "array", "items": ref(model)}]}


def sse(*items: type[BaseModel], done: bool = False) -> dict[str, Any]:
    """Server-sent events, each a JSON ``data`` payload valid against one of ``items`` (OpenAPI 3.1:
    the schema of an event stream is that of one event); ``done``: OpenAI's last ``data: [DONE]``."""
    payload: dict[str, Any] = {
        "type": "string",
        "contentMediaType": JSON,
        "contentSchema": {"anyOf": [ref(m) for m in items]},
    }
    data = {"anyOf": [{"const": "[DONE]"}, payload]} if done else payload
    return {"schema": {"type": "object", "properties": {"data": data}, "required": ["data"]}}


def json_lines(*items: type[BaseModel]) -> dict[str, Any]:
    """JSON lines, read as an array of their values (each valid against one of ``items``)."""
    return {"schema": {"type": "array", "items": {"anyOf": [ref(m) for m in items]}}}


@dataclass(frozen=True, slots=True)
class RouteDoc:
    """One operation: its request model (POST), its 200 bodies by media type, its error family."""

    family: Family
    ok: dict[str, dict[str, Any]]
    request: type[BaseModel] | None = None
    errors: tuple[int, ...] | None = None  # None: the family's ERROR_STATUSES


LMI_OK = {
    JSON: {"schema": one_or_list(r.LmiResponse)},
    JSON_LINES: json_lines(r.LmiStreamLine, r.InvocationsError),
}
TGI_STREAM = sse(r.TgiStreamEvent, r.LmiError)
HEALTH = {JSON: {"schema": ref(r.Health)}}
ROUTES: dict[tuple[str, str], RouteDoc] = {
    ("/v1/chat/completions", "post"): RouteDoc(
        "openai",
        {JSON: {"schema": ref(r.ChatCompletion)}, SSE: sse(r.ChatCompletionChunk, r.OpenAIError, done=True)},
        ChatRequest,
    ),
    ("/v1/completions", "post"): RouteDoc(
        "openai",
        {JSON: {"schema": ref(r.Completion)}, SSE: sse(r.Completion, r.OpenAIError, done=True)},
        CompletionRequest,
    ),
    ("/v1/models", "get"): RouteDoc("openai", {JSON: {"schema": ref(r.ModelList)}}, errors=(401,)),
    ("/invocations", "post"): RouteDoc("invocations", LMI_OK, LmiRequest),
    ("/generate", "post"): RouteDoc("lmi", LMI_OK, LmiRequest),
    ("/", "post"): RouteDoc(
        "tgi", {JSON: {"schema": {"type": "array", "items": ref(r.TgiResponse)}}, SSE: TGI_STREAM}, LmiRequest
    ),
    ("/generate_stream", "post"): RouteDoc("tgi", {SSE: TGI_STREAM}, LmiRequest),
    ("/info", "get"): RouteDoc("lmi", {JSON: {"schema": ref(r.Info)}}, errors=(401,)),
    ("/metrics", "get"): RouteDoc("lmi", {TEXT: {"schema": {"type": "string"}}}, errors=(401,)),
    ("/ping", "get"): RouteDoc("lmi", HEALTH, errors=()),
    ("/health", "get"): RouteDoc("lmi", HEALTH, errors=()),
}
RESPONSE_MODELS: tuple[type[BaseModel], ...] = (
    r.OpenAIError,
    r.LmiError,
    r.InvocationsError,
    r.ChatCompletion,
    r.ChatCompletionChunk,
    r.Completion,
    r.ModelList,
    r.LmiResponse,
    r.LmiStreamLine,
    r.TgiResponse,
    r.TgiStreamEvent,
    r.Info,
    r.Health,
)
STATUS_TEXT = {
    400: "Invalid request: the body names the field",
    401: "Missing or wrong API key (Authorization: Bearer <key>), when the server has one",
    404: "The requested model is not the one served",
    413: "Request body too large",
    422: "Invalid request (TGI's status): the body names the field",
    429: "Overloaded: retry after the Retry-After header",
    500: "Generation failed",
    503: "Overloaded (retry after Retry-After), or the engine is not running",
}


def _responses(doc: RouteDoc) -> dict[str, Any]:
    out: dict[str, Any] = {"200": {"description": "Success", "content": doc.ok}}
    error = {JSON: {"schema": ref(ERROR_MODELS[doc.family])}}
    for status in ERROR_STATUSES[doc.family] if doc.errors is None else doc.errors:
        out[str(status)] = {"description": STATUS_TEXT[status], "content": error}
    if doc.ok is HEALTH:
        out["503"] = {"description": "Not loaded yet, or the engine loop died", "content": HEALTH}
    return out


def build_openapi(app: FastAPI) -> dict[str, Any]:
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    requests = sorted({d.request for d in ROUTES.values() if d.request is not None}, key=lambda m: m.__name__)
    models = [(m, "validation") for m in (*requests, *RESPONSE_MODELS)]
    refs, defs = models_json_schema(models, ref_template=REF)  # type: ignore[arg-type]
    components = schema.setdefault("components", {})
    components.setdefault("schemas", {}).update(defs.get("$defs", {}))
    components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for (path, method), doc in ROUTES.items():
        operation = schema.get("paths", {}).get(path, {}).get(method)
        if operation is None:
            continue
        if doc.request is not None:
            body = refs[(doc.request, "validation")]
            operation["requestBody"] = {"required": True, "content": {JSON: {"schema": body}}}
        operation["responses"] = _responses(doc)
        if 401 in (ERROR_STATUSES[doc.family] if doc.errors is None else doc.errors):
            operation["security"] = [{"bearer": []}, {}]  # the key is needed only when configured
    return schema


def install_openapi(app: FastAPI) -> None:
    """Replace ``app.openapi`` with :func:`build_openapi`, built once."""

    def openapi() -> dict[str, Any]:
        if not app.openapi_schema:
            app.openapi_schema = build_openapi(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
