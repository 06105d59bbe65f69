"""``neuron-lmi serve``: resolve the configuration, build the engine, run the HTTP server.

Configuration comes from ``neuron_lmi.config`` (CLI > serving.properties > environment > default).
Started the SageMaker way (``SM_MODEL_DIR``, a ``/opt/ml/model/serving.properties``, or
``SERVING_SAGEMAKER=true``) the server binds 0.0.0.0 on ``SAGEMAKER_BIND_TO_PORT`` (the port
SageMaker assigns to images labelled ``accept-bind-to-port=true``), else 8080; otherwise
127.0.0.1:8080 unless ``--host``/``--port`` say otherwise. SIGTERM drains in-flight requests
within the grace period and exits 0; with ``SERVING_FAIL_FAST=true`` a dead engine loop makes the
process exit 3.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
from collections.abc import Callable, Mapping
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from neuron_lmi.config import ResolvedConfig
    from neuron_lmi.engine.protocol import Engine

log = logging.getLogger(__name__)

EXIT_ENGINE_DIED = 3
EXIT_STARTUP_FAILED = 1
LOOPBACK = "127.0.0.1"
ALL_INTERFACES = "0.0.0.0"
CPU_DTYPES = ("fp32", "bf16")
SAGEMAKER_PORT_VAR = "SAGEMAKER_BIND_TO_PORT"


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("serve", help="serve a model over HTTP (LMI/SageMaker, TGI and OpenAI APIs)")
    p.add_argument("--model", dest="model_id", help="smollm2, a local dir or .gguf, s3://..., or a Hub id")
    p.add_argument("--host", help="bind address (default 127.0.0.1; 0.0.0.0 under SageMaker)")
    p.add_argument("--port", type=int, help="port (default 8080)")
    p.add_argument(
        "--backend", choices=("auto", "cpu", "neuron", "vllm"), help="engine backend (default auto)"
    )
    p.add_argument("--properties", help="an LMI serving.properties file (or the folder holding one)")
    p.add_argument("--max-rolling-batch-size", type=int, help="KV rows = concurrent requests (default 32)")
    p.add_argument("--n-positions", type=int, help="max tokens per sequence, prompt included")
    p.add_argument("--dtype", help="fp32, bf16 or fp16 (CPU: fp32 unless told)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (also NEURON_LMI_API_KEY)")
    p.add_argument("--max-body-bytes", type=int, help="refuse larger request bodies with 413")
    p.add_argument("--grace-period-s", type=float, help="how long SIGTERM waits for in-flight requests")
    p.add_argument("--print-config", action="store_true", help="print the resolved configuration and exit")
    p.set_defaults(func=run)


def _is_default(resolved: ResolvedConfig, field_name: str) -> bool:
    return resolved.source_of(field_name).startswith("default")


def sagemaker_mode(resolved: ResolvedConfig, env: Mapping[str, str]) -> bool:
    """Whether we run as a SageMaker container (its contract: 0.0.0.0:8080, /ping, /invocations)."""
    from neuron_lmi.config import sagemaker_model_dir

    if resolved.config.server.sagemaker or env.get("SM_MODEL_DIR", "").strip():
        return True
    sm_dir = sagemaker_model_dir(env)
    props = resolved.properties_path
    return (props is not None and props.parent == sm_dir) or (sm_dir / "serving.properties").is_file()


def bind_host(resolved: ResolvedConfig, env: Mapping[str, str]) -> str:
    if not _is_default(resolved, "host"):
        return resolved.config.server.host
    return ALL_INTERFACES if sagemaker_mode(resolved, env) else LOOPBACK


def bind_port(resolved: ResolvedConfig, env: Mapping[str, str]) -> int:
    """``--port`` if given; in SageMaker mode ``SAGEMAKER_BIND_TO_PORT`` when set (SageMaker's
    contract: the container listens where it is told); else the configured port (default 8080)."""
    port = resolved.config.server.port
    if resolved.source_of("port") == "cli" or not sagemaker_mode(resolved, env):
        return port
    value = env.get(SAGEMAKER_PORT_VAR, "").strip()
    if not value:
        return port
    if not value.isdigit() or not 0 < int(value) <= 65535:
        raise ValueError(f"{SAGEMAKER_PORT_VAR}={value!r}: expected a TCP port number (1-65535)")
    return int(value)


def _requested_backend(resolved: ResolvedConfig) -> str:
    from neuron_lmi.backends.dispatch import requested_from_lmi

    cfg = resolved.config
    rolling = cfg.batching.rolling_batch
    if rolling == "cpu":
        return "cpu" if cfg.backend.backend == "auto" else cfg.backend.backend
    explicit_rolling = None if _is_default(resolved, "rolling_batch") else rolling
    return requested_from_lmi(cfg.backend.backend, explicit_rolling, cfg.backend.engine)


def model_cache_dir(env: Mapping[str, str]) -> Path:
    return Path(env.get("NEURON_LMI_MODEL_CACHE") or Path.home() / ".cache" / "neuron-lmi" / "models")


def _build_cpu(resolved: ResolvedConfig, env: Mapping[str, str]) -> Engine:
    """The torch reference engine; the model is fetched first (built-in, local, s3://, Hub)."""
    from neuron_lmi.engine.async_engine import AsyncEngine
    from neuron_lmi.model_source import fetch_model

    cfg = resolved.config
    model_id = cfg.model.model_id or "smollm2"
    path = fetch_model(
        model_id, model_cache_dir(env), cfg.model.model_loading_timeout, env, revision=cfg.model.revision
    )
    dtype = "fp32" if _is_default(resolved, "dtype") else cfg.model.dtype
    tp = cfg.parallel.tensor_parallel_degree
    kwargs: dict[str, Any] = {
        "dtype": dtype,
        "max_rolling_batch_size": cfg.batching.max_rolling_batch_size,
        "n_positions": cfg.batching.n_positions,
        "max_queue_size": cfg.batching.max_queue_size,
        "max_prefill_tokens": cfg.batching.max_prefill_tokens or 4096,
        "tensor_parallel_degree": 1 if tp == "max" else tp,
        # LMI's option.compiled_graph_path (a directory or s3:// URI) turns on the AOT-compiled runner.
        "compiled_graph_path": cfg.neuron.compiled_graph_path,
        "context_length_estimate": cfg.batching.context_length_estimate,
    }
    engine = AsyncEngine.from_options(str(path), **kwargs)
    engine.model_name = model_id
    return engine


def _build_neuron(resolved: ResolvedConfig, env: Mapping[str, str]) -> Engine:
    """transformers-neuronx behind the same rolling-batch engine; artifacts via the compile cache."""
    from compile_cache import CompileCache
    from neuron_lmi.backends.neuron import build_neuron_runner
    from neuron_lmi.engine.async_engine import AsyncEngine
    from neuron_lmi.engine.build import eos_ids_for
    from neuron_lmi.engine.core import EngineCore
    from neuron_lmi.model_source import fetch_model
    from neuron_lmi.models.loader import read_hf_config

    cfg = resolved.config
    model_id = cfg.model.model_id or "smollm2"
    path = fetch_model(
        model_id, model_cache_dir(env), cfg.model.model_loading_timeout, env, revision=cfg.model.revision
    )
    remote = cfg.neuron.compiled_graph_path
    remote_url = remote if remote and remote.startswith("s3://") else None
    local_root = Path(remote) if remote and not remote_url else None
    runner = build_neuron_runner(cfg, str(path), CompileCache(local_root, remote=remote_url))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    eos = eos_ids_for(read_hf_config(Path(path)), tokenizer)
    core = EngineCore(runner, tokenizer, eos, cfg.batching.max_prefill_tokens or 4096)
    engine = AsyncEngine(core, model_name=model_id, max_queue_size=cfg.batching.max_queue_size)
    engine.backend_name = "neuron"
    return engine


def _build_vllm(resolved: ResolvedConfig, env: Mapping[str, str]) -> Engine:
    from gpu_fallback.serve import build_vllm_engine

    return build_vllm_engine(resolved, env)


# Backend name -> builder; each imports its backend only when chosen.
ENGINE_BUILDERS: dict[str, Callable[[ResolvedConfig, Mapping[str, str]], Engine]] = {
    "cpu": _build_cpu,
    "neuron": _build_neuron,
    "vllm": _build_vllm,
}


def build_engine(resolved: ResolvedConfig, env: Mapping[str, str] | None = None) -> Engine:
    """Choose the backend for this host and configuration, and build its engine (not started)."""
    from neuron_lmi.backends.dispatch import choose_backend, probe_host

    env = os.environ if env is None else env
    requested = _requested_backend(resolved)
    choice = choose_backend(requested, probe_host(requested))
    log.info("backend %s: %s", choice.name, choice.reason)
    builder = ENGINE_BUILDERS.get(choice.name)
    if builder is None:
        raise RuntimeError(f"backend {choice.name!r} is not available in this build of neuron-lmi serve")
    return builder(resolved, env)


def _make_server(app: Any, host: str, port: int, grace_s: float) -> Any:
    import uvicorn

    class GracefulServer(uvicorn.Server):
        """SIGTERM is a normal, graceful stop: drain, shut down, exit 0 (uvicorn would re-raise it)."""

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            if sig == signal.SIGTERM:
                log.info("SIGTERM: no new connections; draining in-flight requests (grace %.0fs)", grace_s)
                self.should_exit = True
                return
            super().handle_exit(sig, frame)

    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="info",
        access_log=False,
        timeout_graceful_shutdown=max(1, round(grace_s)),
        lifespan="on",
    )
    return GracefulServer(config)


