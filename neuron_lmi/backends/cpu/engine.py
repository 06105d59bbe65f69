"""The CPU engine's options and its assembly: an ``EngineCore`` on the CPU runner from a model name,
directory or GGUF file, and the engine fronts around it (``cpu_process_engine``, ``cpu_thread_engine``;
the Python API is ``backends.cpu.llm.LLM``). The fronts live in ``engine`` and know no backend: this
module builds them, so ``engine`` never imports a backend.

``CpuEngineOptions`` is what the engine is built from: the resolved configuration's CPU view
(``CpuEngineOptions.from_resolved``), with no defaults of its own. ``serve``, ``neuron-lmi compile``,
``neuron-lmi generate`` and the Python API (``LLM``) all resolve it the same way, through
``config.load_config`` (serving.properties, ``OPTION_*``, their own arguments on top), so the CPU
engine runs in the host's dtype with its compiled graphs unless a source says otherwise.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from neuron_lmi.backends.backend import load_runner
from neuron_lmi.backends.common import cache_for, eos_ids_for, fetch
from neuron_lmi.backends.cpu.backend import CPU_BACKEND
from neuron_lmi.backends.cpu.lora import adapter_table
from neuron_lmi.backends.cpu.runner import CpuRunner
from neuron_lmi.backends.lora import LoraSettings, resolve_lora
from neuron_lmi.config.dtypes import DTYPES, canonical_dtype
from neuron_lmi.config.options import (
    DEFAULT_MAX_PREFILL_TOKENS,
    default_n_positions,
    default_n_positions_source,
)
from neuron_lmi.config.speculative import DRAFT_MODEL, SpeculativeConfig
from neuron_lmi.engine.async_engine import AsyncEngine
from neuron_lmi.engine.core import EngineCore
from neuron_lmi.engine.process_front import DEFAULT_MAX_RESTARTS, ProcessEngine
from neuron_lmi.model_source import fetch_model, model_cache_dir
from neuron_lmi.models import build_model
from neuron_lmi.models.loader import load_checkpoint, load_tokenizer, resolve_model_path
from neuron_lmi.models.native import host_cpu_flags
from neuron_lmi.models.ops import build_in_background
from neuron_lmi.models.packed import pack_model
from neuron_lmi.models.quantize import quantize_model
from neuron_lmi.parallel.tp_model import apply_tensor_parallel

if TYPE_CHECKING:
    from neuron_lmi.config import ResolvedConfig

log = logging.getLogger(__name__)

CPU_DTYPES = ("fp32", "bf16")  # of the dtype table's (fp16 has no fast CPU kernels)
# /proc/cpuinfo flags of CPUs with native bf16 matmuls (AVX-512 BF16 dot products, AMX tiles).
BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
CPU_QUANTIZE = ("int8", "int4")  # option.quantize values the CPU engine runs (weight-only)


def default_cpu_dtype(cpu_flags: Collection[str], capability: str) -> str:
    """``bf16`` where bf16 matmuls are native -- a BF16 flag and torch dispatching its AVX-512 kernels
    (``capability`` from ``torch.backends.cpu.get_cpu_capability()``; ``ATEN_CPU_CAPABILITY=avx2``
    turns them off) -- else ``fp32``."""
    return "bf16" if capability.upper().startswith("AVX512") and BF16_CPU_FLAGS & set(cpu_flags) else "fp32"


def resolve_cpu_dtype(dtype: str | None) -> str:
    """``dtype`` as given (``--dtype`` wins), or this host's :func:`default_cpu_dtype` for None/``auto``."""
    if dtype in (None, "auto"):
        return default_cpu_dtype(host_cpu_flags(), torch.backends.cpu.get_cpu_capability())
    return dtype


