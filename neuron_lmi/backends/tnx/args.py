"""From our compile settings to transformers-neuronx's arguments: a pure mapping, then one lazy build.

    NeuronCompileSpec --map_compile_spec--> MappedNeuronArgs
        .from_pretrained_kwargs  LlamaForSampling/MistralForSampling.from_pretrained(path, **kwargs)
        .neuron_config           plain description of NeuronConfig's fields
        .env                     NEURON_CC_FLAGS, NEURON_COMPILE_CACHE_URL for the compiler process
        .notes                   where the library will run something other than what was asked
    build_neuron_config(mapped) -> transformers_neuronx.NeuronConfig (imports the library lazily)

Facts used, read in aws-neuron/transformers-neuronx (v0.13 and the releases before it):
``from_pretrained`` takes ``batch_size, tp_degree, n_positions, amp ('f32'|'f16'|'bf16'),
context_length_estimate`` and ``neuron_config`` (``llama/model.py``); ``config.py``
``ContinuousBatchingConfig(batch_size_for_shared_caches=...)`` (the keyword every release accepts;
``max_num_seqs`` only 0.13), ``NeuronConfig(continuous_batching, group_query_attention, fuse_qkv,
padding_side, quant)``, continuous batching forcing ``padding_side='right'``, and
``QuantizationConfig(quant_dtype='s8', dequant_dtype=amp)`` (the dequant type must match amp);
``bucket.py``: token buckets double from 128 up to ``n_positions``; without
``context_length_estimate`` the context buckets are *half* of each token bucket, so the largest is
``n_positions / 2`` and a longer prompt is fed one token per call; we pass the token buckets as the
estimate instead, so context encoding reaches ``n_positions``. Under continuous batching the
context-encoding decoders are built with batch 1 (``llama/model.py``), so ``check_gqa_fallback``
(``decoder.py``) rewrites ``shard-over-batch`` at any tp > 1; the mapping passes what the library
will run and says why (``gqa.continuous_batching_strategy``).  LMI's keys and flag handling:
djl-serving ``tnx_properties.py``.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from compile_cache.key import token_generation_buckets
from neuron_lmi.backends.dispatch import NEURON_PIP_REPOSITORY
from neuron_lmi.backends.tnx.gqa import continuous_batching_strategy
from neuron_lmi.config import default_n_positions
from neuron_lmi.config.dtypes import DTYPES
from neuron_lmi.config.hf_config import read_hf_config
from neuron_lmi.parallel.head_layout import GQAStrategy

if TYPE_CHECKING:
    from neuron_lmi.config.options import ServingConfig

AMP = MappingProxyType({d.name: d.amp for d in DTYPES.values()})
QUANTIZE_METHODS = ("static_int8",)  # LMI's option.quantize for transformers-neuronx
NEURON_PACKAGES = ("transformers-neuronx", "torch-neuronx", "neuronx-cc")
MIN_BUCKET = 128
GEOMETRY = ("n_query_heads", "n_kv_heads", "head_dim")


@dataclass(frozen=True, slots=True)
class NeuronCompileSpec:
    """What to compile, in LMI's vocabulary (``option.*``).

    Invariants (checked on construction): positive ``tp_degree``, ``batch_size`` (the max rolling
    batch size, which is also the continuous-batching ``max_num_seqs``) and ``n_positions``; ``dtype``
    in ``AMP``; context estimates positive, at most ``n_positions``, stored sorted and unique;
    ``group_query_attention`` one of the four GQA names or ``None`` (as asked for: the mapping
    reports what the library runs); ``neuron_optimize_level`` 1-3. The model's attention geometry
    (``n_query_heads``, ``n_kv_heads``, ``head_dim``), when given, lets the mapping predict the GQA
    fallbacks the library applies; ``compile_spec_from_config`` reads it from ``config.json``.
    """

    model_path: str
    tp_degree: int
    batch_size: int
    n_positions: int
    dtype: str = "fp16"
    context_length_estimate: tuple[int, ...] | None = None
    group_query_attention: str | None = None
    fuse_qkv: bool = False
    quantize: str | None = None
    neuron_optimize_level: int | None = None
    enable_saturate_infinity: bool = False
    enable_mixed_precision_accumulation: bool = False
    compiled_graph_path: str | None = None
    n_query_heads: int | None = None
    n_kv_heads: int | None = None
    head_dim: int | None = None

    def __post_init__(self) -> None:
        if not self.model_path:
            raise ValueError("model_path must not be empty")
        for name in ("tp_degree", "batch_size", "n_positions", "n_query_heads", "n_kv_heads", "head_dim"):
            value = getattr(self, name)
            if value is None and name in GEOMETRY:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if (self.n_query_heads is None) != (self.n_kv_heads is None):
            raise ValueError("n_query_heads and n_kv_heads go together (both or neither)")
        if self.dtype not in AMP:
            raise ValueError(f"dtype={self.dtype!r} is not one of {', '.join(AMP)}")
        if self.context_length_estimate is not None:
            estimates = tuple(sorted(set(self.context_length_estimate)))
            bad = [e for e in estimates if isinstance(e, bool) or not isinstance(e, int) or e < 1]
            if bad or not estimates:
                raise ValueError(
                    f"context_length_estimate needs positive integers, got {self.context_length_estimate!r}"
                )
            if estimates[-1] > self.n_positions:
                raise ValueError(
                    f"context_length_estimate {estimates[-1]} exceeds n_positions={self.n_positions}"
                )
            object.__setattr__(self, "context_length_estimate", estimates)
        gqa = GQAStrategy.parse(self.group_query_attention)
        object.__setattr__(self, "group_query_attention", gqa.value if gqa else None)
        if self.quantize is not None and self.quantize not in QUANTIZE_METHODS:
            raise ValueError(f"quantize={self.quantize!r} is not one of {', '.join(QUANTIZE_METHODS)}")
        level = self.neuron_optimize_level
        if level is not None and (isinstance(level, bool) or level not in (1, 2, 3)):
            raise ValueError(f"neuron_optimize_level must be 1, 2 or 3, got {level!r}")

    @property
    def amp(self) -> str:
        return AMP[self.dtype]


@dataclass(frozen=True, slots=True)
class MappedNeuronArgs:
    """The library-facing form of a ``NeuronCompileSpec``; plain, JSON-serialisable values only.

    The dicts are fresh per ``map_compile_spec`` call; callers treat them as read-only.
    ``neuron_config["group_query_attention"]`` is what the library will run (a fallback it would
    apply is applied here, and ``notes`` says why); ``gqa_strategy`` names it even where the
    library's default is left implicit (None passed).
    """

    model_path: str
    from_pretrained_kwargs: dict[str, Any]
    neuron_config: dict[str, Any]
    env: dict[str, str]
    token_buckets: tuple[int, ...] = field(default=())
    context_buckets: tuple[int, ...] = field(default=())
    gqa_strategy: str | None = None
    notes: tuple[str, ...] = field(default=())

    def key_args(self) -> dict[str, Any]:
        """Everything handed to the library, for the compile-cache key (``CacheKeyInputs.library_args``):
        every ``from_pretrained`` keyword and every ``NeuronConfig`` field passed."""
        return {"from_pretrained_kwargs": self.from_pretrained_kwargs, "neuron_config": self.neuron_config}


def tnx_token_buckets(n_positions: int) -> tuple[int, ...]:
    """``bucket.token_sizes``: 128, 256, ... doubling while below ``n_positions``, then ``n_positions``."""
    if isinstance(n_positions, bool) or not isinstance(n_positions, int) or n_positions < 1:
        raise ValueError(f"n_positions must be a positive integer, got {n_positions!r}")
    return token_generation_buckets(n_positions, MIN_BUCKET)


def tnx_context_buckets(
    n_positions: int, context_length_estimate: tuple[int, ...] | None = None
) -> tuple[int, ...]:
    """The context-encoding buckets: the given estimates sorted, else the token buckets, so the
    largest reaches ``n_positions`` (the library's own default, half of each token bucket, stops at
    ``n_positions / 2``; we pass these as ``context_length_estimate``)."""
    if context_length_estimate:
        return tuple(sorted(context_length_estimate))
    return tnx_token_buckets(n_positions)


def map_compile_spec(spec: NeuronCompileSpec, existing_cc_flags: str = "") -> MappedNeuronArgs:
    """Pure mapping; ``existing_cc_flags`` is the caller's current ``NEURON_CC_FLAGS`` (kept first,
    as LMI appends to it).  A flag already present is not repeated; an ``-O``/``--optlevel`` flag
    already present is replaced by ``neuron_optimize_level`` when that is set."""
    contexts = tnx_context_buckets(spec.n_positions, spec.context_length_estimate)
    kwargs: dict[str, Any] = {
        "batch_size": spec.batch_size,
        "tp_degree": spec.tp_degree,
        "n_positions": spec.n_positions,
        "amp": spec.amp,
        "context_length_estimate": list(contexts),
    }
    passed, effective, note = _gqa(spec)
    neuron_config: dict[str, Any] = {
        "continuous_batching": {"batch_size_for_shared_caches": spec.batch_size},
        "group_query_attention": passed,
        "fuse_qkv": spec.fuse_qkv,
        "padding_side": "right",  # the library forces it with continuous batching
        "quant": {"quant_dtype": "s8", "dequant_dtype": spec.amp} if spec.quantize else None,
    }
    return MappedNeuronArgs(
        model_path=spec.model_path,
        from_pretrained_kwargs=kwargs,
        neuron_config=neuron_config,
        env=_environment(spec, existing_cc_flags),
        token_buckets=tnx_token_buckets(spec.n_positions),
        context_buckets=contexts,
        gqa_strategy=effective,
        notes=(note,) if note else (),
    )


def _gqa(spec: NeuronCompileSpec) -> tuple[str | None, str | None, str | None]:
    """(value passed to ``NeuronConfig``, strategy the library runs, why they differ from the request).

    With the model's geometry this is ``check_gqa_fallback`` under continuous batching; without it
    only the batch-1 rule is known (shard-over-batch at tp > 1), and the library may still replicate
    KV heads. A request honoured as it is is passed unchanged (None stays the library default).
    """
    requested = GQAStrategy.parse(spec.group_query_attention)
    if spec.n_query_heads is not None and spec.n_kv_heads is not None:
        head_dim = spec.head_dim or 1
        strategy, reason = continuous_batching_strategy(
            spec.n_query_heads, spec.n_kv_heads, head_dim, spec.tp_degree, requested
        )
    elif requested is GQAStrategy.SHARD_OVER_BATCH and spec.tp_degree > 1:
        strategy = GQAStrategy.SHARD_OVER_HEADS
        reason = (
            "continuous batching builds the context-encoding decoders with batch 1, so transformers-neuronx "
            f"replaces shard-over-batch at tp_degree={spec.tp_degree}; using shard-over-heads (model "
            "geometry unknown: KV heads are replicated if n_kv_heads is not divisible by tp_degree)"
        )
    else:
        return (requested.value if requested else None), (requested.value if requested else None), None
    if reason is None:
        return (requested.value if requested else None), strategy.value, None
    return strategy.value, strategy.value, reason


def build_neuron_config(mapped: MappedNeuronArgs) -> Any:
    """The real ``transformers_neuronx.NeuronConfig`` for ``mapped``; needs the Neuron SDK.

    Raises ``RuntimeError`` naming the missing packages and where they come from when the import
    fails (they are not on PyPI's default index but on AWS's Neuron pip repository).
    """
    try:
        from transformers_neuronx import GQA, NeuronConfig, QuantizationConfig
        from transformers_neuronx.config import ContinuousBatchingConfig
    except ImportError as exc:
        raise RuntimeError(
            f"building a NeuronConfig needs the AWS Neuron SDK ({', '.join(NEURON_PACKAGES)}), "
            f"which could not be imported ({exc}); install them from AWS's Neuron pip repository: "
            f"pip install --extra-index-url {NEURON_PIP_REPOSITORY} {' '.join(NEURON_PACKAGES)}"
        ) from exc
    fields = dict(mapped.neuron_config)
    kwargs: dict[str, Any] = {
        "continuous_batching": ContinuousBatchingConfig(**fields["continuous_batching"]),
        "fuse_qkv": fields["fuse_qkv"],
        "padding_side": fields["padding_side"],
    }
    if fields["group_query_attention"] is not None:
        kwargs["group_query_attention"] = GQA(fields["group_query_attention"])
    if fields["quant"] is not None:
        kwargs["quant"] = QuantizationConfig(**fields["quant"])
    return NeuronConfig(**kwargs)


def _environment(spec: NeuronCompileSpec, existing_cc_flags: str) -> dict[str, str]:
    flags = shlex.split(existing_cc_flags)
    if spec.neuron_optimize_level is not None:
        flags = [*_without_opt_level(flags), f"-O{spec.neuron_optimize_level}"]
    if spec.enable_saturate_infinity:
        flags.append("--enable-saturate-infinity")
    if spec.enable_mixed_precision_accumulation:
        flags.append("--enable-mixed-precision-accumulation")
    unique = list(dict.fromkeys(flags))
    env: dict[str, str] = {}
    if unique:
        env["NEURON_CC_FLAGS"] = shlex.join(unique)
    if spec.compiled_graph_path:
        env["NEURON_COMPILE_CACHE_URL"] = spec.compiled_graph_path
    return env


def _without_opt_level(flags: list[str]) -> list[str]:
    """Drop ``-O<n>``, ``--optlevel=<n>`` and ``--optlevel <n>``."""
    kept: list[str] = []
    skip_value = False
    for flag in flags:
        if skip_value:
            skip_value = False
        elif flag == "--optlevel":
            skip_value = True
        elif not re.fullmatch(r"-O\d|--optlevel=\d", flag):
            kept.append(flag)
    return kept


def compile_spec_from_config(
    config: ServingConfig,
    model_path: str,
    tp_degree: int | None = None,
    model_config: Mapping[str, Any] | None = None,
) -> NeuronCompileSpec:
    """The one ``NeuronCompileSpec`` for a ``ServingConfig``, used by ``serve`` and by
    ``neuron-lmi compile --target neuron`` alike, so both compute the same cache key.

    LMI's names map one to one (dtype, context_length_estimate, group_query_attention, fuse_qkv,
    quantize, neuron_optimize_level, enable_saturate_infinity, enable_mixed_precision_accumulation,
    compiled_graph_path); the rolling batch size is the compiled batch (continuous batching needs
    ``batch_size_for_shared_caches == batch_size``); ``n_positions`` unset is LMI's default
    ``min(max_position_embeddings, 4096)``; the attention geometry comes from ``config.json``
    (``model_config``, read from ``model_path`` when not given; weights are not needed).
    ``tp_degree`` resolves ``tensor_parallel_degree=max`` (the caller counts the visible NeuronCores).
    """
    parallel, batching, neuron = config.parallel, config.batching, config.neuron
    tp = parallel.tensor_parallel_degree
    if tp == "max":
        if tp_degree is None:
            raise ValueError("tensor_parallel_degree=max needs the number of visible NeuronCores")
        tp = tp_degree
    hf = dict(model_config) if model_config is not None else read_model_config(model_path)
    n_positions = batching.n_positions or default_n_positions(_positive(hf.get("max_position_embeddings")))
    n_query = _positive(hf.get("num_attention_heads"))
    n_kv = _positive(hf.get("num_key_value_heads")) or n_query
    hidden = _positive(hf.get("hidden_size"))
    head_dim = _positive(hf.get("head_dim")) or (hidden // n_query if hidden and n_query else None)
    return NeuronCompileSpec(
        model_path=model_path,
        tp_degree=int(tp),
        batch_size=batching.max_rolling_batch_size,
        n_positions=n_positions,
        dtype=config.model.dtype,
        context_length_estimate=batching.context_length_estimate,
        group_query_attention=parallel.group_query_attention,
        fuse_qkv=neuron.fuse_qkv,
        quantize=neuron.quantize,
        neuron_optimize_level=neuron.neuron_optimize_level,
        enable_saturate_infinity=neuron.enable_saturate_infinity,
        enable_mixed_precision_accumulation=neuron.enable_mixed_precision_accumulation,
        compiled_graph_path=neuron.compiled_graph_path,
        n_query_heads=n_query,
        n_kv_heads=n_kv if n_query else None,
        head_dim=head_dim,
    )


def _positive(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def read_model_config(model_path: str) -> dict[str, Any]:

    return read_hf_config(model_path, "the Neuron backend")
