"""The CPU engine's compiled step: one AOTInductor package with the weights frozen in; and what it
shares with the compiled extend (``compiled_extend``): ``FrozenPackage``, the cache key
(``decode_key_inputs``) and ``export_package``. ``backend.CpuBackend`` compiles and opens them.

``CpuRunner`` copies rows eagerly; its decode steps, and the steps that mix decodes with prompt
chunks, run this package when one is loaded (``compiled_extend``'s package runs the chunks this one
leaves: ``extend_graph_needed``). The package
holds a ``StepGraph``: a flat batch of tokens, each with its cache row and position, exported with
a dynamic token count, logit count and attention length (``2 <= L < n_positions``), so one compile
serves every step. A step that admits prompts while 27 rows decode thus runs one forward instead of
an extend and a decode, and no row of the cache is padding (the window graph it replaced ran every
row below the highest stepping one). Inductor compiles it with
``freezing``: the weights become constants it packs for oneDNN and fuses around (norms, rotary,
SiLU, residuals, in a few C++ loops; the decode attention is one C++ op, ``models.decode_attention``),
which is what makes it pay (docs/measurements.md). The dense GEMMs run where
``packed_gemm_library`` says: in fp32 a packed GEMM through ``neuron_lmi::mkl_linear`` on Intel CPUs
or ``neuron_lmi::onednn_linear`` on others (``models.packed_linear``); in bf16 oneDNN's op on those
other hosts, Inductor's own CPU templates on Intel (``BF16_DECODE_CONFIGS``). Eager remains the path of
the parity tests (``option.enforce_eager``).

With ``option.quantize`` the weights stay quantized in the decode graph: it calls torch's packed
int8/int4 kernels (``aten._weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``, which Inductor
lowers to extern calls) and compiles everything around them.

Frozen weights make the package depend on the weights' *values*: the cache key holds a content
fingerprint of the weight files, the model's architecture, dtype, quantization, rows, positions,
the torch version and the CPU's instruction-set features (``host_isa``). A compile takes minutes;
the entry is stored in the compile cache, and later starts load it. Steps outside the package's
range (the last position of a full-length row; more tokens than ``token_limit``; where the op has
no chunk path, chunks whose attention ``CHUNK_PAIR_LIMIT`` leaves to the extend graph's SDPA) run
the other way.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar

import torch
from torch import nn

from compile_cache.key import CacheKeyInputs, fingerprint_weights
from neuron_lmi.backends.cpu.aot import DTYPE_NAMES, architecture_description, cpu_capability, load_package
from neuron_lmi.backends.cpu.graphs import (
    LoraStepGraph,
    StepGraph,
    avx512_host,
    check_compilable,
    decode_attention_form,
)
from neuron_lmi.engine.scheduler import DEFAULT_STEP_TOKENS
from neuron_lmi.models import host_isa, ops, packed_linear
from neuron_lmi.models.llama import LlamaForCausalLM
from neuron_lmi.models.lora import projection_shapes
from neuron_lmi.models.native import host_cpu_flags
from neuron_lmi.models.quant import (
    Int4Linear,
    Int8Linear,
    QuantizedLinear,
    matmul_weight_slots,
    tracing_packed_kernels,
)
from neuron_lmi.runners.base import MixedStepLimits

log = logging.getLogger(__name__)

PACKAGE_FILE = "step.pt2"
# Baked into the package and part of the key. Weights live inside the package: they are frozen.
DECODE_INDUCTOR_CONFIGS = MappingProxyType({"freezing": True, "aot_inductor.package_constants_in_so": True})
# bf16 decode GEMMs: Inductor's CPU GEMM templates (AMX / AVX-512 micro-kernels, fused with their
# neighbours) autotuned against ATen/oneDNN at a decode of nearly every row: faster at every row
# count in bf16 for a compile two and a half times as long; nothing gained in fp32, which keeps ATen
# (docs/measurements.md).
BF16_DECODE_CONFIGS = MappingProxyType({"max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"})
# Per graph: bump when StepGraph / ExtendGraph or their inputs change what a package
# computes or expects (the version is part of the key, so old entries stop matching).
GRAPH_VERSIONS = MappingProxyType({"step": 3, "extend": 1})  # step 3: last layer for the logits' tokens only
# One token is exported (the example has more: torch.export specialises a dimension whose example is
# 1); the attention length starts at 2 (length 1 is never decoded, only padded).
MIN_TOKENS, MIN_ATTN_LEN = 1, 2
# Where the op has no chunk path, prompt chunks go through the step graph while their tokens attend
# to at most this many (query, key) positions in all: the per-query kernels read a row's K/V again
# for each of its chunk's tokens, where SDPA in the extend graph multiplies blocks. Four 60-token
# prompts are about 7,300. The op's chunk path has no limit: it reads each block of keys once for a
# block of a chunk's queries, faster than SDPA at every chunk length (docs/measurements.md).
CHUNK_PAIR_LIMIT = 32_768
CHUNK_PATH_HEAD_DIMS = (64, 128)  # decode_attention.cpp's chunk path; other dims run per query


@dataclass(frozen=True, slots=True)
class StepLora:
    """The step graph's LoRA inputs (``graphs.LoraStepGraph``), fixed at compile time and part of its
    key: ``slots`` adapters of rank up to ``max_rank`` on ``projections`` (sorted), as the runner's
    ``models.lora.LoraSlots`` holds them."""

    slots: int
    max_rank: int
    projections: tuple[str, ...]

    @property
    def flag(self) -> str:
        return f"lora={self.slots}x{self.max_rank}:{'+'.join(self.projections)}"

    def example_weights(self, model: LlamaForCausalLM) -> list[torch.Tensor]:
        """Zero tensors of the shapes ``LoraSlots.inputs`` hands the graph, in its order."""
        shapes, layers = projection_shapes(model.args), model.args.n_layers
        out: list[torch.Tensor] = []
        for projection in self.projections:
            d_in, outs = shapes[projection]
            room = self.max_rank * len(outs)
            out.append(torch.zeros(layers, self.slots, room, d_in, dtype=model.dtype))
            out.append(torch.zeros(layers, self.slots, room, sum(outs), dtype=model.dtype))
        return out


def chunk_pair_limit(model: LlamaForCausalLM) -> int | None:
    """The (query, key) pairs a step's prompt chunks may hold in ``model``'s step graph: None (any)
    where the op's chunk path runs (the op's form, an AVX-512 host, head dim 64 or 128, fp32, or bf16
    on a host with AVX512-BF16), else ``CHUNK_PAIR_LIMIT``."""
    bf16_dot = "avx512_bf16" in host_cpu_flags()
    chunk_path = (
        decode_attention_form() == "op"
        and avx512_host()
        and model.args.head_dim in CHUNK_PATH_HEAD_DIMS
        and (model.dtype == torch.float32 or (model.dtype == torch.bfloat16 and bf16_dot))
    )
    return None if chunk_path else CHUNK_PAIR_LIMIT


def extend_graph_needed(model: LlamaForCausalLM, n_rows: int, n_positions: int) -> bool:
    """Whether prompt chunks need the extend graph beside the step graph: where the step graph
    limits them (no chunk path in the op: ``chunk_pair_limit``; quantized weights: ``token_limit``).
    Elsewhere the step graph runs every chunk a step can hold, and not compiling the extend graph
    saves most of a first start's compile."""
    limited = chunk_pair_limit(model) is not None
    return limited or token_limit(model, n_rows, n_positions) < step_token_cap(n_rows, n_positions)


