"""A test double of a *remote* inference server: a tiny FastAPI app on 127.0.0.1 that streams fake
tokens in the three wire formats (OpenAI SSE, TGI SSE, LMI JSON lines) and can fail every k-th
request with 500/503, so the load generator is exercised over real HTTP and real sockets."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

TOKEN_DELAY_S = 0.001


@dataclass
class FakeState:
    fail_every: int = 0  # every k-th request (1-based arrival order) fails; 0 = never
    received: int = 0
    bodies: list[dict[str, Any]] | None = None


def _fail(state: FakeState) -> Response | None:
    state.received += 1
    if state.fail_every and state.received % state.fail_every == 0:
        code = 503 if (state.received // state.fail_every) % 2 else 500
        return JSONResponse({"error": "injected failure", "error_type": "test"}, status_code=code)
    return None


async def _tokens(n: int) -> AsyncIterator[int]:
    for i in range(n):
        await asyncio.sleep(TOKEN_DELAY_S)
        yield i


def make_app(state: FakeState) -> FastAPI:
    app = FastAPI()

    async def read(request: Request) -> dict[str, Any]:
        body = await request.json()
        if state.bodies is not None:
            state.bodies.append(body)
        return body

    @app.post("/v1/chat/completions")
    @app.post("/v1/completions")
    async def openai(request: Request) -> Response:
        body = await read(request)
        if (failure := _fail(state)) is not None:
            return failure
        n, chat = int(body["max_tokens"]), "messages" in body
        if not body.get("stream"):
            choice = {"message": {"role": "assistant", "content": "w " * n}} if chat else {"text": "w " * n}
            usage = {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": n + 7}
            return JSONResponse({"choices": [{**choice, "finish_reason": "length"}], "usage": usage})

        def event(choice: dict[str, Any] | None, usage: dict[str, int] | None = None) -> str:
            return "data: " + json.dumps({"choices": [choice] if choice else [], "usage": usage}) + "\n\n"

        async def events() -> AsyncIterator[str]:
            if chat:  # a role-only first delta carries no token
                yield event({"index": 0, "delta": {"role": "assistant"}, "finish_reason": None})
            async for i in _tokens(n):
                piece = {"delta": {"content": "w "}} if chat else {"text": "w "}
                yield event({"index": 0, **piece, "finish_reason": "length" if i == n - 1 else None})
            if (body.get("stream_options") or {}).get("include_usage"):
                yield event(None, {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": n + 7})
            yield ": keep-alive comment\n\ndata: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    def token_obj(i: int, n: int, lmi: bool) -> dict[str, Any]:
        key = "log_prob" if lmi else "logprob"
        obj: dict[str, Any] = {"token": {"id": i, "text": "w ", key: -0.5}}
        if not lmi:
            obj.update(generated_text=None, details=None)
        if i == n - 1:
            obj["generated_text"] = "w " * n
            obj["details"] = {"finish_reason": "length", "generated_tokens": n}
        return obj

    def whole(body: dict[str, Any]) -> JSONResponse:
        n = int(body["parameters"]["max_new_tokens"])
        details = {"finish_reason": "length", "generated_tokens": n}
        return JSONResponse({"generated_text": "w " * n, "details": details})

    @app.post("/generate")
    async def tgi_generate(request: Request) -> Response:
        body = await read(request)
        return _fail(state) or whole(body)

    @app.post("/generate_stream")
    async def tgi_stream(request: Request) -> Response:
        body = await read(request)
        if (failure := _fail(state)) is not None:
            return failure
        n = int(body["parameters"]["max_new_tokens"])

        async def events() -> AsyncIterator[str]:
            async for i in _tokens(n):
                yield "data:" + json.dumps(token_obj(i, n, lmi=False)) + "\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/invocations")
    async def lmi(request: Request) -> Response:
        body = await read(request)
        if (failure := _fail(state)) is not None:
            return failure
        if not body.get("stream"):
            return whole(body)
        n = int(body["parameters"]["max_new_tokens"])

        async def lines() -> AsyncIterator[str]:
            async for i in _tokens(n):
                yield json.dumps(token_obj(i, n, lmi=True)) + "\n"

        return StreamingResponse(lines(), media_type="application/jsonlines")

    return app


@dataclass
class FakeServer:
    url: str
    state: FakeState


@pytest.fixture(scope="module")
def _running_server() -> Iterator[FakeServer]:
    state = FakeState()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(make_app(state), log_level="warning", lifespan="off", access_log=False)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("fake server did not start")
        time.sleep(0.02)
    yield FakeServer(f"http://127.0.0.1:{port}", state)
    server.should_exit = True
    thread.join(timeout=10)
    sock.close()


@pytest.fixture()
def fake_server(_running_server: FakeServer) -> FakeServer:
    """The module's fake server with its failure injection and counters reset."""
    _running_server.state.fail_every = 0
    _running_server.state.received = 0
    _running_server.state.bodies = []
    return _running_server
