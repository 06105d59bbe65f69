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
from neuron_lmi.commands.cache import human_size
from neuron_lmi.commands.nxdi_target import PLATFORM_VAR, nxdi_target, nxdi_version
from neuron_lmi.config.options import DEFAULT_MODEL, NEURON_PLATFORMS

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
CPU_DTYPES = ("fp32", "bf16")
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


def _resolve(args: argparse.Namespace) -> Any:
    from neuron_lmi.config import load_config

    cli = {name: getattr(args, name, None) for name in CLI_FIELDS}
    if args.cache_url:
        cli["compiled_graph_path"] = args.cache_url
    return load_config(cli, args.properties, os.environ)


def _cache(args: argparse.Namespace, compiled_graph_path: str | None) -> Any:
    from neuron_lmi.backends.common import cache_for

    return cache_for(compiled_graph_path, args.cache_dir)


def _served_model(args: argparse.Namespace, resolved: Any) -> tuple[Path, Any, Any, Any, int]:
    """(path, engine options, checkpoint, model, n_positions): the model as ``serve`` builds it with
    these settings (``CpuEngineOptions.from_resolved``, ``load_cpu_model``), so both kinds of graph
    get serve's keys."""
    from dataclasses import replace

    from neuron_lmi.backends.cpu.engine import CpuEngineOptions, load_cpu_model
    from neuron_lmi.models.loader import resolve_model_path

    cfg = resolved.config
    if cfg.parallel.tensor_parallel_degree not in (1, "max"):
        raise ValueError("--tensor-parallel-degree: the cpu target compiles one rank (use 1)")
    path = resolve_model_path(cfg.model.model_id or DEFAULT_MODEL)
    # option.compiled_graph_path is the store this command writes into, not a runner to load here.
    options = replace(CpuEngineOptions.from_resolved(resolved, path, tp_degree=1), compiled_graph_path=None)
    if options.dtype not in CPU_DTYPES:
        raise ValueError(f"--dtype: the cpu target supports {', '.join(CPU_DTYPES)}, got {options.dtype!r}")
    options.validate_quantize()
    ckpt, model, n_positions = load_cpu_model(options, path)
    return path, options, ckpt, model, n_positions


def _compile_cpu(args: argparse.Namespace, resolved: Any) -> dict[str, Any]:
    # serve runs the bucket runner only with option.compiled_graph_path, else the frozen packages.
    graphs = args.graphs or ("buckets" if resolved.config.neuron.compiled_graph_path else "frozen")
    compile_graphs = _compile_cpu_buckets if graphs == "buckets" else _compile_cpu_frozen
    return compile_graphs(args, resolved)


def _compile_cpu_frozen(args: argparse.Namespace, resolved: Any) -> dict[str, Any]:
    """The frozen packages ``serve`` opens (``backends.cpu.engine.open_compiled_graphs``), for
    the model as served (quantized, same rows and positions), so its start loads them."""
    from neuron_lmi.backends.cpu.compiled_decode import decode_unsupported
    from neuron_lmi.backends.cpu.engine import open_compiled_graphs
    from neuron_lmi.backends.cpu.runner import CpuRunner
    from neuron_lmi.models.loader import load_tokenizer

    cfg = resolved.config
    path, options, ckpt, model, n_positions = _served_model(args, resolved)
    reason = decode_unsupported(model, options.max_rolling_batch_size, n_positions)
    if reason is not None:
        raise ValueError(f"--graphs frozen: this model and cache shape run eagerly ({reason})")
    runner = CpuRunner(model, options.max_rolling_batch_size, n_positions)
    # A compiled_graph_path reaches here only under an explicit --graphs frozen: use that store too.
    store = _cache(args, cfg.neuron.compiled_graph_path)
    opened = open_compiled_graphs(runner, path, store, args.no_compile)
    _prove_one_token(runner, load_tokenizer(ckpt))
    decode = opened[0]
    return {
        "entry": decode.entry,
        "compiled": any(o.compiled for o in opened),
        "graphs": len(opened),
        "model": str(path),
        "packages": [_package_summary(o) for o in opened],
    }


def _package_summary(opened: Any) -> dict[str, Any]:
    entry = opened.entry
    return {
        "graph": opened.package.graph,
        "key": entry.key,
        "path": str(entry.path),
        "compiled": opened.compiled,
        "size_bytes": entry.size,
        "files": len(entry.files),
    }


