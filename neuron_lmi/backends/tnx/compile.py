"""Target ``neuron``: transformers-neuronx compiles NEFFs; the compile cache stores what ``save`` wrote.

    NeuronCompileSpec --map_compile_spec--> MappedNeuronArgs --build_neuron_config--> NeuronConfig
    <Arch>ForSampling.from_pretrained(path, **kwargs, neuron_config=...) ; to_neuron() ; save(entry)

The library is imported lazily; without it ``build_neuron_config`` raises its ``RuntimeError`` naming
the packages and AWS's pip repository. During the compile ``NEURON_COMPILE_CACHE_URL`` points at the
store (``<root>/.neuron-compile-cache`` locally, or ``<remote>/.neuron-compile-cache`` for an
``s3://`` store), so neuronx-cc's own per-graph cache lives beside our entries. NEFFs are graphs
only, never weights (the library loads them at ``to_neuron``, and quantizes them then), compiled from
the architecture config and the arguments alone, so the key carries no weights fingerprint (a dry
run from a folder holding only ``config.json`` computes the key serve will) but does carry every
argument handed to the library (``library_args``: each ``from_pretrained`` keyword, each ``NeuronConfig``
field, the library's version), so a hit is never a graph compiled with other settings. The GQA
strategy in the key is the one the library runs (see ``MappedNeuronArgs.notes``).

A compile returns the model it compiled (on the device, ready): the caller serves it instead of
building it a second time from the entry.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from compile_cache import CacheKeyInputs, CompileCache, is_writable_dir
from neuron_lmi.backends.host import installed_version
from neuron_lmi.backends.tnx.args import (
    MappedNeuronArgs,
    NeuronCompileSpec,
    build_neuron_config,
    map_compile_spec,
)

COMPILER = "neuronx-cc"
LIBRARY = "transformers-neuronx"
NOT_INSTALLED = "not-installed"
NEURON_CACHE_FOLDER = ".neuron-compile-cache"  # dot-prefixed: the store never mistakes it for entries
ARGS_FILE = "neuron.json"
# config.json "architectures" entry -> transformers-neuronx class (module, name); a table, not a branch.
SAMPLING_CLASSES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("transformers_neuronx.llama.model", "LlamaForSampling"),
    "MistralForCausalLM": ("transformers_neuronx.mistral.model", "MistralForSampling"),
}


def neuron_cache_url(cache: CompileCache) -> str:
    """Where neuronx-cc's persistent cache goes for this store."""
    if cache.remote is not None:
        return f"{cache.remote.url.rstrip('/')}/{NEURON_CACHE_FOLDER}"
    return str(cache.root / NEURON_CACHE_FOLDER)


def plan_neuron_compile(
    spec: NeuronCompileSpec, cache: CompileCache, env: Mapping[str, str]
) -> MappedNeuronArgs:
    """The library-facing arguments for ``spec``, with the compile cache URL pointed at ``cache``
    (an explicit ``spec.compiled_graph_path`` wins, as in LMI)."""
    mapped = map_compile_spec(spec, env.get("NEURON_CC_FLAGS", ""))
    explicit = mapped.env.get("NEURON_COMPILE_CACHE_URL")
    # neuronx-cc writes and locks in its cache: a read-only folder (SageMaker's /opt/ml/model) cannot be it.
    if explicit is None or not (explicit.startswith("s3://") or is_writable_dir(explicit)):
        mapped.env["NEURON_COMPILE_CACHE_URL"] = neuron_cache_url(cache)
    return mapped


def sampling_class_path(architecture: str) -> tuple[str, str]:
    if architecture not in SAMPLING_CLASSES:
        raise ValueError(
            f"architecture {architecture!r} has no transformers-neuronx class here; "
            f"supported: {', '.join(sorted(SAMPLING_CLASSES))}"
        )
    return SAMPLING_CLASSES[architecture]


def neuron_key_inputs(
    spec: NeuronCompileSpec,
    mapped: MappedNeuronArgs,
    architecture: Mapping[str, Any],
    version: str | None = None,
    library_version: str | None = None,
) -> CacheKeyInputs:
    """The cache key for a Neuron compile. ``version`` defaults to the installed neuronx-cc's (and
    must be given where it is not installed); ``library_version`` to transformers-neuronx's, or
    ``not-installed``."""
    version = version or installed_version(COMPILER)
    if version is None:
        raise RuntimeError(
            f"{COMPILER} is not installed here, so the Neuron compiler version is unknown; "
            "compile on a Neuron host (inf2/trn1) with the Neuron SDK installed"
        )
    library_version = library_version or installed_version(LIBRARY) or NOT_INSTALLED
    return CacheKeyInputs(
        architecture=architecture,
        target="neuron",
        compiler=COMPILER,
        compiler_version=version,
        n_positions=spec.n_positions,
        context_buckets=mapped.context_buckets,
        token_buckets=mapped.token_buckets,
        dtype=spec.dtype,
        batch_size=spec.batch_size,
        tensor_parallel_degree=spec.tp_degree,
        gqa_strategy=mapped.gqa_strategy,
        compiler_flags=tuple(shlex.split(mapped.env.get("NEURON_CC_FLAGS", ""))),
        library_args={**mapped.key_args(), "library": LIBRARY, "library_version": library_version},
    )


@contextlib.contextmanager
def _environment(values: Mapping[str, str]) -> Iterator[None]:
    """Set ``values`` in ``os.environ`` for the duration (the compiler reads them there), then restore."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _sampling_class(architecture: str) -> Any:
    import importlib

    module, name = sampling_class_path(architecture)
    return getattr(importlib.import_module(module), name)


def compile_neuron_entry(mapped: MappedNeuronArgs, architecture: str, out_dir: Path) -> Any:
    """Compile with transformers-neuronx and ``save`` the NEFFs into ``out_dir`` (a staging folder),
    plus ``neuron.json`` recording the arguments used; return the compiled model, which is ready to
    serve. Raises ``RuntimeError`` without the library."""
    neuron_config = build_neuron_config(mapped)  # the clear "install the Neuron SDK" error comes first
    cls = _sampling_class(architecture)
    with _environment(mapped.env):
        model = cls.from_pretrained(
            mapped.model_path, **mapped.from_pretrained_kwargs, neuron_config=neuron_config
        )
        model.to_neuron()
        model.save(str(out_dir))
    record = {
        "architecture": architecture,
        "from_pretrained_kwargs": mapped.from_pretrained_kwargs,
        "neuron_config": mapped.neuron_config,
        "gqa_strategy": mapped.gqa_strategy,
        "notes": list(mapped.notes),
        "env": mapped.env,
    }
    (out_dir / ARGS_FILE).write_text(json.dumps(record, indent=2, sort_keys=True), encoding="utf-8")
    return model


def load_neuron_model(mapped: MappedNeuronArgs, architecture: str, entry_dir: Path) -> Any:
    """A ready model from a cache entry: ``from_pretrained``, ``load(entry)`` of the NEFFs, ``to_neuron``
    (which then loads instead of compiling)."""
    neuron_config = build_neuron_config(mapped)
    cls = _sampling_class(architecture)
    with _environment(mapped.env):
        model = cls.from_pretrained(
            mapped.model_path, **mapped.from_pretrained_kwargs, neuron_config=neuron_config
        )
        model.load(str(entry_dir))
        model.to_neuron()
    return model
