"""Target ``cpu``: ``torch.export`` + AOTInductor packages (``.pt2``), one per bucket.

An entry of the compile cache for this target holds::

    graphs.json          the plan: rows, n_positions, dtype, buckets, file per graph (see ``CpuPlan``)
    decode-<L>.pt2       one decode step over all rows attending over L positions (token bucket L)
    prefill-<T>.pt2      one prompt padded to T tokens (context bucket T)

Weights are NOT embedded (``aot_inductor.package_constants_in_so=False``): a package holds kernels
only (a few MB), and the loader hands every package the same live weight tensors as user-managed
constants, so N buckets cost one copy of the weights in memory and none on disk. The artifacts
depend on the weights' names, shapes and dtypes, not on their values, so the key holds the model's
architecture (``ModelArgs`` minus token ids) and a *headers* fingerprint of the weight files
(names, shapes, dtypes, offsets): a fine-tune saved with the same layout reuses the entry, which is
correct because no value is baked in. The key also pins the CPU's instruction set (AVX2/AVX-512).
The KV cache is a mutated input of every graph (see ``graphs.py``), so all artifacts of an entry
share the runner's one ``cache_api.KVCache``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from importlib import metadata
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from compile_cache.key import (
    CacheKeyInputs,
    fingerprint_weights,
    halved_context_buckets,
    token_generation_buckets,
)
from neuron_lmi.backends.cpu.graphs import (
    DecodeGraph,
    PrefillGraph,
    check_compilable,
    constant_tensors,
    decode_attention_form,
)
from neuron_lmi.config.dtypes import DTYPES
from neuron_lmi.models import host_isa, ops
from neuron_lmi.models.args import ModelArgs, MoeSpec
from neuron_lmi.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)

COMPILER = "torch-aotinductor"
PLAN_FILE = "graphs.json"
# Inductor settings baked into every package; part of the cache key as compiler flags. Read-only:
# aoti_compile_and_package adds keys to the dict it is given, so it only ever gets a copy.
INDUCTOR_CONFIGS: Mapping[str, Any] = MappingProxyType({"aot_inductor.package_constants_in_so": False})
# Bump when graphs.py or this module changes what a package computes or expects: old entries then
# stop matching instead of being loaded with the wrong inputs.
GRAPHS_VERSION = 5
# torch's dtype -> LMI's name, from the one dtype table.
DTYPE_NAMES = MappingProxyType({getattr(torch, d.torch_name): name for name, d in DTYPES.items()})
# Fields of ModelArgs that do not change a graph (token ids are the engine's business).
_NON_GRAPH_FIELDS = ("bos_token_id", "eos_token_ids")
# ModelArgs and MoeSpec fields added with the Qwen and Gemma families.
_FAMILY_FIELDS = (
    "qkv_bias", "qk_norm", "layer_windows", "local_rope", "attn_scale", "embed_scale", "hidden_act",
    "final_softcap",
)  # fmt: skip
_MOE_FAMILY_FIELDS = ("intermediate_size", "normalize", "dense_layers")

Progress = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class CpuPlan:
    """What one cpu entry compiles. Invariant: buckets strictly increasing and <= ``n_positions``;
    ``n_rows`` is both the KV cache's row count and the decode graphs' static batch."""

    n_rows: int
    n_positions: int
    dtype: str
    context_buckets: tuple[int, ...]
    token_buckets: tuple[int, ...]

    def __post_init__(self) -> None:
        for name in ("n_rows", "n_positions"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}: must be a positive int, got {value!r}")
        for name in ("context_buckets", "token_buckets"):
            buckets = tuple(int(b) for b in getattr(self, name))
            if not buckets or list(buckets) != sorted(set(buckets)) or buckets[0] <= 0:
                raise ValueError(f"{name}: need strictly increasing positive sizes, got {buckets}")
            if buckets[-1] > self.n_positions:
                raise ValueError(f"{name}: {buckets[-1]} exceeds n_positions={self.n_positions}")
            object.__setattr__(self, name, buckets)

    @classmethod
    def default(
        cls, n_rows: int, n_positions: int, dtype: str, context_length_estimate: tuple[int, ...] | None = None
    ) -> CpuPlan:
        """transformers-neuronx's buckets: tokens double from 128 to ``n_positions``; contexts are the
        estimate, else half of each token bucket."""
        tokens = token_generation_buckets(n_positions)
        return cls(
            n_rows, n_positions, dtype, halved_context_buckets(tokens, context_length_estimate), tokens
        )

    def graphs(self) -> list[tuple[str, int]]:
        """``(kind, size)`` of every graph, prefill first."""
        return [("prefill", t) for t in self.context_buckets] + [("decode", t) for t in self.token_buckets]

    def to_json(self) -> dict[str, Any]:
        files = {f"{kind}-{size}": f"{kind}-{size}.pt2" for kind, size in self.graphs()}
        return {**asdict(self), "files": files}


def architecture_description(model: LlamaForCausalLM) -> dict[str, Any]:
    """The model's ``ModelArgs`` as JSON, minus fields that do not change a graph."""
    args = asdict(model.args)
    for name in _NON_GRAPH_FIELDS:
        args.pop(name, None)
    # Fields added with the Qwen and Gemma families are left out at their defaults, so the keys of
    # packages compiled before them (Llama, Mistral) still match.
    _drop_defaults(args, ModelArgs, _FAMILY_FIELDS)
    if args.get("moe") is not None:
        _drop_defaults(args["moe"], MoeSpec, _MOE_FAMILY_FIELDS)
    return args


