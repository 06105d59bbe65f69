"""Request-body schemas in ``/openapi.json``.

Routes read their bodies themselves (strict parsing, errors in each API's format), so FastAPI cannot
infer the schemas; this adds them from the same pydantic models the routes validate with.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from neuron_lmi.server.schemas_lmi import LmiRequest
from neuron_lmi.server.schemas_openai import ChatRequest, CompletionRequest

REQUEST_MODELS: dict[str, type[BaseModel]] = {
    "/invocations": LmiRequest,
    "/generate": LmiRequest,
    "/": LmiRequest,
    "/generate_stream": LmiRequest,
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatRequest,
}


def install_openapi(app: FastAPI) -> None:
    """Replace ``app.openapi`` with one that documents each POST route's request body."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        models = sorted(set(REQUEST_MODELS.values()), key=lambda m: m.__name__)
        refs, defs = models_json_schema(
            [(m, "validation") for m in models], ref_template="#/components/schemas/{model}"
        )
        schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
        for path, model in REQUEST_MODELS.items():
            post = schema.get("paths", {}).get(path, {}).get("post")
            if post is not None:
                body_schema = refs[(model, "validation")]
                post["requestBody"] = {
                    "required": True,
                    "content": {"application/json": {"schema": body_schema}},
                }
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
