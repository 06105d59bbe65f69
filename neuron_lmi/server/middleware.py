"""One pure-ASGI guard in front of every route: access control, body size, request metrics.

Pure ASGI (not ``BaseHTTPMiddleware``) so streaming responses and client disconnects pass through
untouched. Order of checks: API key (401), then body size (413) before any route parses anything.
Refusals are rendered in the route family's error format.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from neuron_lmi.server.context import ServerContext
from neuron_lmi.server.errors import ApiError, error_response, family_for_path, invalid

OPEN_PATHS = frozenset({"/ping", "/health"})
KNOWN_ROUTES = frozenset(
    {
        "/",
        "/invocations",
        "/generate",
        "/generate_stream",
        "/info",
        "/ping",
        "/health",
        "/metrics",
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/docs",
        "/openapi.json",
    }
)


class GuardMiddleware:
    """Refuses unauthenticated and oversized requests; counts every response by route and status."""

    def __init__(self, app: ASGIApp, ctx: ServerContext) -> None:
        self.app = app
        self.ctx = ctx
        key = ctx.options.api_key
        self._expected = f"Bearer {key}".encode() if key else None

    def _authorized(self, scope: Scope) -> bool:
        if self._expected is None or scope["path"] in OPEN_PATHS:
            return True
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                return hmac.compare_digest(value.strip(), self._expected)
        return False

    def _declared_length(self, scope: Scope) -> int | None:
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                return int(value) if value.isdigit() else -1
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        route = path if path in KNOWN_ROUTES else "other"
        status_box = {"status": 500}

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status_box["status"] = int(message["status"])
            await send(message)

        try:
            refusal = self._refusal(scope)
            if refusal is not None:
                await error_response(family_for_path(path), refusal)(scope, receive, counting_send)
                return
            if self._declared_length(scope) is None and scope["method"] in ("POST", "PUT", "PATCH"):
                receive = await self._bounded_replay(scope, receive, counting_send)
                if receive is None:
                    return
            await self.app(scope, receive, counting_send)
        finally:
            self.ctx.metrics.requests.labels(route=route, status=str(status_box["status"])).inc()

    def _refusal(self, scope: Scope) -> ApiError | None:
        family = family_for_path(scope["path"])
        if not self._authorized(scope):
            return ApiError(
                401,
                "missing or invalid API key (Authorization: Bearer <key>)",
                "authorization",
                "authentication",
            )
        length = self._declared_length(scope)
        if length is not None and length < 0:
            return invalid(family, "invalid Content-Length header", "content-length")
        if length is not None and length > self.ctx.options.max_body_bytes:
            return self._too_large()
        return None

    def _too_large(self) -> ApiError:
        limit = self.ctx.options.max_body_bytes
        return ApiError(413, f"request body exceeds the limit of {limit} bytes", "body", "payload_too_large")

    async def _bounded_replay(self, scope: Scope, receive: Receive, send: Send) -> Receive | None:
        """Read a body without Content-Length (chunked) up to the limit, then replay it to the app."""
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            body = message.get("body", b"")
            size += len(body)
            if size > self.ctx.options.max_body_bytes:
                await error_response(family_for_path(scope["path"]), self._too_large())(scope, receive, send)
                return None
            chunks.append(body)
            more = bool(message.get("more_body", False))
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        return replay
