"""``neuron-lmi compile``: trace one graph per bucket and store the artifacts in the compile cache.

Settings come from the flags, else ``--properties`` (an LMI serving.properties), else ``OPTION_*``
environment variables, else defaults (the same resolution as ``serve``), so a later ``serve`` with
the same settings computes the same key and loads the entry instead of compiling:

* ``--target cpu``: AOTInductor packages per context and token-generation bucket (see
  ``neuron_lmi/compile/cpu_aot.py``); dtype fp32 unless told, like the CPU engine;
* ``--target neuron``: transformers-neuronx NEFFs (see ``neuron_lmi/compile/neuron.py``).

A hit loads (cpu) or reports (neuron) without compiling; ``--no-compile`` turns a miss into an
error. The end prints the key, the artifacts' size and the time taken (``--json`` for a JSON object).
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

CLI_FIELDS = (
    "model_id",
    "tensor_parallel_degree",
    "max_rolling_batch_size",
    "n_positions",
    "context_length_estimate",
    "dtype",
    "group_query_attention",
    "compiled_graph_path",
)
CPU_DTYPES = ("fp32", "bf16")


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
        help="option.n_positions (default min(max_position_embeddings, 2048) on cpu, 4096 on neuron)",
    )
    p.add_argument(
        "--context-length-estimate", help="context buckets a,b,c (default half of each token bucket)"
    )
    p.add_argument("--dtype", help="fp32|bf16|fp16 (cpu default fp32)")
    p.add_argument("--group-query-attention", choices=GQA_STRATEGIES, help="option.group_query_attention")
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--cache-dir", type=Path, help="local store (default $NEURON_LMI_CACHE_DIR or ~/.cache/…)"
    )
    where.add_argument("--cache-url", help="remote store s3://bucket/prefix (pulled before, pushed after)")
    p.add_argument("--properties", help="an LMI serving.properties file (or the folder holding one)")
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
    from neuron_lmi.runners.compiled import cache_for

    return cache_for(compiled_graph_path, args.cache_dir)


def _compile_cpu(args: argparse.Namespace, resolved: Any) -> dict[str, Any]:
    from neuron_lmi.compile.cpu_aot import CpuPlan
    from neuron_lmi.engine.build import DEFAULT_MAX_N_POSITIONS, DTYPES
    from neuron_lmi.models import build_model
    from neuron_lmi.models.loader import load_checkpoint, load_tokenizer, resolve_model_path
    from neuron_lmi.runners.compiled import open_compiled_runner

    cfg = resolved.config
    if cfg.parallel.tensor_parallel_degree not in (1, "max"):
        raise ValueError("--tensor-parallel-degree: the cpu target compiles one rank (use 1)")
    dtype = args.dtype or ("fp32" if resolved.source_of("dtype").startswith("default") else cfg.model.dtype)
    if dtype not in CPU_DTYPES:
        raise ValueError(f"--dtype: the cpu target supports {', '.join(CPU_DTYPES)}, got {dtype!r}")
    path = resolve_model_path(cfg.model.model_id or "smollm2")
    ckpt = load_checkpoint(path, dtype=DTYPES[dtype])
    # As build_cpu_engine_core does, so that serve with the same settings computes the same key.
    max_pos = int(getattr(ckpt.config, "max_position_embeddings", DEFAULT_MAX_N_POSITIONS))
    n_positions = cfg.batching.n_positions or min(max_pos, DEFAULT_MAX_N_POSITIONS)
    model = build_model(ckpt.config, ckpt.state_dict, n_positions=n_positions, dtype=DTYPES[dtype])
    plan = CpuPlan.default(
        cfg.batching.max_rolling_batch_size, n_positions, dtype, cfg.batching.context_length_estimate
    )
    cache = _cache(args, cfg.neuron.compiled_graph_path)
    opened = open_compiled_runner(model, path, plan, cache, args.no_compile, progress=not args.no_progress)
    # Prove the entry runs: one greedy token from a one-token prompt, through prefill and decode.
    tok = load_tokenizer(ckpt)
    runner = opened.runner
    row = runner.rows.allocate()
    first = int(runner.prefill([row], [[tok.bos_token_id or 0]]).argmax(-1)[0])
    runner.decode([row], [first])
    runner.rows.remove(row)
    return {
        "entry": opened.entry,
        "compiled": opened.compiled,
        "graphs": len(plan.graphs()),
        "model": str(path),
    }


def _compile_neuron(args: argparse.Namespace, resolved: Any) -> dict[str, Any]:
    from compile_cache import architecture_config
    from neuron_lmi.backends.neuron_args import NeuronCompileSpec
    from neuron_lmi.compile.neuron import compile_neuron_entry, neuron_key_inputs, plan_neuron_compile
    from neuron_lmi.config import default_n_positions

    cfg = resolved.config
    model_dir = Path(cfg.model.model_id or "")
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise ValueError(
            f"--model: the neuron target needs a Hugging Face checkpoint folder; {config_path} is missing"
        )
    config = json.loads(config_path.read_text(encoding="utf-8"))
    tp = cfg.parallel.tensor_parallel_degree
    if tp == "max":
        raise ValueError("--tensor-parallel-degree: give a number for compile (max depends on the host)")
    spec = NeuronCompileSpec(
        model_path=str(model_dir),
        tp_degree=tp,
        batch_size=cfg.batching.max_rolling_batch_size,
        n_positions=cfg.batching.n_positions or default_n_positions(config.get("max_position_embeddings")),
        dtype=args.dtype or cfg.model.dtype,
        context_length_estimate=cfg.batching.context_length_estimate,
        group_query_attention=cfg.parallel.group_query_attention,
    )
    cache = _cache(args, cfg.neuron.compiled_graph_path)
    mapped = plan_neuron_compile(spec, cache, os.environ)
    inputs = neuron_key_inputs(spec, mapped, architecture_config(config))
    architecture = (config.get("architectures") or ["LlamaForCausalLM"])[0]
    ran: list[bool] = []

    def compile_fn(out: Path) -> None:
        ran.append(True)
        compile_neuron_entry(mapped, architecture, out)

    entry = cache.get_or_compile(inputs, compile_fn, no_compile=args.no_compile)
    return {
        "entry": entry,
        "compiled": bool(ran),
        "graphs": len(mapped.context_buckets) + len(mapped.token_buckets),
        "model": str(model_dir),
    }


def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    resolved = _resolve(args)
    work = _compile_cpu if args.target == "cpu" else _compile_neuron
    result = work(args, resolved)
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
    if args.json:
        print(json.dumps(summary, indent=2, sort_keys=True))
    else:
        status = "compiled" if result["compiled"] else "cache hit, loaded without compiling"
        print(
            f"key      {entry.key}\npath     {entry.path}\nstatus   {status}\n"
            f"size     {human_size(entry.size)} in {len(entry.files)} files ({result['graphs']} graphs)\n"
            f"time     {seconds:.1f}s"
        )
    sys.stdout.flush()
    return 0