def inductor_configs(dtype: torch.dtype, graph: str, quantized: bool = False) -> dict[str, object]:
    """What Inductor compiles ``graph`` (``step`` or ``extend``) with; part of the key.
    Quantized decodes are not autotuned: the int4 template was slower than torch's packed kernel
    (docs/measurements.md)."""
    configs = dict(DECODE_INDUCTOR_CONFIGS)
    if graph == "step" and dtype == torch.bfloat16 and not quantized:
        configs.update(BF16_DECODE_CONFIGS)
    return configs


def matmul_weights(model: LlamaForCausalLM) -> list[object]:
    """Every weight the graphs multiply by: each layer's ``linear_weights``, then ``lm_head``."""
    return [getattr(owner, name) for owner, name in matmul_weight_slots(model)]


def weight_formats(model: LlamaForCausalLM) -> str:
    """The matmul weights' storage, for the key: ``dense``, ``int8``, ``int4g<group>`` (distinct
    ones, sorted), so a quantized package never answers for a dense model of the same files."""

    def name(w: object) -> str:
        if isinstance(w, Int4Linear):
            return f"int4g{w.group_size}"
        return "int8" if isinstance(w, Int8Linear) else "dense"

    return "+".join(sorted({name(w) for w in matmul_weights(model)}))


