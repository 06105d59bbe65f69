"""``create_app(engine, options)``: the one FastAPI app in front of any ``Engine``.

Lifecycle: the lifespan starts the engine, marks the app ready (``/ping`` 200), runs a watchdog
that notices a dead engine loop, and on shutdown (after uvicorn has drained connections) stops the
engine within the grace period. The app never touches tensors; it translates HTTP to the
``Engine`` protocol and back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response

import neuron_lmi
from neuron_lmi.engine.protocol import Engine
from neuron_lmi.engine.types import EngineDeadError, EngineOverloadedError, InvalidRequestError
from neuron_lmi.server import routes_adapters, routes_lmi, routes_openai, routes_ops
from neuron_lmi.server.context import ServerContext, make_context
from neuron_lmi.server.errors import ApiError, error_response, family_for_path, from_engine_error, invalid
from neuron_lmi.server.middleware import GuardMiddleware
from neuron_lmi.server.openapi import install_openapi
from neuron_lmi.server.options import AppOptions

log = logging.getLogger(__name__)


async def _watchdog(ctx: ServerContext) -> None:
    """Poll the engine; on a dead loop log once and, with ``fail_fast``, ask the process to exit."""
    reported = False
    while True:
        await asyncio.sleep(ctx.options.health_poll_s)
        if not ctx.ready or ctx.healthy() or reported:
            continue
        reported = True
        reason = "engine loop is not alive"
        log.error("%s: /ping now answers 503", reason)
        if ctx.options.fail_fast:
            ctx.fatal = reason
            if ctx.options.on_fatal is not None:
                ctx.options.on_fatal(reason)


def _install_error_handlers(app: FastAPI) -> None:
    async def api_error(request: Request, exc: Exception) -> Response:
        family = family_for_path(request.url.path)
        return error_response(family, from_engine_error(exc, family, request.url.path))

    async def fastapi_validation(request: Request, exc: Exception) -> Response:
        family = family_for_path(request.url.path)
        errors = exc.errors() if isinstance(exc, RequestValidationError) else []
        field = ".".join(str(p) for p in errors[0]["loc"]) if errors else "body"
        return error_response(
            family, invalid(family, f"{field}: {errors[0]['msg'] if errors else exc}", field)
        )

    async def http_error(request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, StarletteHTTPException) else 500
        kind = "not_found" if status in (404, 405) else "validation"
        err = ApiError(
            status, f"{request.method} {request.url.path}: {getattr(exc, 'detail', exc)}", None, kind
        )
        return error_response(family_for_path(request.url.path), err)

    for exc_type in (ApiError, InvalidRequestError, EngineOverloadedError, EngineDeadError):
        app.add_exception_handler(exc_type, api_error)
    app.add_exception_handler(RequestValidationError, fastapi_validation)
    app.add_exception_handler(StarletteHTTPException, http_error)


def create_app(engine: Engine, options: AppOptions | None = None) -> FastAPI:
    """The server for ``engine``. With ``options.start_engine`` the lifespan starts and stops it."""
    opts = options or AppOptions()
    ctx = make_context(engine, opts)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if opts.start_engine:
            await engine.start()
        ctx.ready = True
        log.info("serving %s on the %s backend", ctx.model_name, engine.backend_name)
        watchdog = asyncio.create_task(_watchdog(ctx))
        try:
            yield
        finally:
            ctx.ready = False
            watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watchdog
            if opts.start_engine:
                await engine.stop(opts.grace_period_s)

    app = FastAPI(title="neuron-lmi", version=neuron_lmi.__version__, lifespan=lifespan)
    app.state.ctx = ctx
    for router in (routes_ops.router, routes_openai.router, routes_lmi.router, routes_adapters.router):
        app.include_router(router)
    _install_error_handlers(app)
    install_openapi(app)
    app.add_middleware(GuardMiddleware, ctx=ctx)
    return app