@dataclass(frozen=True, slots=True)
class CpuEngineOptions:
    """The CPU engine's frozen view of the resolved configuration: what the engine is built from.

    It has no defaults of its own. Every field comes from :meth:`from_resolved` (``serve``,
    ``neuron-lmi compile``, ``generate`` and the Python API ``LLM`` all go through it), so an unset
    key means the configuration's default (``config.options``) and serve's reading of it. A caller
    that wants another choice says so through a configuration key (``dtype=fp32``,
    ``enforce_eager=true``); the three engine switches the configuration does not carry
    (``compiled``, ``no_compile``, ``pack_weights``) are changed with ``dataclasses.replace``.
    LMI names in comments.
    """

    model: str  # option.model_id, fetched: a built-in name, a local directory or .gguf file
    dtype: str  # option.dtype; unset: this host's (resolve_cpu_dtype)
    max_rolling_batch_size: int  # option.max_rolling_batch_size
    n_positions: int | None  # option.n_positions (None: config.default_n_positions of the model)
    max_prefill_tokens: int  # option.max_prefill_tokens (unset: config.options.DEFAULT_MAX_PREFILL_TOKENS)
    max_queue_size: int  # SERVING_JOB_QUEUE_SIZE: waiting beyond the free rows
    tensor_parallel_degree: int  # option.tensor_parallel_degree, resolved (logical ranks on CPU)
    group_query_attention: str | None  # option.group_query_attention
    # Ahead-of-time compiled bucket graphs (neuron-lmi compile --target cpu): load from the compile
    # cache, compiling on a miss unless no_compile. compiled_graph_path (option.compiled_graph_path)
    # is the store's folder or an s3:// remote and implies compiled; compiled alone (not
    # configuration: serve runs the buckets only with a path) takes the default store.
    compiled: bool
    compiled_graph_path: str | None
    no_compile: bool  # not configuration: serve compiles on a miss; a test or benchmark refuses one
    context_length_estimate: tuple[int, ...] | None  # option.context_length_estimate
    # option.quantize: weight-only int8/int4 (neuron_lmi.models.quantize); int4 on a GGUF file runs
    # its Q4_0/Q4_1 codes as they are (Q8_0 ones as int8 per row) instead of expanding them.
    quantize: str | None
    # bf16 matmul weights pre-packed for oneDNN (neuron_lmi.models.packed); dense weights only. Not
    # configuration: serve packs; a benchmark may compare plain tensors.
    pack_weights: bool
    # Decode, prefill and extend through AOTInductor packages with frozen weights
    # (compiled_decode, compiled_extend), compiled once into the default compile cache:
    # not option.enforce_eager.
    compile_graphs: bool
    # Engine processes started after one dies (ProcessEngine); 0 with SERVING_FAIL_FAST, where the
    # server exits instead and SageMaker or Kubernetes replaces it.
    max_restarts: int
    # option.speculative_config (or LMI's option.speculative_draft_model/speculative_length): n-gram
    # or a draft model's drafts verified per row (docs/speculative-decoding.md); a draft model's
    # path is fetched like the model's (from_config).
    speculative_config: SpeculativeConfig | None
    # option.enable_lora and its kin, the start-up adapters fetched (backends.lora); None: off.
    lora: LoraSettings | None

    @classmethod
    def from_resolved(
        cls, resolved: ResolvedConfig, model_path: str | Path, tp_degree: int
    ) -> CpuEngineOptions:
        """The CPU engine's view of the serving configuration, for the model fetched to ``model_path``
        and ``tensor_parallel_degree`` already resolved (``max`` is 1 on the CPU). Unless a source set
        ``option.dtype``, this host's dtype (:func:`resolve_cpu_dtype`): the configuration's own
        default, fp16, is the Neuron one. The compiled step and extend run unless
        ``option.enforce_eager``; ``option.compiled_graph_path`` turns on the AOT bucket runner."""
        cfg = resolved.config
        given = None if resolved.source_of("dtype").startswith("default") else cfg.model.dtype
        return cls(
            model=str(model_path),
            dtype=resolve_cpu_dtype(given),
            max_rolling_batch_size=cfg.batching.max_rolling_batch_size,
            n_positions=cfg.batching.n_positions,
            max_prefill_tokens=cfg.batching.max_prefill_tokens or DEFAULT_MAX_PREFILL_TOKENS,
            max_queue_size=cfg.batching.max_queue_size,
            tensor_parallel_degree=tp_degree,
            group_query_attention=cfg.parallel.group_query_attention,
            compiled=False,
            compiled_graph_path=cfg.neuron.compiled_graph_path,
            no_compile=False,
            context_length_estimate=cfg.batching.context_length_estimate,
            quantize=cfg.neuron.quantize,
            pack_weights=True,
            compile_graphs=not cfg.model.enforce_eager,
            max_restarts=0 if cfg.server.fail_fast else DEFAULT_MAX_RESTARTS,
            speculative_config=cfg.batching.speculation,
            lora=resolve_lora(resolved, Path(model_path)),
        )

    @classmethod
    def from_config(cls, resolved: ResolvedConfig, env: Mapping[str, str] | None = None) -> CpuEngineOptions:
        """:meth:`from_resolved` as ``serve``'s CPU builder calls it: the model fetched first
        (built-in, local, ``s3://``, Hub; ``env`` default ``os.environ``) and
        ``tensor_parallel_degree=max`` as one rank (``dispatch.resolve_tp_degree`` on the CPU)."""
        env = os.environ if env is None else env
        degree = resolved.config.parallel.tensor_parallel_degree
        options = cls.from_resolved(resolved, fetch(resolved, env), 1 if degree == "max" else int(degree))
        return options.with_draft_fetched(resolved.config.model.model_loading_timeout, env)

    def with_draft_fetched(self, timeout: float, env: Mapping[str, str]) -> CpuEngineOptions:
        """These options with a draft model (``draft_model`` speculation) fetched as the model is
        (built-in, local, ``s3://``, Hub) and named by its local path; a start-up error naming the
        key where it cannot be."""
        spec = self.speculative_config
        if spec is None or spec.method != DRAFT_MODEL or spec.model is None:
            return self
        try:
            draft = fetch_model(spec.model, model_cache_dir(env), timeout, env)
        except Exception as exc:  # whatever the source raised, the key is what the user can change
            raise ValueError(f"{spec.key}: draft model {spec.model!r} cannot be read: {exc}") from exc
        return replace(self, speculative_config=replace(spec, model=str(draft)))

    def dtype_name(self) -> str:
        """``dtype`` with ``auto`` resolved for this host; the name the compile cache keys on."""
        return resolve_cpu_dtype(self.dtype)

    def torch_dtype(self) -> torch.dtype:
        dtype = canonical_dtype(self.dtype_name())
        if dtype not in CPU_DTYPES:
            raise ValueError(
                f"dtype {self.dtype_name()!r} is not supported by the CPU engine (use fp32, bf16 or auto)"
            )
        return getattr(torch, DTYPES[dtype].torch_name)

    def validate_quantize(self) -> None:
        if self.quantize is not None and self.quantize not in CPU_QUANTIZE:
            raise ValueError(
                f"quantize {self.quantize!r} is not supported by the CPU engine (use int8 or int4; "
                "fp8 and static_int8 are Neuron-only)"
            )
        if self.quantize is not None and (self.compiled or self.compiled_graph_path):
            raise ValueError("quantize: the AOT-compiled CPU runner does not take quantized weights yet")