def packed_gemm_library(model: LlamaForCausalLM, graph: str) -> str | None:
    """The library whose packed GEMM ``graph`` multiplies the model's dense weights with
    (``packed_linear``: ``mkl`` or ``onednn``), or None for what Inductor picks itself.

    fp32: the decode calls the host's (``packed_linear.host_library``). The extend calls oneDNN's where
    that is the host's; on Intel it keeps ATen's GEMM, which MKL's packs did not beat there.

    bf16: oneDNN's where it is the host's library and packs bf16 (``packed_linear.dtypes``); on
    Intel, and on CPUs with AVX2 only, Inductor's templates and ATen's GEMM, autotuned.
    (Measurements: docs/measurements.md.)

    A weight goes through the op where ``quant.linear`` routes it: a 2-D tensor of the model's dtype
    (not an expert stack, not a quantized weight)."""
    dense = any(isinstance(w, torch.Tensor) and w.dim() == 2 for w in matmul_weights(model))
    if not dense:
        return None
    library = packed_linear.host_library()
    if model.dtype == torch.float32 and (graph == CompiledDecode.graph or library == "onednn"):
        return library
    if (
        model.dtype == torch.bfloat16
        and library == "onednn"
        and torch.bfloat16 in packed_linear.dtypes(library)
    ):
        return library
    return None


def is_quantized(model: LlamaForCausalLM) -> bool:
    return any(isinstance(w, QuantizedLinear) for w in matmul_weights(model))


def step_token_cap(n_rows: int, n_positions: int) -> int:
    """The most tokens an engine step holds: a decode of every row plus its prompt tokens, which the
    scheduler keeps within ``DEFAULT_STEP_TOKENS`` (``n_positions`` where larger: the limit before)."""
    return n_rows + max(n_positions, DEFAULT_STEP_TOKENS)


def token_limit(model: LlamaForCausalLM, n_rows: int, n_positions: int) -> int:
    """The most tokens one step of the package takes: ``step_token_cap``. A quantized graph runs
    torch's packed kernels, whose time grows with every token; from ``gemm_min_rows`` tokens on the
    eager step (one dequantized GEMM per weight) is cheaper, so those steps are left to it."""
    limits = [w.gemm_min_rows - 1 for w in matmul_weights(model) if isinstance(w, QuantizedLinear)]
    return min([step_token_cap(n_rows, n_positions), *limits])


def decode_unsupported(model: LlamaForCausalLM, n_rows: int, n_positions: int) -> str | None:
    """Why this model and cache cannot have a compiled decode, or None when they can."""
    try:
        check_compilable(model)
    except ValueError as exc:
        return str(exc)
    traceable = (torch.Tensor, Int4Linear, Int8Linear)
    if not all(isinstance(w, traceable) for w in matmul_weights(model)):
        return "its matmul weights are packed for oneDNN (the graphs trace dense or quantized ones)"
    if token_limit(model, n_rows, n_positions) < 3 or n_rows < 2 or n_positions < MIN_ATTN_LEN + 2:
        return f"{n_rows} rows x {n_positions} positions is too small to need one"
    return None