def _drop_defaults(values: dict[str, Any], cls: type, names: tuple[str, ...]) -> None:
    defaults = {f.name: f.default for f in fields(cls)}
    for name in names:
        if name in values and values[name] == defaults[name]:
            del values[name]


def cpu_key_inputs(model: LlamaForCausalLM, weights_path: str | Path, plan: CpuPlan) -> CacheKeyInputs:
    """The cache key of ``plan`` compiled for ``model``; the same function serves compile and serve."""
    if DTYPE_NAMES.get(model.dtype) != plan.dtype:
        raise ValueError(f"dtype: the model is {model.dtype}, the plan says {plan.dtype}")
    flags = (
        *(f"{k}={v}" for k, v in sorted(INDUCTOR_CONFIGS.items())),
        f"cpu_capability={cpu_capability()}",
        f"decode_attention={decode_attention_form()}",
        f"graphs_version={GRAPHS_VERSION}",
    )
    return CacheKeyInputs(
        architecture=architecture_description(model),
        target="cpu",
        compiler=COMPILER,
        compiler_version=metadata.version("torch"),
        n_positions=plan.n_positions,
        context_buckets=plan.context_buckets,
        token_buckets=plan.token_buckets,
        dtype=plan.dtype,
        batch_size=plan.n_rows,
        compiler_flags=flags,
        weights_fingerprint=fingerprint_weights(weights_path, mode="headers"),
        isa_features=host_isa.isa_features(),
    )


def _example_inputs(model: LlamaForCausalLM, plan: CpuPlan, kind: str, size: int) -> tuple[torch.Tensor, ...]:
    a = model.args
    shape = (a.n_layers, plan.n_rows, a.n_kv_heads, plan.n_positions, a.head_dim)
    k, v = torch.zeros(shape, dtype=model.dtype), torch.zeros(shape, dtype=model.dtype)
    if kind == "decode":
        n = plan.n_rows
        return (
            torch.zeros(n, dtype=torch.long),
            torch.zeros(n, dtype=torch.long),
            torch.ones(n, dtype=torch.bool),
            k,
            v,
        )
    one = torch.zeros(1, dtype=torch.long)
    return torch.zeros(1, size, dtype=torch.long), one, one.clone(), k, v


def cpu_capability() -> str:
    """ATen's instruction-set level (AVX512, AVX2, ...; ``ATEN_CPU_CAPABILITY`` lowers it), which
    also picks Inductor's vector ISA. Part of the key beside ``host_isa.isa_features``, the exact
    features ``-march=native`` let a package use."""
    return str(torch.backends.cpu.get_cpu_capability())


def load_package(path: Path) -> Any:
    """``aoti_load_package`` minus its device-information probe, which compiles and dlopens test
    programs in subprocesses (seconds per process) only to log a warning on mismatch; the cache key
    already pins the torch version and the host's instruction-set features. Falls back to the public
    loader when the internal class differs in this torch. AMX's tile state is requested first (a
    package Inductor built with AMX micro-GEMMs dies with SIGILL in a process that never asked), and
    the ``neuron_lmi::`` ops' kernels are registered: a package calls them through the dispatcher."""
    host_isa.request_amx()
    ops.kernels()
    try:
        from torch.export.pt2_archive._package import AOTICompiledModel

        return AOTICompiledModel(torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1))
    except (ImportError, AttributeError, TypeError):
        return torch._inductor.aoti_load_package(str(path))


