"""OpenAI-compatible routes: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``.

``n`` choices fan out into ``n`` engine requests (seed ``seed + i`` for choice ``i``); with several
prompts, choice ``p * n + i`` belongs to prompt ``p``. Streams are server-sent events ending with
``data: [DONE]``; ``stream_options.include_usage`` adds a last chunk with ``usage`` and no choices,
and with vLLM's ``continuous_usage_stats`` every chunk carries its choice's usage so far. ``model``
may name the served model or be ``"tgi"``, which TGI's Messages API takes for whatever it serves
(Hugging Face's ``text_generation`` client always sends it).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from neuron_lmi.engine.types import SamplingParams, TokenEvent
from neuron_lmi.server.choices import best_of, first_prompt, prepend, prompt_logprobs, prompt_of
from neuron_lmi.server.context import ServerContext, ctx_of
from neuron_lmi.server.errors import ApiError, error_body, from_engine_error, invalid, parse_body
from neuron_lmi.server.generation import (
    Collected,
    ReleasingStreamingResponse,
    TokenStream,
    close_all,
    collect,
    failure_of,
    is_token,
    merge,
    new_request_id,
    open_streams,
    until_disconnect,
)
from neuron_lmi.server.reasoning import ReasoningChoiceStream, reasoning_message, with_think_block
from neuron_lmi.server.routes_adapters import adapter_cards, adapter_for
from neuron_lmi.server.schemas_lmi import finish_name
from neuron_lmi.server.schemas_openai import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    ChatRequest,
    CompletionRequest,
    StreamOptions,
    finish_reason,
    to_sampling,
)
from neuron_lmi.server.schemas_vllm import truncated
from neuron_lmi.server.tools import (
    ToolChoiceStream,
    plan_tools,
    render_chat,
    tool_message,
    with_tool_grammar,
)

router = APIRouter(prefix="/v1")
TGI_MODEL = "tgi"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# A streamed event -> its choice object(s): one chunk each (a tool call adds chunks of its own).
ChoiceFn = Callable[[int, TokenEvent, bool], dict[str, Any] | list[dict[str, Any]]]


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _check_model(request: Request, model: str | None) -> str | None:
    """The LoRA adapter ``model`` names (None: the base model); 404 naming ``model`` otherwise."""
    ctx = ctx_of(request)
    if model is None or model in (ctx.model_name, ctx.engine.model_name, TGI_MODEL):
        return None
    adapter = adapter_for(request, model)
    if adapter is None:
        raise ApiError(
            404,
            f"the model {model!r} does not exist; this server serves {ctx.model_name!r}",
            "model",
            "not_found",
        )
    return adapter


def _fan_out(prompts: Sequence[str | list[int]], params: SamplingParams, n: int) -> list[Any]:
    jobs = []
    for prompt in prompts:
        for i in range(n):
            seed = None if params.seed is None else params.seed + i
            jobs.append((prompt, dataclasses.replace(params, seed=seed) if i else params))
    return jobs


def _usage(streams: Sequence[TokenStream], n: int, completion_tokens: int) -> dict[str, int]:
    return _usage_of(sum(s.prompt_tokens for s in streams[::n]), completion_tokens)


def _usage_of(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _usage_mode(options: StreamOptions | None) -> tuple[bool, bool]:
    """(a last usage chunk, usage on every chunk): vLLM's continuous_usage_stats counts only with
    include_usage."""
    include = bool(options and options.include_usage)
    return include, include and bool(options and options.continuous_usage_stats)


def _completion_logprobs(events: Sequence[TokenEvent], offset: int) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in events:
        out["tokens"].append(e.token_text)
        out["token_logprobs"].append(e.logprob)
        out["top_logprobs"].append({t.text: t.logprob for t in e.top_tokens})
        out["text_offset"].append(offset)
        offset += len(e.text)
    return out


def _chat_logprob(e: TokenEvent) -> dict[str, Any]:
    return {
        "token": e.token_text,
        "logprob": e.logprob,
        "bytes": list(e.token_text.encode()),
        "top_logprobs": [
            {"token": t.text, "logprob": t.logprob, "bytes": list(t.text.encode())} for t in e.top_tokens
        ],
    }


async def _stream_body(
    head: dict[str, Any],
    streams: Sequence[TokenStream],
    n: int,
    usage_mode: tuple[bool, bool],
    choice: ChoiceFn,
    preamble: Sequence[dict[str, Any]] = (),
) -> AsyncIterator[str]:
    """SSE chunks for all choices as their tokens arrive, then usage (if asked) and ``[DONE]``."""
    include_usage, continuous = usage_mode
    counts = [0] * len(streams)

    def usage(idx: int) -> dict[str, Any]:
        if not include_usage:
            return {}
        return {"usage": _usage_of(streams[idx].prompt_tokens, counts[idx]) if continuous else None}

    for c in preamble:
        yield _sse({**head, "choices": [c], **usage(c["index"])})
    seen: set[int] = set()
    try:
        async with contextlib.aclosing(merge(streams)) as merged:
            async for idx, event in merged:
                failure = failure_of(event)
                if failure is not None:
                    raise failure
                counts[idx] += int(is_token(event))
                out = choice(idx, event, idx not in seen)
                for c in out if isinstance(out, list) else [out]:
                    yield _sse({**head, "choices": [c], **usage(idx)})
                seen.add(idx)
    except Exception as exc:
        yield _sse(error_body("openai", from_engine_error(exc, "openai")))
    else:
        if include_usage:
            yield _sse({**head, "choices": [], "usage": _usage(streams, n, sum(counts))})
    yield "data: [DONE]\n\n"


async def _collect_all(request: Request, streams: Sequence[TokenStream]) -> list[Collected]:
    outs = await until_disconnect(request, asyncio.gather(*(collect(s) for s in streams)))
    for out in outs:
        failure = out.failure()
        if failure is not None:
            raise failure
    return list(outs)


def _completion_prompts(ctx: ServerContext, req: CompletionRequest) -> list[str | list[int]]:
    p = req.prompt
    items: list[Any] = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
    if not items:  # no prompt at all; an empty one is admission's to refuse
        raise invalid("openai", "prompt must not be empty", "prompt")
    if req.truncate_prompt_tokens is not None:
        limit = ctx.engine.n_positions
        side = req.truncation_side
        ids = [ctx.encode(x) if isinstance(x, str) else list(x) for x in items]
        items = [truncated(x, req.truncate_prompt_tokens, side, limit) for x in ids]
    return items


@router.post("/completions", tags=["openai"])
async def completions(request: Request) -> Response:
    """OpenAI's legacy completions: ``logprobs: int`` gives that many alternatives per token;
    ``echo`` prepends the prompt (scored, with ``logprobs``); ``best_of`` keeps the best ``n``."""
    ctx = ctx_of(request)
    req = parse_body(await request.body(), CompletionRequest, "openai")
    adapter = _check_model(request, req.model)
    prompts = _completion_prompts(ctx, req)
    prompt_only = req.scores_prompt_only()
    max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if req.max_tokens is None else max(req.max_tokens, 1)
    params = dataclasses.replace(to_sampling(req, max_tokens, req.logprobs or 0), adapter=adapter)
    per_prompt = max(req.n, req.best_of or 1)
    if per_prompt > req.n:  # candidates are ranked by their log-probabilities
        params = dataclasses.replace(params, logprobs=True)
    jobs = _fan_out(prompts, params, per_prompt)
    streams = await open_streams(ctx.engine, ctx.metrics, jobs, "cmpl", client=request)
    try:  # decoded once the engine accepted the ids (a negative or huge id crashes the tokenizer)
        texts = [p if isinstance(p, str) else ctx.tokenizer.decode(p) for p in prompts]
    except BaseException:
        await close_all(streams)
        raise
    head = {
        "id": new_request_id("cmpl"),
        "object": "text_completion",
        "created": int(time.time()),
        "model": adapter or ctx.model_name,
        "system_fingerprint": f"neuron-lmi-{ctx.engine.backend_name}",
    }
    offsets = [len(texts[i // req.n]) if req.echo else 0 for i in range(len(streams))]

    def choice(idx: int, e: TokenEvent, first: bool) -> dict[str, Any]:
        prefix = texts[idx // req.n] if req.echo and first else ""
        tokens = [e] if is_token(e) else []
        lp = _completion_logprobs(tokens, offsets[idx]) if req.logprobs is not None else None
        if lp is not None and req.echo and first:
            lp = prepend(prompt_logprobs(e.prompt), lp)
        offsets[idx] += len(e.text)
        fr = finish_reason(finish_name(e.finish_reason)) if e.finish_reason else None
        return {"index": idx, "text": prefix + e.text, "logprobs": lp, "finish_reason": fr}

    if req.stream:
        body = _stream_body(head, streams, req.n, _usage_mode(req.stream_options), choice)
        return ReleasingStreamingResponse(body, streams, media_type="text/event-stream", headers=SSE_HEADERS)
    outs = await _collect_all(request, streams)
    if prompt_only:
        outs = [prompt_of(o) for o in outs]
    generated = sum(o.generated_tokens for o in outs)
    outs = best_of(outs, per_prompt, req.n) if per_prompt > req.n else outs
    choices = []
    for idx, out in enumerate(outs):
        prompt_text = texts[idx // req.n] if req.echo else ""
        lp = _completion_logprobs(out.tokens, len(prompt_text)) if req.logprobs is not None else None
        if lp is not None and req.echo:
            lp = prepend(prompt_logprobs(first_prompt(out)), lp)
        choices.append(
            {
                "index": idx,
                "text": prompt_text + out.text,
                "logprobs": lp,
                "finish_reason": finish_reason(finish_name(out.finish_reason)),
            }
        )
    usage = _usage(streams, per_prompt, generated)
    return JSONResponse({**head, "choices": choices, "usage": usage})


def _chat_max_tokens(ctx: ServerContext, req: ChatRequest, prompt_len: int) -> int:
    """What the client asked for, else the room the prompt leaves (at least 1: admission refuses a
    prompt that leaves none, naming ``messages``)."""
    for value in (req.max_completion_tokens, req.max_tokens):
        if value is not None:
            return value
    return max(1, ctx.engine.n_positions - prompt_len)


@router.post("/chat/completions", tags=["openai"])
async def chat_completions(request: Request) -> Response:
    """OpenAI chat: the prompt is the tokenizer's chat template with a generation prompt."""
    ctx = ctx_of(request)
    req = parse_body(await request.body(), ChatRequest, "openai")
    adapter = _check_model(request, req.model)
    if req.top_logprobs is not None and not req.logprobs:
        raise invalid("openai", "top_logprobs requires logprobs: true", "top_logprobs")
    plan = plan_tools(ctx.options, ctx.tokenizer, req)
    ids = render_chat(ctx.tokenizer, ctx.model_name, req, plan)
    ids = truncated(ids, req.truncate_prompt_tokens, req.truncation_side, ctx.engine.n_positions)
    top_n = (req.top_logprobs or 0) if req.logprobs else 0
    params = to_sampling(req, _chat_max_tokens(ctx, req, len(ids)), top_n)
    params = with_tool_grammar(params, plan)
    params = with_think_block(params, ctx.reasoning)  # a grammar constrains the answer, not the thinking
    params = dataclasses.replace(params, adapter=adapter)
    # A refused max_new_tokens is the field the client set.
    renames = {"max_new_tokens": "max_completion_tokens"} if req.max_completion_tokens is not None else None
    jobs = _fan_out([ids], params, req.n)
    streams = await open_streams(ctx.engine, ctx.metrics, jobs, "chatcmpl", renames, client=request)
    head = {
        "id": new_request_id("chatcmpl"),
        "created": int(time.time()),
        "model": adapter or ctx.model_name,
        "system_fingerprint": f"neuron-lmi-{ctx.engine.backend_name}",
    }

    tool_streams = [ToolChoiceStream(plan) for _ in range(req.n)] if plan.parse else None
    reasoner = ctx.reasoning
    think_streams = None
    if reasoner is not None:
        think_streams = [ReasoningChoiceStream(reasoner, plan, req.include_reasoning) for _ in range(req.n)]

    def choice(idx: int, e: TokenEvent, first: bool) -> dict[str, Any] | list[dict[str, Any]]:
        lp = {"content": [_chat_logprob(e)] if is_token(e) else []} if req.logprobs else None
        fr = finish_reason(finish_name(e.finish_reason)) if e.finish_reason else None
        if think_streams is not None:
            return think_streams[idx].chunks(idx, e, lp, fr)
        if tool_streams is not None:
            return tool_streams[idx].chunks(idx, e, lp, fr)
        return {"index": idx, "delta": {"content": e.text}, "logprobs": lp, "finish_reason": fr}

    if req.stream:
        roles = [
            {
                "index": i,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            for i in range(req.n)
        ]
        chunk_head = {**head, "object": "chat.completion.chunk"}
        body = _stream_body(chunk_head, streams, req.n, _usage_mode(req.stream_options), choice, roles)
        return ReleasingStreamingResponse(body, streams, media_type="text/event-stream", headers=SSE_HEADERS)
    outs = await _collect_all(request, streams)
    choices = []
    for idx, out in enumerate(outs):
        if reasoner is not None:
            message, called = reasoning_message(reasoner, plan, out.events, req.include_reasoning)
        else:
            message, called = tool_message(plan, out.events, out.text)
        choices.append(
            {
                "index": idx,
                "message": message,
                "logprobs": {"content": [_chat_logprob(e) for e in out.tokens]} if req.logprobs else None,
                "finish_reason": "tool_calls" if called else finish_reason(finish_name(out.finish_reason)),
            }
        )
    usage = _usage(streams, req.n, sum(o.generated_tokens for o in outs))
    return JSONResponse({**head, "object": "chat.completion", "choices": choices, "usage": usage})


@router.get("/models", tags=["openai"])
async def models(request: Request) -> dict[str, Any]:
    ctx = ctx_of(request)
    card = {
        "id": ctx.model_name,
        "object": "model",
        "created": ctx.created,
        "owned_by": "neuron-lmi",
        "max_model_len": ctx.engine.n_positions,
    }
    return {"object": "list", "data": [card, *adapter_cards(request, ctx.created)]}
