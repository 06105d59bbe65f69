"""LMI, SageMaker and TGI routes: ``/invocations``, ``/generate``, ``/``, ``/generate_stream``, ``/info``.

``/invocations`` and ``/generate`` answer in LMI's schema (JSON lines when ``stream`` is true);
``/`` and ``/generate_stream`` answer as TGI does (``/`` returns a one-element list, streams are
server-sent events), which is what Hugging Face's ``text_generation.Client`` calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

import neuron_lmi
from neuron_lmi.engine.types import MAX_STOP_SEQUENCES, SamplingParams, TokenEvent
from neuron_lmi.server.choices import best_of
from neuron_lmi.server.context import ServerContext, ctx_of
from neuron_lmi.server.errors import (
    ApiError,
    Family,
    error_body,
    family_for_path,
    from_engine_error,
    invalid,
    parse_body,
)
from neuron_lmi.server.generation import (
    Collected,
    ReleasingStreamingResponse,
    TokenStream,
    collect,
    failure_of,
    is_token,
    open_streams,
    until_disconnect,
)
from neuron_lmi.server.schemas_grammar import TgiGrammar
from neuron_lmi.server.schemas_lmi import (
    MAX_BEST_OF,
    LmiParameters,
    LmiRequest,
    Style,
    finish_name,
    lmi_details,
    stream_token,
    tgi_details,
    tgi_sequence,
    to_sampling,
    top_list,
)
from neuron_lmi.server.schemas_openai import ChatRequest, CompletionRequest

router = APIRouter()
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _prompt_for(ctx: ServerContext, text: str, truncate: int | None) -> str | list[int]:
    """The prompt as sent to the engine: text, or its last ``truncate`` token ids (TGI's truncate)."""
    if truncate is None:
        return text
    return ctx.encode(text)[-truncate:]


def _prefill(
    ctx: ServerContext, out: Collected, text: str, p: LmiParameters, style: Style = "tgi"
) -> list[dict[str, Any]]:
    """The prompt's tokens for ``decoder_input_details``, scored by the engine (the first token has
    no log-probability); a backend that did not score them gives the tokens with null ones."""
    if not p.decoder_input_details:
        return []
    key = "logprob" if style == "tgi" else "log_prob"
    scored = out.events[0].prompt if out.events else None
    if scored is not None:
        return [{"id": t.id, "text": t.text, key: t.logprob} for t in scored]
    ids = ctx.encode(text)
    return [{"id": i, "text": t, key: None} for i, t in zip(ids, ctx.token_texts(ids), strict=True)]


def _raise_if_failed(out: Collected) -> None:
    failure = out.failure()
    if failure is not None:
        raise failure


def _lmi_result(ctx: ServerContext, out: Collected, text: str, p: LmiParameters) -> dict[str, Any]:
    _raise_if_failed(out)
    body: dict[str, Any] = {"generated_text": (text if p.return_full_text else "") + out.text}
    if p.details or p.top_n_tokens or p.decoder_input_details:
        body["details"] = lmi_details(out, text, p, ctx.special_ids, _prefill(ctx, out, text, p, "lmi"))
    return body


def _tgi_result(
    ctx: ServerContext, out: Collected, text: str, p: LmiParameters, others: Sequence[Collected] = ()
) -> dict[str, Any]:
    _raise_if_failed(out)
    sequences = None
    if others:
        for other in others:
            _raise_if_failed(other)
        sequences = [tgi_sequence(o, text, p, _prefill(ctx, o, text, p), ctx.special_ids) for o in others]
    return {
        "generated_text": (text if p.return_full_text else "") + out.text,
        "details": tgi_details(out, p, _prefill(ctx, out, text, p), ctx.special_ids, sequences),
    }


async def _checked(stream: TokenStream, out: Collected) -> AsyncIterator[TokenEvent]:
    """Events of ``stream`` recorded into ``out``; an engine-side end or failure raises ``ApiError``."""
    try:
        async for event in stream:
            out.events.append(event)
            failure = failure_of(event)
            if failure is not None:
                raise failure
            yield event
    except ApiError:
        raise
    except Exception as exc:  # the engine died mid-stream: the client gets an error line, not silence
        raise from_engine_error(exc, "lmi") from exc


async def _jsonlines(
    ctx: ServerContext, stream: TokenStream, text: str, p: LmiParameters
) -> AsyncIterator[str]:
    """LMI's stream: one ``{"token": ...}`` line per token; the last adds ``generated_text``/``details``.

    A failure after the headers went out becomes a last line in LMI's error form.
    """
    out = Collected(prompt_tokens=stream.prompt_tokens)
    try:
        async with contextlib.aclosing(_checked(stream, out)) as events:
            async for event in events:
                line: dict[str, Any] = {"token": stream_token(event, "lmi")} if is_token(event) else {}
                if p.top_n_tokens and is_token(event):
                    line["top_tokens"] = top_list(event.top_tokens, ctx.special_ids, "lmi")
                if event.finish_reason is not None:
                    line["generated_text"] = (text if p.return_full_text else "") + out.text
                    if p.details:
                        line["details"] = lmi_details(
                            out, text, p, ctx.special_ids, _prefill(ctx, out, text, p, "lmi")
                        )
                yield _dumps(line) + "\n"
    except ApiError as err:
        yield _dumps(error_body("invocations", err)) + "\n"


def _sse_event(ctx: ServerContext, event: TokenEvent, out: Collected, text: str, p: LmiParameters) -> str:
    token = (
        stream_token(event, "tgi")
        if is_token(event)
        else {"id": -1, "text": "", "logprob": 0.0, "special": True}
    )
    data: dict[str, Any] = {
        "index": event.index,
        "token": token,
        "top_tokens": top_list(event.top_tokens, ctx.special_ids, "tgi") if p.top_n_tokens else None,
        "generated_text": None,
        "details": None,
    }
    if event.finish_reason is not None:
        data["generated_text"] = (text if p.return_full_text else "") + out.text
        data["details"] = {
            "finish_reason": finish_name(event.finish_reason),
            "generated_tokens": out.generated_tokens,
            "seed": p.seed,
            "input_length": out.prompt_tokens,
        }
    return f"data:{_dumps(data)}\n\n"


async def _sse(ctx: ServerContext, stream: TokenStream, text: str, p: LmiParameters) -> AsyncIterator[str]:
    """TGI's ``/generate_stream``: one server-sent event per token, the last with ``details``."""
    out = Collected(prompt_tokens=stream.prompt_tokens)
    try:
        async with contextlib.aclosing(_checked(stream, out)) as events:
            async for event in events:
                yield _sse_event(ctx, event, out, text, p)
    except ApiError as err:
        yield f"data:{_dumps(error_body('tgi', err))}\n\n"


async def _start(
    request: Request, family: Family, force_stream: bool = False
) -> tuple[ServerContext, LmiRequest, list[str], list[TokenStream]]:
    ctx = ctx_of(request)
    req = parse_body(await request.body(), LmiRequest, family)
    inputs = req.input_list(family)
    if req.stream and len(inputs) > 1:
        raise invalid(family, "streaming takes a single input string, not a list", "inputs")
    stream = req.stream or force_stream
    params: SamplingParams = to_sampling(req.parameters, family, stream)
    prompts = [_prompt_for(ctx, text, req.parameters.truncate) for text in inputs]
    adapters, adapter_field = req.adapter_list(len(prompts), family)
    jobs = [
        (prompt, dataclasses.replace(params, adapter=adapter) if adapter else params)
        for prompt, adapter in zip(prompts, adapters, strict=True)
        for _ in range(req.parameters.best_of or 1)
    ]
    renames = {"adapter": adapter_field}
    streams = await open_streams(ctx.engine, ctx.metrics, jobs, "lmi", renames, client=request)
    return ctx, req, inputs, streams


async def _serve(request: Request, style: Style, force_stream: bool = False) -> Response:
    family = family_for_path(request.url.path)
    ctx, req, inputs, streams = await _start(request, family, force_stream)
    p = req.parameters
    if req.stream or force_stream:
        if style == "lmi":
            body = _jsonlines(ctx, streams[0], inputs[0], p)
            return ReleasingStreamingResponse(body, streams, media_type="application/jsonlines")
        body = _sse(ctx, streams[0], inputs[0], p)
        return ReleasingStreamingResponse(body, streams, media_type="text/event-stream", headers=SSE_HEADERS)
    outs: Sequence[Collected] = await until_disconnect(
        request, asyncio.gather(*(collect(s) for s in streams))
    )
    per_input = p.best_of or 1
    ranked = best_of(outs, per_input, per_input)  # each input's candidates, the most likely first
    if style == "tgi":
        return JSONResponse([_tgi_result(ctx, ranked[0], inputs[0], p, ranked[1:per_input])])
    results = [_lmi_result(ctx, ranked[i * per_input], t, p) for i, t in enumerate(inputs)]
    return JSONResponse(results[0] if isinstance(req.inputs, str) else results)


@router.post("/invocations", tags=["sagemaker"])
async def invocations(request: Request) -> Response:
    """SageMaker's inference route, LMI schema; ``stream: true`` gives JSON lines."""
    return await _serve(request, "lmi")


@router.post("/generate", tags=["lmi"])
async def generate(request: Request) -> Response:
    """LMI schema (same as ``/invocations``, with LMI/TGI's plain error format)."""
    return await _serve(request, "lmi")


@router.post("/", tags=["tgi"])
async def tgi_compat(request: Request) -> Response:
    """TGI's compat route used by ``text_generation.Client``: a one-element list, or SSE if ``stream``."""
    return await _serve(request, "tgi")


@router.post("/generate_stream", tags=["tgi"])
async def generate_stream(request: Request) -> Response:
    """TGI's token stream as server-sent events."""
    return await _serve(request, "tgi", force_stream=True)


def _supported_parameters() -> dict[str, Any]:
    """What requests may set, per API, read from the schemas the routes validate with."""
    refused = {"typical_p", "watermark", "suffix"}  # accepted only at neutral values
    return {
        "lmi_tgi": sorted(set(LmiParameters.model_fields) - refused),
        "openai_completions": sorted(set(CompletionRequest.model_fields) - {"suffix"}),
        "openai_chat": sorted(ChatRequest.model_fields),
        "grammar_types": list(TgiGrammar.model_fields["type"].annotation.__args__),  # type: ignore[union-attr]
        "response_format_types": ["text", "json_object", "json_schema"],
    }


@router.get("/info", tags=["tgi"])
async def info(request: Request) -> dict[str, Any]:
    """TGI's ``/info``: what is served and the limits requests must respect."""
    ctx = ctx_of(request)
    engine = ctx.engine
    return {
        "model_id": ctx.model_name,
        "model_sha": None,
        "model_dtype": ctx.options.dtype,
        "model_device_type": engine.backend_name,
        "model_pipeline_tag": "text-generation",
        "max_concurrent_requests": engine.max_batch_size,
        "max_best_of": MAX_BEST_OF,
        "max_stop_sequences": MAX_STOP_SEQUENCES,
        "max_input_tokens": engine.n_positions - 1,
        "max_input_length": engine.n_positions - 1,
        "max_total_tokens": engine.n_positions,
        "max_batch_size": engine.max_batch_size,
        "validation_workers": 1,
        "max_client_batch_size": 32,
        "router": "neuron-lmi",
        "version": neuron_lmi.__version__,
        "sha": None,
        "docker_label": None,
        "supported_parameters": _supported_parameters(),
    }