def make_graph(model: LlamaForCausalLM, kind: str, size: int) -> DecodeGraph | PrefillGraph:
    if kind == "decode":
        return DecodeGraph(model, size).eval()
    if kind == "prefill":
        return PrefillGraph(model, size).eval()
    raise ValueError(f"graph kind: expected 'decode' or 'prefill', got {kind!r}")


def compile_graph(model: LlamaForCausalLM, plan: CpuPlan, kind: str, size: int, path: Path) -> None:
    """Export one graph and compile it into the AOTInductor package ``path``."""
    graph = make_graph(model, kind, size)
    with torch.no_grad():
        program = torch.export.export(graph, _example_inputs(model, plan, kind, size), strict=False)
    torch._inductor.aoti_compile_and_package(
        program, package_path=str(path), inductor_configs=dict(INDUCTOR_CONFIGS)
    )


def compile_cpu_entry(
    model: LlamaForCausalLM,
    plan: CpuPlan,
    out_dir: Path,
    progress: bool = False,
    compile_one: Callable[[LlamaForCausalLM, CpuPlan, str, int, Path], None] | None = None,
) -> None:
    """Compile every graph of ``plan`` into ``out_dir`` (an empty staging folder), then ``graphs.json``.

    ``progress`` shows a tqdm bar on stderr, one step per bucket. ``compile_one`` is the per-graph
    compiler (replaceable so tests can count what ran without paying for AOTInductor).
    """
    check_compilable(model)
    compile_one = compile_one or compile_graph
    graphs = plan.graphs()
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(graphs), unit="graph", desc="compile", dynamic_ncols=True)
    try:
        for kind, size in graphs:
            if bar is not None:
                bar.set_postfix_str(f"{kind} {size}")
            started = time.monotonic()
            compile_one(model, plan, kind, size, out_dir / f"{kind}-{size}.pt2")
            log.info("compiled %s bucket %d in %.1fs", kind, size, time.monotonic() - started)
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    (out_dir / PLAN_FILE).write_text(json.dumps(plan.to_json(), indent=2, sort_keys=True), encoding="utf-8")


class CompiledGraphs:
    """The loaded packages of one entry, bound to one model's weights.

    Invariant: every package reads the same weight tensors (user-managed constants, not copies), so
    the model passed here must stay alive and unchanged as long as the graphs are used.
    """

    def __init__(self, model: LlamaForCausalLM, entry_dir: Path, plan: CpuPlan) -> None:
        stored = json.loads((entry_dir / PLAN_FILE).read_text(encoding="utf-8"))
        wanted = json.loads(json.dumps(plan.to_json()))
        if stored != wanted:
            raise ValueError(f"{entry_dir / PLAN_FILE}: plan {stored} does not match the requested {wanted}")
        self.plan = plan
        self.prefill: dict[int, Callable[[list[torch.Tensor]], list[torch.Tensor]]] = {}
        self.decode: dict[int, Callable[[list[torch.Tensor]], list[torch.Tensor]]] = {}
        self._keep: list[Any] = []  # loaded packages and the constant maps they point into
        for kind, size in plan.graphs():
            run = self._load(model, kind, size, entry_dir / f"{kind}-{size}.pt2")
            (self.prefill if kind == "prefill" else self.decode)[size] = run

    def _load(self, model: LlamaForCausalLM, kind: str, size: int, path: Path) -> Any:
        package = load_package(path)
        constants = constant_tensors(make_graph(model, kind, size))
        wanted = package.get_constant_fqns()
        missing = sorted(set(wanted) - set(constants))
        if missing:
            raise ValueError(f"{path}: the package needs constants this model lacks: {missing[:5]}")
        package.load_constants({n: constants[n] for n in wanted}, check_full_update=True, user_managed=True)
        self._keep.append((package, constants))
        # The loader's run() skips AOTICompiledModel.__call__'s per-call pytree parsing.
        return package.loader.run
