"""LoRA adapters loaded and unloaded at run time, in vLLM's and LMI's shapes.

    vLLM   POST /v1/load_lora_adapter   {"lora_name", "lora_path"}    200 text / 400 / 404
           POST /v1/unload_lora_adapter {"lora_name"}
    LMI    POST /adapters               name, src (query parameters or JSON)
           GET  /adapters               {"adapters": [{"name", "src"}]}
           DELETE /adapters/{name}

A request then picks an adapter by name: OpenAI's ``model``, LMI's ``parameters.adapters``, TGI's
``parameters.adapter_id``. The engine does the work (``engine.protocol.AdapterHost``); an engine
that serves no adapters answers 400. An adapter's source is fetched here first (a local directory,
``s3://`` or a Hub id, as a model is) so the engine process reads a local directory.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse

from neuron_lmi.engine.protocol import AdapterHost
from neuron_lmi.engine.types import InvalidRequestError, UnknownAdapterError
from neuron_lmi.model_source import ModelSourceError, fetch_adapter, model_cache_dir
from neuron_lmi.server.context import ctx_of
from neuron_lmi.server.errors import ApiError, Family, invalid, parse_body
from neuron_lmi.server.schema_types import RequestModel

router = APIRouter()


class LoadLoraRequest(RequestModel):
    """vLLM's ``LoadLoRAAdapterRequest``."""

    lora_name: str
    lora_path: str


class UnloadLoraRequest(RequestModel):
    """vLLM's ``UnloadLoRAAdapterRequest`` (its ``lora_int_id`` is vLLM's own and ignored)."""

    lora_name: str
    lora_int_id: int | None = None


class RegisterAdapterRequest(RequestModel):
    """LMI's adapter registration: ``name`` and ``src`` (where the adapter is)."""

    name: str
    src: str


def served(request: Request) -> AdapterHost | None:
    """The engine, where it serves LoRA adapters (``option.enable_lora``)."""
    engine = ctx_of(request).engine
    return engine if isinstance(engine, AdapterHost) and engine.serves_adapters else None


def host_of(request: Request, family: Family, field: str) -> AdapterHost:
    host = served(request)
    if host is None:
        backend = ctx_of(request).engine.backend_name
        raise invalid(
            family, f"this server serves no LoRA adapters ({backend} backend, option.enable_lora)", field
        )
    return host


async def _load(request: Request, family: Family, name: str, src: str, fields: tuple[str, str]) -> None:
    """Fetch and load; refusals name ``fields`` (the name's, the source's) as the client spelled them."""
    host = host_of(request, family, fields[0])
    if not name:
        raise invalid(family, "an adapter needs a name", fields[0])
    if name in host.adapters or name == ctx_of(request).model_name:
        raise invalid(family, f"adapter {name!r} is already loaded", fields[0])
    try:
        path = await asyncio.to_thread(fetch_adapter, src, model_cache_dir(os.environ), os.environ)
    except (ModelSourceError, OSError) as exc:
        raise invalid(family, f"adapter {name!r}: {exc}", fields[1]) from None
    try:
        await host.load_adapter(name, str(path))
    except InvalidRequestError as exc:
        raise invalid(family, str(exc), fields[1] if exc.field == "lora_path" else fields[0]) from None


@router.post("/v1/load_lora_adapter", tags=["openai"])
async def load_lora_adapter(request: Request) -> PlainTextResponse:
    req = parse_body(await request.body(), LoadLoraRequest, "openai")
    await _load(request, "openai", req.lora_name, req.lora_path, ("lora_name", "lora_path"))
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter", tags=["openai"])
async def unload_lora_adapter(request: Request) -> PlainTextResponse:
    req = parse_body(await request.body(), UnloadLoraRequest, "openai")
    await host_of(request, "openai", "lora_name").unload_adapter(req.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")


@router.post("/adapters", tags=["lmi"])
async def register_adapter(request: Request) -> JSONResponse:
    """LMI's register: ``?name=...&src=...``, or the same as a JSON body."""
    query = request.query_params
    body = await request.body()
    if "name" in query or "src" in query or not body.strip():
        for field in ("name", "src"):
            if not query.get(field):
                raise invalid("lmi", f"{field} is required (a query parameter, or JSON)", field)
        req = RegisterAdapterRequest(name=query["name"], src=query["src"])
    else:
        req = parse_body(body, RegisterAdapterRequest, "lmi")
    await _load(request, "lmi", req.name, req.src, ("name", "src"))
    return JSONResponse({"status": f"Adapter {req.name} registered"})


@router.get("/adapters", tags=["lmi"])
async def list_adapters(request: Request) -> dict[str, Any]:
    host = served(request)
    names = host.adapters if host is not None else {}
    return {"adapters": [{"name": name, "src": src} for name, src in names.items()]}


@router.delete("/adapters/{name}", tags=["lmi"])
async def delete_adapter(request: Request, name: str) -> JSONResponse:
    try:
        await host_of(request, "lmi", "name").unload_adapter(name)
    except UnknownAdapterError as exc:
        raise ApiError(404, str(exc), "name", "not_found") from None
    return JSONResponse({"status": f"Adapter {name} deleted"})


def adapter_cards(request: Request, created: int) -> list[dict[str, Any]]:
    """``/v1/models`` entries for the served adapters: each a model whose ``parent`` is the base (as
    vLLM lists them), ``root`` where it was read from."""
    ctx = ctx_of(request)
    host = served(request)
    names = host.adapters if host is not None else {}
    return [
        {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "neuron-lmi",
            "root": str(Path(src)),
            "parent": ctx.model_name,
            "max_model_len": ctx.engine.n_positions,
        }
        for name, src in names.items()
    ]


def adapter_for(request: Request, model: str | None) -> str | None:
    """The adapter OpenAI's ``model`` names, or None for the base model (any other name is the
    caller's to refuse)."""
    host = served(request)
    return model if model is not None and host is not None and model in host.adapters else None