def _prove_one_token(runner: Any, tokenizer: Any) -> None:
    """One greedy token from a one-token prompt, through prefill and decode: the entries run."""
    row = runner.rows.allocate()
    try:
        first = int(runner.prefill([row], [[tokenizer.bos_token_id or 0]]).argmax(-1)[0])
        runner.decode([row], [first])
    finally:
        runner.rows.remove(row)


def _compile_cpu_buckets(args: argparse.Namespace, resolved: Any) -> dict[str, Any]:
    from neuron_lmi.backends.cpu.aot import CpuPlan
    from neuron_lmi.backends.cpu.aot_runner import open_compiled_runner
    from neuron_lmi.models.loader import load_tokenizer

    cfg = resolved.config
    if cfg.neuron.quantize:
        raise ValueError("--quantize: the bucket graphs take dense weights (use --graphs frozen)")
    path, options, ckpt, model, n_positions = _served_model(args, resolved)
    plan = CpuPlan.default(
        options.max_rolling_batch_size, n_positions, options.dtype, cfg.batching.context_length_estimate
    )
    cache = _cache(args, cfg.neuron.compiled_graph_path)
    opened = open_compiled_runner(model, path, plan, cache, args.no_compile, progress=not args.no_progress)
    _prove_one_token(opened.runner, load_tokenizer(ckpt))
    return {
        "entry": opened.entry,
        "compiled": opened.compiled,
        "graphs": len(plan.graphs()),
        "model": str(path),
    }


def _neuron_model_config(resolved: Any) -> tuple[Path, dict[str, Any]]:
    model_dir = Path(resolved.config.model.model_id or "")
    from neuron_lmi.config.hf_config import read_hf_config

    return model_dir, read_hf_config(model_dir, "--model: the neuron target")


def _neuron_tp(resolved: Any) -> int:
    tp = resolved.config.parallel.tensor_parallel_degree
    if tp == "max":
        raise ValueError("--tensor-parallel-degree: give a number for compile (max depends on the host)")
    return int(tp)


def _loader(args: argparse.Namespace, resolved: Any) -> str:
    loader = args.model_loader or resolved.config.neuron.model_loader or "nxdi"
    if loader not in NEURON_LOADERS:
        raise ValueError(f"--model-loader: the neuron target compiles with nxdi or tnx, got {loader!r}")
    return loader


def _nxdi(args: argparse.Namespace, resolved: Any) -> tuple[dict[str, Any], Any]:
    """(dry-run description, compile thunk) for NxD Inference."""
    from neuron_lmi.backends.nxdi.artifacts import compile_entry, nxdi_key_inputs
    from neuron_lmi.backends.nxdi.defaults import apply_environment
    from neuron_lmi.backends.nxdi.plan import plan_nxdi

    model_dir, config = _neuron_model_config(resolved)
    # The kwargs are for the release given or installed, else for the one the platform (or model)
    # needs: the dry run says which and why (library_version(_source), platform(_source)).
    key = "--platform" if args.neuron_platform else resolved.keys.get("neuron_platform", "")
    platform, version, version_source = nxdi_target(
        resolved.config.neuron.neuron_platform, key, args.nxdi_version, os.environ, not args.dry_run
    )
    plan = plan_nxdi(
        resolved.config,
        config,
        str(model_dir),
        _neuron_tp(resolved),
        version,
        platform,
        version_source,
    )
    inputs = nxdi_key_inputs(plan, config, args.compiler_version, version)
    described = {**plan.describe(), "cache_key": inputs.key(), "cache_key_inputs": inputs.describe()}

    def work(cache: Any) -> dict[str, Any]:
        apply_environment(plan.environment, os.environ)
        if resolved.config.neuron.neuron_platform:  # NxD compiles for the chip its variable names
            os.environ.setdefault(PLATFORM_VAR, resolved.config.neuron.neuron_platform)
        entry, app = compile_entry(plan, config, cache, args.no_compile, args.compiler_version)
        graphs = len(plan.context_buckets) + len(plan.token_buckets)
        return {"entry": entry, "compiled": app is not None, "graphs": graphs, "model": str(model_dir)}

    return described, work


