"""``neuron-lmi compile``: trace one graph per bucket and store the artifacts in the compile cache.

Settings come from the flags, else ``--properties`` (an LMI serving.properties), else ``OPTION_*``
environment variables, else defaults (the same resolution as ``serve``), so a later ``serve`` with
the same settings computes the same key and loads the entry instead of compiling:

* ``--target cpu``: what ``serve`` with the same settings loads (``--graphs``, default by the
  settings): without ``option.compiled_graph_path`` the step package with frozen weights that the
  CPU engine runs by default, and the extend package where the step graph leaves it prompt chunks
  (``neuron_lmi/backends/cpu/compiled_decode.py``, ``compiled_extend.py``; ``--quantize`` as
  served), in the default compile cache or ``--cache-dir``
  (serve then needs ``NEURON_LMI_CACHE_DIR`` pointing there); with it (or ``--cache-url``),
  AOTInductor packages per context and token-generation bucket for the AOT-compiled runner
  (``neuron_lmi/backends/cpu/aot.py``).
  dtype as the CPU engine picks it (bf16 on CPUs with native bf16, else fp32) unless told;
* ``--target neuron``: NxD Inference's ``compile(dir)`` (``--model-loader nxdi``, the default, see
  ``neuron_lmi/backends/nxdi/``) or transformers-neuronx NEFFs (``--model-loader tnx``, SDK <= 2.25,
  see ``neuron_lmi/backends/tnx/compile.py``).

A hit loads (cpu) or reports (neuron) without compiling; ``--no-compile`` turns a miss into an
error. The end prints the key, the artifacts' size and the time taken (``--json`` for a JSON object).
``--target neuron --dry-run`` imports no Neuron package and needs only the model's ``config.json``: it
prints the exact constructor arguments, classes and the compile-cache key with its inputs, so a
compile can be reviewed before paying for an instance.
Exit status: 0 success, 2 an error (message on stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from compile_cache.key import GQA_STRATEGIES, TARGETS
from neuron_lmi.backends import registry
from neuron_lmi.backends.backend import Artifacts, CompileOptions, get_or_compile
from neuron_lmi.backends.common import cache_for
from neuron_lmi.commands.cache import human_size
from neuron_lmi.commands.nxdi_target import nxdi_version
from neuron_lmi.config import ResolvedConfig, load_config
from neuron_lmi.config.options import DEFAULT_MODEL, NEURON_PLATFORMS
from neuron_lmi.models.loader import resolve_model_path
from neuron_lmi.runners.base import BatchKind, StepBatch

CLI_FIELDS = (
    "model_id",
    "tensor_parallel_degree",
    "max_rolling_batch_size",
    "n_positions",
    "context_length_estimate",
    "dtype",
    "group_query_attention",
    "compiled_graph_path",
    "model_loader",
    "quantize",
    "neuron_platform",
)
NEURON_LOADERS = ("nxdi", "tnx")
CPU_GRAPHS = ("frozen", "buckets")


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "compile", help="compile per-bucket graphs into the compile cache", description=__doc__
    )
    p.add_argument("--model", dest="model_id", help="smollm2, a checkpoint dir or .gguf (option.model_id)")
    p.add_argument("--target", choices=TARGETS, default="cpu")
    p.add_argument("--tensor-parallel-degree", type=int, help="option.tensor_parallel_degree (default 1)")
    p.add_argument("--max-rolling-batch-size", type=int, help="option.max_rolling_batch_size (default 32)")
    p.add_argument(
        "--n-positions",
        type=int,
        help="option.n_positions (default min(max_position_embeddings, 4096))",
    )
    p.add_argument(
        "--context-length-estimate", help="context buckets a,b,c (default half of each token bucket)"
    )
    p.add_argument("--dtype", help="fp32|bf16|fp16 (cpu default: bf16 with native bf16, else fp32)")
    p.add_argument("--group-query-attention", choices=GQA_STRATEGIES, help="option.group_query_attention")
    p.add_argument("--quantize", help="option.quantize (cpu: int8|int4, frozen graphs)")
    p.add_argument(
        "--graphs",
        choices=CPU_GRAPHS,
        help="cpu target: frozen (serve's default decode and extend packages) or buckets (the "
        "AOT-compiled runner of option.compiled_graph_path); default: what serve would load",
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--cache-dir", type=Path, help="local store (default $NEURON_LMI_CACHE_DIR or ~/.cache/…)"
    )
    where.add_argument("--cache-url", help="remote store s3://bucket/prefix (pulled before, pushed after)")
    p.add_argument("--properties", help="an LMI serving.properties file (or the folder holding one)")
    p.add_argument(
        "--model-loader",
        choices=NEURON_LOADERS,
        help="neuron target: nxdi (default) or tnx (option.model_loader)",
    )
    p.add_argument(
        "--dry-run", action="store_true", help="neuron target: print the arguments and key, compile nothing"
    )
    p.add_argument(
        "--platform",
        dest="neuron_platform",
        choices=NEURON_PLATFORMS,
        help="neuron target: the chip to compile for (option.neuron_platform; default "
        "NEURON_PLATFORM_TARGET_OVERRIDE, else this host's instance type)",
    )
    p.add_argument(
        "--nxdi-version",
        type=nxdi_version,
        help="neuron target: the NxD Inference release the arguments are for (default: the installed "
        "one, else the platform's: 0.8 on inf2/trn1, 0.9 on trn2/trn3)",
    )
    p.add_argument("--compiler-version", help="neuronx-cc version for the key (default: the installed one)")
    p.add_argument("--no-compile", action="store_true", help="fail instead of compiling on a miss")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=run)


# (target, model loader) -> the backend that compiles it; the cpu target has no loader.
BACKEND_OF: dict[tuple[str, str], str] = {
    ("cpu", ""): "cpu",
    ("neuron", "nxdi"): "neuron-nxdi",
    ("neuron", "tnx"): "neuron-tnx",
}
DEFAULT_LOADER = {"cpu": "", "neuron": "nxdi"}
# What tensor_parallel_degree=max means off the device: the CPU engine compiles one rank; a Neuron
# compile needs the number (it depends on the instance that will serve it).
MAX_TP_OFF_DEVICE = {"cpu": 1}


def _resolve(args: argparse.Namespace) -> ResolvedConfig:
    cli = {name: getattr(args, name, None) for name in CLI_FIELDS}
    if args.cache_url:
        cli["compiled_graph_path"] = args.cache_url
    return load_config(cli, args.properties, os.environ)


def _backend_name(args: argparse.Namespace, resolved: ResolvedConfig) -> tuple[str, str]:
    """(backend name, model loader) for ``--target`` and ``--model-loader`` / ``option.model_loader``."""
    default = DEFAULT_LOADER[args.target]
    loader = default and (args.model_loader or resolved.config.neuron.model_loader or default)
    name = BACKEND_OF.get((args.target, loader))
    if name is None:
        raise ValueError(f"--model-loader: the neuron target compiles with nxdi or tnx, got {loader!r}")
    return name, loader


def _tp_degree(name: str, resolved: ResolvedConfig) -> int:
    tp = resolved.config.parallel.tensor_parallel_degree
    if tp == "max":
        if name not in MAX_TP_OFF_DEVICE:
            raise ValueError("--tensor-parallel-degree: give a number for compile (max depends on the host)")
        return MAX_TP_OFF_DEVICE[name]
    return int(tp)


def _prove_one_token(runner: Any, token: int) -> None:
    """One greedy token from a one-token prompt, then its decode, in the batches the scheduler would
    send (a prompt in an EXTEND batch where the runner takes new prompts so): the entries run."""
    row = runner.rows.allocate()
    kind = BatchKind.EXTEND if runner.capabilities.prefill_as_extend else BatchKind.PREFILL
    try:
        logits = runner.forward(StepBatch(kind, (row,), (0,), ((token,),), (True,)))
        first = int(logits.argmax(-1)[0])
        runner.forward(StepBatch(BatchKind.DECODE, (row,), (1,), ((first,),), (True,), decodes=1))
    finally:
        runner.rows.remove(row)


def run(args: argparse.Namespace) -> int:
    """resolve -> plan -> get_or_compile -> (load and one token, where the backend runs here), the
    path ``serve`` walks, for whichever backend the target names."""
    started = time.monotonic()
    resolved = _resolve(args)
    if args.dry_run and args.target != "neuron":
        raise ValueError("--dry-run: only the neuron target has a dry run")
    name, loader = _backend_name(args, resolved)
    backend = registry.backend(name)
    options = CompileOptions(
        purpose="describe" if args.dry_run else "compile",
        graphs=args.graphs,
        library_version=args.nxdi_version,
        compiler_version=args.compiler_version,
        platform_key="--platform" if args.neuron_platform else "",
        progress=not args.no_progress,
        cache_dir=str(args.cache_dir) if args.cache_dir else None,
    )
    request = registry.BuildRequest(resolved, os.environ, name, _tp_degree(name, resolved))
    model_path = resolve_model_path(resolved.config.model.model_id or DEFAULT_MODEL)
    plan = backend.plan(request, model_path, options)
    if args.dry_run:
        _print_dry_run({"target": args.target, "model_loader": loader, **plan.describe()}, args.json)
        return 0
    store = cache_for(resolved.config.neuron.compiled_graph_path, args.cache_dir)
    artifacts = get_or_compile(backend, plan, store, args.no_compile)
    if plan.probe_token is not None:
        _prove_one_token(backend.load(plan, artifacts), plan.probe_token)
    _print_summary(args, plan, artifacts, str(model_path), time.monotonic() - started)
    return 0


def _print_summary(
    args: argparse.Namespace, plan: Any, artifacts: Artifacts, model: str, seconds: float
) -> None:
    entries = [artifacts.entry(unit.name) for unit in plan.units]
    if not entries:
        raise ValueError("nothing to compile: this configuration runs without compiled graphs")
    entry = entries[0]
    summary: dict[str, Any] = {
        "key": entry.key,
        "path": str(entry.path),
        "target": args.target,
        "size_bytes": sum(e.size for e in entries),
        "files": sum(len(e.files) for e in entries),
        "graphs": plan.n_graphs,
        "compiled": bool(artifacts.compiled),
        "seconds": round(seconds, 2),
        "model": model,
    }
    if len(entries) > 1:  # the cpu target's frozen packages: one entry each
        summary["packages"] = [
            {
                "graph": unit.name,
                "key": e.key,
                "path": str(e.path),
                "compiled": unit.name in artifacts.compiled,
                "size_bytes": e.size,
                "files": len(e.files),
            }
            for unit, e in zip(plan.units, entries, strict=True)
        ]
    if args.json:
        print(json.dumps(summary, indent=2, sort_keys=True))
    else:
        status = "compiled" if summary["compiled"] else "cache hit, loaded without compiling"
        for package in summary.get("packages", []):
            done = "compiled" if package["compiled"] else "cache hit"
            print(f"{package['graph']:<8} {package['key']} {done}, {human_size(package['size_bytes'])}")
        size = human_size(summary["size_bytes"])
        print(
            f"key      {entry.key}\npath     {entry.path}\nstatus   {status}\n"
            f"size     {size} in {summary['files']} files ({plan.n_graphs} graphs)\n"
            f"time     {seconds:.1f}s"
        )
    sys.stdout.flush()


def _print_dry_run(described: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(described, indent=2, sort_keys=True))
    else:
        for name in ("model_loader", "library", "application_class", "neuron_config_class", "cache_key"):
            print(f"{name:20} {described.get(name)}")
        for name in ("platform", "library_version", "dtype"):
            if name in described:
                source = described.get(f"{name}_source") or described.get("library_version_source")
                print(f"{name:20} {described[name] or '-'} ({source})")
        for warning in described.get("warnings", []):
            print(f"warning              {warning}")
        print("neuron_config_kwargs " + json.dumps(described["neuron_config_kwargs"], sort_keys=True))
        if described.get("ignored"):
            for key, reason in described["ignored"].items():
                print(f"ignored              {key}: {reason}")
    sys.stdout.flush()