def build_cpu_engine_core(
    options: CpuEngineOptions,
) -> tuple[EngineCore, Any]:
    """Load weights and tokenizer, build the model and its runner; returns (core, config)."""
    if options.max_rolling_batch_size <= 0:
        raise ValueError(f"max_rolling_batch_size must be positive, got {options.max_rolling_batch_size}")
    options.validate_quantize()
    # The backend's one path (plan -> compile on a miss -> load), as neuron-lmi compile walks it.
    options = replace(options, model=str(resolve_model_path(options.model)))
    plan = CPU_BACKEND.plan_for(options)
    runner = load_runner(CPU_BACKEND, plan, cache_for(options.compiled_graph_path), options.no_compile)
    ckpt, n_positions = plan.checkpoint, plan.n_positions
    tokenizer = load_tokenizer(ckpt)
    how = "configured" if options.n_positions else default_n_positions_source(max_positions(ckpt.config))
    log.info(
        "CPU engine: %s (%s), %d rows x %d positions (%s), dtype %s, weights %s, KV cache %.1f MiB",
        ckpt.source,
        ckpt.config.architectures[0],
        options.max_rolling_batch_size,
        n_positions,
        how,
        options.dtype_name(),
        options.quantize or "dense",
        runner.cache.nbytes() / 2**20,
    )
    adapters = adapter_table(options.lora, plan.model) if options.lora is not None else None
    eos = eos_ids_for(ckpt.config, tokenizer)
    core = EngineCore(
        runner,
        tokenizer,
        eos,
        options.max_prefill_tokens,
        adapters=adapters,
        speculative=options.speculative_config,
        draft_runner=draft_runner(options, n_positions, tokenizer),
    )
    return core, ckpt.config