def _tnx(args: argparse.Namespace, resolved: Any) -> tuple[dict[str, Any], Any]:
    """(dry-run description, compile thunk) for transformers-neuronx, built as serve builds it."""
    from compile_cache import architecture_config
    from neuron_lmi.backends.host import TNX, installed_version
    from neuron_lmi.backends.tnx.compile import (
        compile_neuron_entry,
        neuron_key_inputs,
        plan_neuron_compile,
        sampling_class_path,
    )
    from neuron_lmi.backends.tnx.runner import compile_spec_from_config

    model_dir, config = _neuron_model_config(resolved)
    spec = compile_spec_from_config(resolved.config, str(model_dir), _neuron_tp(resolved))
    cache_for_plan = _cache(args, resolved.config.neuron.compiled_graph_path)
    mapped = plan_neuron_compile(spec, cache_for_plan, os.environ)
    architecture = (config.get("architectures") or ["LlamaForCausalLM"])[0]
    inputs = neuron_key_inputs(
        spec, mapped, architecture_config(config), args.compiler_version or "not-installed"
    )
    module, name = sampling_class_path(architecture)

    tnx_version = installed_version(TNX.distribution)
    tnx_source = "installed" if tnx_version else "assumed: not installed, Neuron SDK <= 2.25"
    described = {
        "library": "transformers-neuronx",
        # The kwargs are ones every release takes (batch_size_for_shared_caches, not 0.13's
        # max_num_seqs); 0.13 is the last release, for Neuron SDK <= 2.25.
        "library_version": tnx_version or "0.13",
        "library_version_source": tnx_source,
        "application_class": f"{module}.{name}",
        "from_pretrained_kwargs": mapped.from_pretrained_kwargs,
        "neuron_config_class": "transformers_neuronx.NeuronConfig",
        "neuron_config_kwargs": mapped.neuron_config,
        "environment": mapped.env,
        "context_buckets": list(mapped.context_buckets),
        "token_buckets": list(mapped.token_buckets),
        "cache_key": inputs.key(),
        "cache_key_inputs": inputs.describe(),
    }

    def work(cache: Any) -> dict[str, Any]:
        ran: list[bool] = []

        def compile_fn(out: Path) -> None:
            ran.append(True)
            compile_neuron_entry(mapped, architecture, out)

        real_inputs = neuron_key_inputs(spec, mapped, architecture_config(config), args.compiler_version)
        entry = cache.get_or_compile(real_inputs, compile_fn, no_compile=args.no_compile)
        graphs = len(mapped.context_buckets) + len(mapped.token_buckets)
        return {"entry": entry, "compiled": bool(ran), "graphs": graphs, "model": str(model_dir)}

    return described, work


def _compile_neuron(args: argparse.Namespace, resolved: Any) -> dict[str, Any]:
    loader = _loader(args, resolved)
    described, work = (_nxdi if loader == "nxdi" else _tnx)(args, resolved)
    if args.dry_run:
        return {"dry_run": {"target": "neuron", "model_loader": loader, **described}}
    return work(_cache(args, resolved.config.neuron.compiled_graph_path))


def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    resolved = _resolve(args)
    if args.dry_run and args.target != "neuron":
        raise ValueError("--dry-run: only the neuron target has a dry run")
    work = _compile_cpu if args.target == "cpu" else _compile_neuron
    result = work(args, resolved)
    if "dry_run" in result:
        _print_dry_run(result["dry_run"], args.json)
        return 0
    entry = result["entry"]
    seconds = time.monotonic() - started
    summary = {
        "key": entry.key,
        "path": str(entry.path),
        "target": args.target,
        "size_bytes": entry.size,
        "files": len(entry.files),
        "graphs": result["graphs"],
        "compiled": result["compiled"],
        "seconds": round(seconds, 2),
        "model": result["model"],
    }
    if "packages" in result:
        summary["packages"] = result["packages"]
        summary["size_bytes"] = sum(p["size_bytes"] for p in result["packages"])
        summary["files"] = sum(p["files"] for p in result["packages"])
    if args.json:
        print(json.dumps(summary, indent=2, sort_keys=True))
    else:
        status = "compiled" if result["compiled"] else "cache hit, loaded without compiling"
        for package in result.get("packages", []):
            done = "compiled" if package["compiled"] else "cache hit"
            print(f"{package['graph']:<8} {package['key']} {done}, {human_size(package['size_bytes'])}")
        size = human_size(summary["size_bytes"])
        print(
            f"key      {entry.key}\npath     {entry.path}\nstatus   {status}\n"
            f"size     {size} in {summary['files']} files ({result['graphs']} graphs)\n"
            f"time     {seconds:.1f}s"
        )
    sys.stdout.flush()
    return 0


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
