"""Operations routes: ``/ping`` (SageMaker), ``/health`` (TGI), ``/metrics`` (Prometheus)."""

from __future__ import annotations

from fastapi import APIRouter
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from neuron_lmi.server.context import ctx_of

router = APIRouter()


def _health(request: Request) -> JSONResponse:
    ctx = ctx_of(request)
    if ctx.healthy():
        return JSONResponse({"status": "healthy"})
    reason = ctx.fatal or ("engine loop is not running" if ctx.ready else "model is not loaded yet")
    return JSONResponse({"status": "unhealthy", "reason": reason}, status_code=503)


@router.get("/ping", tags=["sagemaker"])
async def ping(request: Request) -> JSONResponse:
    """200 only while the model is loaded and the engine loop is alive; 503 otherwise."""
    return _health(request)


@router.get("/health", tags=["ops"])
async def health(request: Request) -> JSONResponse:
    """Same contract as ``/ping`` (TGI's name for it)."""
    return _health(request)


@router.get("/metrics", tags=["ops"])
async def metrics(request: Request) -> Response:
    """Prometheus text format from this app's own registry."""
    return Response(generate_latest(ctx_of(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)