def decode_key_inputs(
    model: LlamaForCausalLM,
    weights_path: str | Path,
    n_rows: int,
    n_positions: int,
    graph: str = "step",
    lora: StepLora | None = None,
) -> CacheKeyInputs:
    """The compile-cache key of a frozen-weights package (``graph``: ``step`` here,
    ``extend`` for ``compiled_extend``) for ``model`` over an ``n_rows x n_positions`` cache. One dynamic
    graph covers every length, so both bucket lists are ``(n_positions,)``. ``lora``: the step
    graph's adapter inputs (the extend graph takes none)."""
    configs = inductor_configs(model.dtype, graph, is_quantized(model))
    flags = (
        *(f"{k}={v}" for k, v in sorted(configs.items())),
        f"cpu_capability={cpu_capability()}",
        f"decode_graph_version={GRAPH_VERSIONS[graph]}",
        f"graph={graph}",
        f"weights={weight_formats(model)}",
    )
    if graph == CompiledDecode.graph:
        flags = (*flags, f"decode_attention={decode_attention_form()}")
        if lora is not None:
            flags = (*flags, lora.flag)
    library = packed_gemm_library(model, graph)
    if library is not None:
        flags = (*flags, f"packed_gemm={packed_linear.op_name(library)}")
    return CacheKeyInputs(
        architecture=architecture_description(model),
        target="cpu",
        compiler="torch-aotinductor",
        compiler_version=metadata.version("torch"),
        n_positions=n_positions,
        context_buckets=(n_positions,),
        token_buckets=(n_positions,),
        dtype=DTYPE_NAMES[model.dtype],
        batch_size=n_rows,
        compiler_flags=flags,
        weights_fingerprint=fingerprint_weights(weights_path, mode="content"),
        isa_features=host_isa.isa_features(),
    )


def compile_decode_package(
    model: LlamaForCausalLM, n_rows: int, n_positions: int, out_dir: Path, lora: StepLora | None = None
) -> None:
    """Export ``StepGraph`` (``LoraStepGraph`` with ``lora``) with dynamic token count, logit count
    and length; compile it into ``out_dir``. Quantized weights stay quantized: the graph runs torch's
    packed kernels (``tracing_packed_kernels``)."""
    a = model.args
    shape = (a.n_layers, n_rows, a.n_kv_heads, n_positions, a.head_dim)
    widest = token_limit(model, n_rows, n_positions)
    # GEMMs are autotuned at the example's size: a decode of all rows but one (or of as many tokens
    # as a quantized graph takes), its logits one fewer (no two dynamic sizes equal in the example).
    n = max(3, min(n_rows, widest) - 1)
    length = MIN_ATTN_LEN + 1
    example = (
        torch.zeros(n, dtype=torch.long),
        torch.arange(n) % n_rows,
        torch.zeros(n, dtype=torch.long),
        torch.arange(n - 1),
        torch.arange(length),
        torch.zeros(shape, dtype=model.dtype),
        torch.zeros(shape, dtype=model.dtype),
    )
    tokens = torch.export.Dim("tokens", min=MIN_TOKENS, max=widest)
    outputs = torch.export.Dim("outputs", min=1, max=widest)
    attn = torch.export.Dim("attn_len", min=MIN_ATTN_LEN, max=n_positions - 1)
    dynamic: tuple[Any, ...] = ({0: tokens}, {0: tokens}, {0: tokens}, {0: outputs}, {0: attn}, None, None)
    graph: nn.Module = StepGraph(model)
    if lora is not None:
        weights = lora.example_weights(model)
        example = (*example, torch.zeros(n, dtype=torch.long), weights)
        dynamic = (*dynamic, {0: tokens}, [None] * len(weights))
        graph = LoraStepGraph(model, lora.projections)
    configs = inductor_configs(model.dtype, CompiledDecode.graph, is_quantized(model))
    library = packed_gemm_library(model, CompiledDecode.graph)
    with tracing_packed_kernels(), packed_linear.tracing_packed_linears(library, model.dtype):
        export_package(graph, example, dynamic, out_dir / PACKAGE_FILE, configs)


def export_package(
    graph: nn.Module,
    example: tuple[Any, ...],
    dynamic: tuple[Any, ...],
    package_path: Path,
    configs: dict[str, object],
) -> None:
    """``torch.export`` ``graph`` (non-strict, with the dynamic dimensions given) and compile it
    with AOTInductor into ``package_path``."""
    with torch.no_grad():
        program = torch.export.export(graph.eval(), example, dynamic_shapes=dynamic, strict=False)
    if configs.get("max_autotune"):
        # Autotuning times candidate kernels: a kernel build still running beside it would skew them.
        ops.kernels()
    torch._inductor.aoti_compile_and_package(
        program, package_path=str(package_path), inductor_configs=configs
    )