def run(args: argparse.Namespace) -> int:
    from neuron_lmi.config import cli_overrides, format_config, load_config
    from neuron_lmi.server import AppOptions, create_app

    env = os.environ
    resolved = load_config(cli_overrides(args), args.properties, env)
    if args.print_config:
        print(format_config(resolved))
        mode = "SageMaker" if sagemaker_mode(resolved, env) else "local"
        print(f"bind address: {bind_host(resolved, env)}:{bind_port(resolved, env)} ({mode} mode)")
        return 0
    server_cfg = resolved.config.server
    host = bind_host(resolved, env)
    port = bind_port(resolved, env)
    try:
        engine = build_engine(resolved, env)
    except TimeoutError as exc:  # option.model_loading_timeout: report it like any start-up failure
        raise RuntimeError(str(exc)) from exc
    state = {"code": 0}
    holder: dict[str, Any] = {}

    def on_fatal(reason: str) -> None:
        log.error("SERVING_FAIL_FAST: %s; exiting with status %d", reason, EXIT_ENGINE_DIED)
        state["code"] = EXIT_ENGINE_DIED
        holder["server"].should_exit = True

    api_key = server_cfg.api_key.get_secret_value() if server_cfg.api_key is not None else None
    options = AppOptions(
        api_key=api_key or None,
        max_body_bytes=server_cfg.max_body_bytes,
        served_model_name=engine.model_name,
        dtype=resolved.config.model.dtype if not _is_default(resolved, "dtype") else "fp32",
        fail_fast=server_cfg.fail_fast,
        grace_period_s=server_cfg.grace_period_s,
        sagemaker=sagemaker_mode(resolved, env),
        on_fatal=on_fatal,
    )
    server = _make_server(create_app(engine, options), host, port, server_cfg.grace_period_s)
    holder["server"] = server
    log.info("listening on http://%s:%d", host, port)
    server.run()
    if not server.started and state["code"] == 0:
        return EXIT_STARTUP_FAILED
    return state["code"]
