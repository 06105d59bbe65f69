"""``neuron-lmi serve``: resolve the configuration, build the engine, run the HTTP server.

Configuration comes from ``neuron_lmi.config`` (CLI > serving.properties > environment > default).
SageMaker starts the image as ``serve`` (this command) with ``/opt/ml`` mounted, often configured by
environment variables only (``HF_MODEL_ID``, ``OPTION_*``); it never sets ``SM_MODEL_DIR`` (a
training variable). So SageMaker mode is ``SERVING_SAGEMAKER`` when set, else any of:
``SAGEMAKER_BIND_TO_PORT`` set, ``/opt/ml`` present (``NEURON_LMI_SAGEMAKER_ROOT`` moves it), the
serving.properties read from its ``model`` folder. There the server binds 0.0.0.0, and the SIGTERM
drain is capped so that the process exits before SageMaker's SIGKILL 30 s later. Elsewhere it binds
127.0.0.1 unless ``--host`` says otherwise. The port is ``--port``, else ``SAGEMAKER_BIND_TO_PORT``
whenever it is set (as the SageMaker inference toolkit does), else the configured one (8080).
SIGTERM drains in-flight requests within the grace period and exits 0. A CPU engine process that
dies fails its running requests with 503 and ``Retry-After`` and is started again (three times in
the server's life); with ``SERVING_FAIL_FAST=true`` a dead engine loop makes the process exit 3
instead, for SageMaker or Kubernetes to replace. The engine process never outlives the server.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
from collections.abc import Mapping
from types import FrameType
from typing import TYPE_CHECKING, Any

from neuron_lmi.config import cli_overrides, format_config, load_config, sagemaker_model_dir, sagemaker_root
from neuron_lmi.config.options import BACKEND_REQUESTS

if TYPE_CHECKING:
    from neuron_lmi.config import ResolvedConfig
    from neuron_lmi.engine.protocol import Engine

log = logging.getLogger(__name__)

EXIT_ENGINE_DIED = 3
EXIT_STARTUP_FAILED = 1
LOOPBACK = "127.0.0.1"
ALL_INTERFACES = "0.0.0.0"
SAGEMAKER_PORT_VAR = "SAGEMAKER_BIND_TO_PORT"
# SageMaker sends SIGKILL 30 s after SIGTERM. The stop is: HTTP drain (uvicorn's graceful timeout),
# then the engine's stop (its own grace, then up to 5 s joining its thread): 20 + 3 + 5 < 30.
SAGEMAKER_HTTP_DRAIN_S = 20.0
SAGEMAKER_ENGINE_STOP_S = 3.0
# Backends that would ignore option.enable_lora: refused at start rather than serving without it.
LORA_REFUSED = frozenset({"neuron-nxdi", "neuron-tnx"})


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("serve", help="serve a model over HTTP (LMI/SageMaker, TGI and OpenAI APIs)")
    p.add_argument("--model", dest="model_id", help="smollm2, a local dir or .gguf, s3://..., or a Hub id")
    p.add_argument("--host", help="bind address (default 127.0.0.1; 0.0.0.0 under SageMaker)")
    p.add_argument("--port", type=int, help="port (default 8080)")
    p.add_argument("--backend", choices=BACKEND_REQUESTS, help="engine backend (default auto)")
    p.add_argument("--properties", help="an LMI serving.properties file (or the folder holding one)")
    p.add_argument("--max-rolling-batch-size", type=int, help="KV rows = concurrent requests (default 32)")
    p.add_argument("--n-positions", type=int, help="max tokens per sequence, prompt included")
    p.add_argument("--dtype", help="fp32, bf16 or fp16 (CPU: bf16 where the CPU has native bf16, else fp32)")
    p.add_argument("--quantize", help="option.quantize: int8|int4 weight-only on CPU; Neuron: its methods")
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        default=None,
        help="option.enforce_eager: no compiled graphs (CPU: decode and prefill eagerly)",
    )
    p.add_argument(
        "--speculative-config",
        help='option.speculative_config: JSON, vLLM\'s names, e.g. \'{"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 4}\' (CPU engine: ngram, draft_model)',
    )
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (also NEURON_LMI_API_KEY)")
    p.add_argument("--max-body-bytes", type=int, help="refuse larger request bodies with 413")
    p.add_argument("--grace-period-s", type=float, help="how long SIGTERM waits for in-flight requests")
    p.add_argument(
        "--tool-call-parser",
        choices=("hermes", "llama3_json", "mistral"),
        help="tool-call format (default: from the chat template); also enables the built-in tool prompt",
    )
    p.add_argument(
        "--reasoning-parser",
        choices=("deepseek_r1", "qwen3"),
        help="split the model's <think> block off into message.reasoning (vLLM's parser names)",
    )
    p.add_argument(
        "--enable-lora", action="store_true", default=None, help="option.enable_lora: serve LoRA adapters"
    )
    p.add_argument(
        "--lora-modules",
        nargs="+",
        metavar="NAME=PATH",
        help="option.lora_modules: adapters served from the start (a directory, s3://... or a Hub id)",
    )
    p.add_argument("--max-loras", type=int, help="option.max_loras: adapters resident at once (default 4)")
    p.add_argument("--max-lora-rank", type=int, help="option.max_lora_rank: the largest rank (default 16)")
    p.add_argument("--max-cpu-loras", type=int, help="option.max_cpu_loras: adapters kept in host memory")
    p.add_argument("--print-config", action="store_true", help="print the resolved configuration and exit")
    p.set_defaults(func=run)


def _is_default(resolved: ResolvedConfig, field_name: str) -> bool:
    return resolved.source_of(field_name).startswith("default")


def sagemaker_mode(resolved: ResolvedConfig, env: Mapping[str, str]) -> bool:
    """Whether ``serve`` runs as a SageMaker container (0.0.0.0, /ping, /invocations, 30 s to stop).

    ``SERVING_SAGEMAKER`` decides when set; otherwise ``SAGEMAKER_BIND_TO_PORT`` set, the SageMaker
    root (``/opt/ml``) present, or serving.properties read from its model folder. ``SM_MODEL_DIR``
    is no sign: SageMaker hosting does not set it.
    """
    if not _is_default(resolved, "sagemaker"):
        return resolved.config.server.sagemaker
    if env.get(SAGEMAKER_PORT_VAR, "").strip() or sagemaker_root(env).is_dir():
        return True
    props = resolved.properties_path
    return props is not None and props.parent == sagemaker_model_dir(env)


def bind_host(resolved: ResolvedConfig, env: Mapping[str, str]) -> str:
    if not _is_default(resolved, "host"):
        return resolved.config.server.host
    return ALL_INTERFACES if sagemaker_mode(resolved, env) else LOOPBACK


def bind_port(resolved: ResolvedConfig, env: Mapping[str, str]) -> int:
    """``--port`` if given; else ``SAGEMAKER_BIND_TO_PORT`` whenever it is set (SageMaker's contract:
    the container listens where it is told); else the configured port (default 8080)."""
    port = resolved.config.server.port
    if resolved.source_of("port") == "cli":
        return port
    value = env.get(SAGEMAKER_PORT_VAR, "").strip()
    if not value:
        return port
    if not value.isdigit() or not 0 < int(value) <= 65535:
        raise ValueError(f"{SAGEMAKER_PORT_VAR}={value!r}: expected a TCP port number (1-65535)")
    return int(value)


def stop_timeouts(resolved: ResolvedConfig, sagemaker: bool) -> tuple[float, float]:
    """(HTTP drain, engine stop) seconds after SIGTERM: the configured grace period for each, capped
    under SageMaker so the whole stop ends before its SIGKILL (see ``SAGEMAKER_HTTP_DRAIN_S``)."""
    grace = resolved.config.server.grace_period_s
    if not sagemaker:
        return grace, grace
    if grace > SAGEMAKER_HTTP_DRAIN_S:
        log.info("SageMaker kills 30 s after SIGTERM: drain %gs, not %gs", SAGEMAKER_HTTP_DRAIN_S, grace)
    return min(grace, SAGEMAKER_HTTP_DRAIN_S), min(grace, SAGEMAKER_ENGINE_STOP_S)


def _requested_backend(resolved: ResolvedConfig) -> str:
    from neuron_lmi.backends.dispatch import requested_from_lmi  # the backends bring torch: when serving

    cfg = resolved.config
    rolling = cfg.batching.rolling_batch
    if rolling == "cpu":
        return "cpu" if cfg.backend.backend == "auto" else cfg.backend.backend
    explicit_rolling = None if _is_default(resolved, "rolling_batch") else rolling
    return requested_from_lmi(cfg.backend.backend, explicit_rolling, cfg.backend.engine)


def build_engine(resolved: ResolvedConfig, env: Mapping[str, str] | None = None) -> Engine:
    """Configuration -> backend name -> registered builder -> Engine (not started).

    The start-up log names the backend, the library and its version, why it was chosen, and the
    tensor-parallel degree (``max`` resolved to the visible NeuronCores or GPUs).
    """
    # The backends bring torch: imported when an engine is built, not by ``neuron-lmi --help``.
    from neuron_lmi.backends import registry
    from neuron_lmi.backends.dispatch import choose_backend, probe_host, resolve_tp_degree

    env = os.environ if env is None else env
    cfg = resolved.config
    requested = _requested_backend(resolved)
    on_cpu = cfg.neuron.nxdi_on_cpu
    neuron = cfg.neuron
    probe = probe_host(requested, env=env, nxdi_on_cpu=on_cpu, neuron_platform=neuron.neuron_platform)
    choice = choose_backend(
        requested,
        probe,
        neuron.model_loader,
        nxdi_on_cpu=on_cpu,
        allow_unsupported_platform=neuron.allow_unsupported_nxdi_on_inf2_trn1,
    )
    tp, how = resolve_tp_degree(
        cfg.parallel.tensor_parallel_degree,
        choice.name,
        probe,
        env,
        cfg.neuron.logical_nc_config,
        nxdi_on_cpu=on_cpu,
    )
    log.info("%s; tensor parallel degree %d (%s)", choice.summary(), tp, how)
    if cfg.lora.enable_lora and choice.name in LORA_REFUSED:  # vLLM reads the keys itself
        raise ValueError(
            f"option.enable_lora: the {choice.name} backend serves no LoRA adapters yet (cpu does)"
        )
    builder = registry.get(choice.name)
    return builder(registry.BuildRequest(resolved, env, choice.name, tp, choice))


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
    from neuron_lmi.server import AppOptions, create_app  # FastAPI and the engine: only when serving

    env = os.environ
    resolved = load_config(cli_overrides(args), args.properties, env)
    sagemaker = sagemaker_mode(resolved, env)
    drain_s, engine_stop_s = stop_timeouts(resolved, sagemaker)
    if args.print_config:
        print(format_config(resolved))
        mode = "SageMaker" if sagemaker else "local"
        print(f"bind address: {bind_host(resolved, env)}:{bind_port(resolved, env)} ({mode} mode)")
        print(f"on SIGTERM: drain requests {drain_s:g}s, then stop the engine {engine_stop_s:g}s")
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
        dtype=engine.model_dtype or resolved.config.model.dtype,
        fail_fast=server_cfg.fail_fast,
        grace_period_s=engine_stop_s,
        sagemaker=sagemaker,
        on_fatal=on_fatal,
        tool_call_parser=server_cfg.tool_call_parser,
        enable_auto_tool_choice=server_cfg.enable_auto_tool_choice,
        reasoning_parser=server_cfg.reasoning_parser,
    )
    server = _make_server(create_app(engine, options), host, port, drain_s)
    holder["server"] = server
    log.info("listening on http://%s:%d", host, port)
    server.run()
    if not server.started and state["code"] == 0:
        return EXIT_STARTUP_FAILED
    return state["code"]