class FrozenPackage:
    """A loaded frozen-weights package of one graph; ``steps`` counts the steps it ran (the rest ran
    eagerly). Subclasses name their graph (the key's ``graph=`` flag), file and compile function."""

    graph: ClassVar[str]
    package_file: ClassVar[str]

    def __init__(
        self, package_path: Path, limit: int, n_positions: int, lora: StepLora | None = None
    ) -> None:
        self.limit, self.n_positions = limit, n_positions  # limit: ``size_limit``
        self.lora = lora  # the adapter inputs the package takes (the step graph only)
        self._package = load_package(package_path)
        self._run = self._package.loader.run  # skips AOTICompiledModel.__call__'s pytree parsing
        self.steps = 0

    @staticmethod
    def compile_package(model: LlamaForCausalLM, n_rows: int, n_positions: int, out_dir: Path) -> None:
        raise NotImplementedError

    @staticmethod
    def size_limit(model: LlamaForCausalLM, n_rows: int, n_positions: int) -> int:
        """The most rows (extend) or tokens (step) one call of the package takes, on a cache of
        ``n_rows`` x ``n_positions``."""
        return n_rows


class CompiledDecode(FrozenPackage):
    """A loaded step package. ``covers_chunks`` says whether a step fits it (a decode is chunks of
    one token); ``__call__`` runs one step. With ``lora`` the package takes adapters as inputs
    (``graphs.LoraStepGraph``): every call hands it each line's slot and the slots' weights."""

    graph = "step"
    package_file = PACKAGE_FILE
    compile_package = staticmethod(compile_decode_package)
    size_limit = staticmethod(token_limit)
    pair_limit: int | None = CHUNK_PAIR_LIMIT  # the model's ``chunk_pair_limit``, set when opened

    @property
    def limits(self) -> MixedStepLimits:
        """The token limit, the attention length under ``n_positions``, and the chunks' (query, key)
        pairs within ``pair_limit`` (the model's ``chunk_pair_limit``): the runner's capabilities
        hand these to the scheduler, which cuts a step that does not fit."""
        return MixedStepLimits(self.limit, self.pair_limit, self.n_positions)

    def covers_chunks(self, starts: Sequence[int], lengths: Sequence[int]) -> bool:
        """Chunks of ``lengths`` tokens after ``starts`` cached positions (a decode is a chunk of
        one) within ``limits``."""
        return self.limits.fits(starts, lengths)

    def __call__(
        self,
        rows: Sequence[int],
        chunks: Sequence[Sequence[int]],
        starts: Sequence[int],
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        logit_counts: Sequence[int] | None = None,
        adapters: Sequence[int | None] | None = None,
        lora_weights: Sequence[torch.Tensor] = (),
    ) -> torch.Tensor:
        """Write ``chunks[i]`` into ``rows[i]`` after its ``starts[i]`` positions (slots reserved by
        the caller, who sets the rows' lengths); logits of each chunk's last token ``[n, vocab]``,
        or with ``logit_counts`` of each chunk's last ``logit_counts[i]`` tokens in line order
        (verify lines: the graph's ``last`` is any set of tokens, its last layer runs for those).
        ``adapters``: each line's LoRA slot (None: the base model), and ``lora_weights`` the slots'
        weights (``LoraSlots.inputs``): a package with ``lora`` takes them on every call."""
        if (adapters is not None or lora_weights) and self.lora is None:
            raise ValueError("this step package takes no adapters (compiled without option.enable_lora)")
        counts = logit_counts or [1] * len(chunks)
        tokens: list[int] = []
        token_rows: list[int] = []
        positions: list[int] = []
        last: list[int] = []
        for row, chunk, start, count in zip(rows, chunks, starts, counts, strict=True):
            tokens.extend(chunk)
            token_rows.extend([row] * len(chunk))
            positions.extend(range(start, start + len(chunk)))
            last.extend(range(len(tokens) - count, len(tokens)))
        key_len = max(MIN_ATTN_LEN, max(positions) + 1)
        inputs = [torch.tensor(values, dtype=torch.long) for values in (tokens, token_rows, positions, last)]
        inputs += [torch.arange(key_len), k_cache, v_cache]
        if self.lora is not None:
            slots = adapters or [None] * len(chunks)
            per_token = [-1 if s is None else s for s, c in zip(slots, chunks, strict=True) for _ in c]
            inputs += [torch.tensor(per_token, dtype=torch.long), *lora_weights]
        (out,) = self._run(inputs)
        self.steps += 1
        return out