def draft_runner(options: CpuEngineOptions, n_positions: int, tokenizer: Any) -> CpuRunner | None:
    """The draft model's runner for ``draft_model`` speculation (None otherwise): built as the
    model is (dtype, quantization), eager, with as many rows and positions as the target's cache.
    A draft that cannot be read, or whose tokenizer differs from the target's (its ids would mean
    other tokens), is a start-up error naming the key."""
    spec = options.speculative_config
    if spec is None or spec.method != DRAFT_MODEL or spec.model is None:
        return None
    try:
        path = resolve_model_path(spec.model)
        draft_options = replace(options, model=str(path), n_positions=n_positions, tensor_parallel_degree=1)
        ckpt, model, _ = load_cpu_model(draft_options, path)
        draft_tokenizer = load_tokenizer(ckpt)
    except Exception as exc:
        raise ValueError(f"{spec.key}: draft model {spec.model!r} cannot be loaded: {exc}") from exc
    mismatch = tokenizer_mismatch(tokenizer, draft_tokenizer)
    if mismatch is not None:
        raise ValueError(f"{spec.key}: draft model {spec.model!r} has another tokenizer: {mismatch}")
    runner = CpuRunner(model, options.max_rolling_batch_size, n_positions)
    if options.pack_weights:
        pack_model(model)
    log.info("draft model: %s (%s), eager, KV cache %.1f MiB", ckpt.source, ckpt.config.architectures[0],
             runner.cache.nbytes() / 2**20)  # fmt: skip
    return runner


def tokenizer_mismatch(target: Any, draft: Any) -> str | None:
    """How the draft's tokenizer differs from the target's (vocabulary, special ids), or None."""
    ours, theirs = target.get_vocab(), draft.get_vocab()
    if ours != theirs:
        differ = sorted((set(ours.items()) ^ set(theirs.items())), key=lambda kv: kv[1])[:3]
        return f"vocabularies of {len(ours)} and {len(theirs)} tokens differ (e.g. {differ})"
    for name in ("bos_token_id", "eos_token_id"):
        if getattr(target, name, None) != getattr(draft, name, None):
            return f"{name} {getattr(target, name, None)} against {getattr(draft, name, None)}"
    return None


def cpu_engine_core(options: CpuEngineOptions) -> EngineCore:
    """The CPU engine's ``EngineCore`` alone: ``ProcessEngine``'s factory (picklable with its
    arguments, through ``functools.partial``), run in the engine process."""
    return build_cpu_engine_core(options)[0]


def cpu_process_engine(options: CpuEngineOptions, model_name: str | None = None) -> ProcessEngine:
    """The CPU engine in its own process (what ``serve`` runs), built there from its options whole;
    served as ``model_name`` (the model's path by default)."""
    factory = functools.partial(cpu_engine_core, options)
    return ProcessEngine(
        factory,
        model_name or options.model,
        max_queue_size=options.max_queue_size,
        max_restarts=options.max_restarts,
        model_dtype=options.dtype,
    )


def cpu_thread_engine(options: CpuEngineOptions) -> AsyncEngine:
    """The CPU engine on a thread of this process, behind the same ``Engine`` protocol."""
    core, _config = build_cpu_engine_core(options)
    return AsyncEngine(core, model_name=options.model, max_queue_size=options.max_queue_size)


def max_positions(config: Any) -> int | None:
    """A loaded checkpoint's ``max_position_embeddings`` (a GGUF file's ``context_length``), if known."""
    value = getattr(config, "max_position_embeddings", None)
    return value if isinstance(value, int) and value > 0 else None


def load_cpu_model(options: CpuEngineOptions, path: Path) -> tuple[Any, Any, int]:
    """Checkpoint -> (checkpoint, model, n_positions): built, then sharded across logical ranks,
    then quantized (tensor parallelism splits dense weights, so it comes first). ``n_positions``
    unset takes LMI's default from the checkpoint (``config.default_n_positions``), the rule
    ``serve`` applies to every backend and model source."""
    build_in_background()  # a new host's kernel build runs beside the load and the graphs' compile
    dtype = options.torch_dtype()
    # int4: a GGUF file's Q4/Q8 codes go into the model as they are (never expanded), unless tensor
    # parallelism has dense weights to split first. int8 re-quantizes them per row from their values.
    keep = options.quantize == "int4" and options.tensor_parallel_degree == 1
    ckpt = load_checkpoint(path, dtype=dtype, keep_quantized=keep)
    n_positions = options.n_positions or default_n_positions(max_positions(ckpt.config))
    if n_positions <= 1:
        raise ValueError(f"n_positions must be at least 2, got {n_positions}")
    model = build_model(ckpt.config, ckpt.state_dict, n_positions=n_positions, dtype=dtype)
    if options.tensor_parallel_degree > 1:
        model = apply_tensor_parallel(
            model,
            options.tensor_parallel_degree,
            options.group_query_attention or "shard-over-heads",
            batch_size=options.max_rolling_batch_size,
        )
    if options.quantize is not None:
        quantize_model(model, options.quantize)
    return ckpt, model, n_positions
