"""``neuron-lmi cache``: list, show, verify, prune, push, pull compiled artifacts, and compute keys.

Every subcommand takes ``--cache-dir`` (default ``$NEURON_LMI_CACHE_DIR`` or ``~/.cache/neuron-lmi/compile``),
``--cache-url s3://bucket/prefix`` and ``--json``. Exit status: 0 success, 1 ``verify`` found damage,
2 an error (message on stderr). ``add_key_arguments``/``key_inputs_from_args`` are shared with ``compile``
so that ``cache key`` prints exactly the key a compile with the same flags uses.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
from datetime import timedelta
from importlib import metadata
from pathlib import Path
from typing import Any

from compile_cache.key import (
    GQA_STRATEGIES,
    TARGETS,
    CacheKeyInputs,
    architecture_config,
    fingerprint_weights,
    halved_context_buckets,
    missing_isa_features,
    normalize_dtype,
    token_generation_buckets,
)
from compile_cache.store import CompileCache, Entry
from neuron_lmi.config.hf_config import CONFIG_FILE, max_position_embeddings, read_hf_config_file
from neuron_lmi.config.options import default_n_positions

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$", re.IGNORECASE)
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)
_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
DEFAULT_COMPILERS = {"cpu": ("torch-aotinductor", "torch"), "neuron": ("neuronx-cc", "neuronx-cc")}


def parse_duration(text: str) -> timedelta:
    """``90s``, ``30m``, ``12h``, ``7d``, ``2w`` (a bare number is seconds)."""
    m = _DURATION.match(text)
    if not m:
        raise ValueError(f"--older-than: expected e.g. 7d, 12h, 30m, got {text!r}")
    return timedelta(seconds=float(m.group(1)) * _SECONDS[m.group(2).lower()])


def parse_size(text: str) -> int:
    """``10G``, ``500M``, ``1.5T``, ``2048`` bytes; K/M/G/T are powers of 1024 (``GiB``/``GB`` accepted)."""
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"--max-size: expected e.g. 10G, 500M, got {text!r}")
    return int(float(m.group(1)) * 1024 ** " kmgt".index(m.group(2).lower() or " "))


def _int_list(text: str | None) -> list[int] | None:
    if not text:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from exc


def human_size(n: int) -> str:
    """Bytes as a short readable size (also used by ``neuron-lmi compile``)."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


def add_key_arguments(p: argparse.ArgumentParser) -> None:
    """The flags that determine a cache key (LMI option names in the help)."""
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", type=Path, help="model folder holding config.json (and weights)")
    src.add_argument("--model-config", type=Path, help="a config.json")
    p.add_argument("--target", choices=TARGETS, default="cpu")
    p.add_argument("--tensor-parallel-degree", type=int, default=1, help="option.tensor_parallel_degree")
    p.add_argument("--max-rolling-batch-size", type=int, default=32, help="option.max_rolling_batch_size")
    p.add_argument("--n-positions", type=int, help="default min(max_position_embeddings, 4096)")
    p.add_argument("--dtype", help="fp32|fp16|bf16; default the config's torch_dtype, else fp32")
    p.add_argument("--group-query-attention", choices=GQA_STRATEGIES, help="option.group_query_attention")
    p.add_argument(
        "--context-length-estimate", help="context buckets a,b,…; default half of each token bucket"
    )
    p.add_argument(
        "--token-buckets", help="token-generation buckets a,b,…; default 128·2^k up to n_positions"
    )
    p.add_argument("--compiler", help="default torch-aotinductor (cpu) or neuronx-cc (neuron)")
    p.add_argument("--compiler-version", help="default the installed compiler package's version")
    p.add_argument("--compiler-flags", help="default $NEURON_CC_FLAGS for neuron, none for cpu")
    p.add_argument(
        "--weights",
        choices=("none", "content", "headers"),
        default="none",
        help="fingerprint the --model weights into the key (for artifacts that embed them)",
    )
    p.add_argument("--weights-fingerprint", help="an explicit weights fingerprint instead of --weights")


def key_inputs_from_args(args: argparse.Namespace) -> CacheKeyInputs:
    """Build the key inputs from ``add_key_arguments`` flags; raises ValueError naming the bad flag."""
    config_path = args.model / CONFIG_FILE if args.model else args.model_config
    config = read_hf_config_file(config_path, "--model" if args.model else "--model-config")
    n_positions = args.n_positions or default_n_positions(max_position_embeddings(config))
    tokens = tuple(_int_list(args.token_buckets) or token_generation_buckets(n_positions))
    contexts = halved_context_buckets(tokens, _int_list(args.context_length_estimate))
    compiler, package = DEFAULT_COMPILERS[args.target]
    version = args.compiler_version
    if not version:
        try:
            version = metadata.version(package)
        except metadata.PackageNotFoundError as exc:
            raise ValueError(
                f"--compiler-version: {package} is not installed here; pass the version"
            ) from exc
    flags = args.compiler_flags
    if flags is None and args.target == "neuron":
        flags = os.environ.get("NEURON_CC_FLAGS", "")
    fingerprint = args.weights_fingerprint
    if fingerprint is None and args.weights != "none":
        if not args.model:
            raise ValueError("--weights: needs --model DIR holding the weights")
        fingerprint = fingerprint_weights(args.model, mode=args.weights)
    return CacheKeyInputs(
        architecture=architecture_config(config),
        target=args.target,
        compiler=args.compiler or compiler,
        compiler_version=version,
        n_positions=n_positions,
        context_buckets=contexts,
        token_buckets=tokens,
        dtype=normalize_dtype(args.dtype or config.get("torch_dtype") or "fp32"),
        batch_size=args.max_rolling_batch_size,
        tensor_parallel_degree=args.tensor_parallel_degree,
        gqa_strategy=args.group_query_attention,
        compiler_flags=tuple(shlex.split(flags or "")),
        weights_fingerprint=fingerprint,
    )


def _cache(args: argparse.Namespace) -> CompileCache:
    return CompileCache(args.cache_dir, remote=args.cache_url)


def _emit(args: argparse.Namespace, data: Any, text: str) -> None:
    print(json.dumps(data, indent=2, sort_keys=True) if args.json else text)


def _summary(e: Entry) -> str:
    i = e.inputs
    created = e.manifest.created.strftime("%Y-%m-%d %H:%M")
    shape = f"tp={i.tensor_parallel_degree} bs={i.batch_size} n_pos={i.n_positions} {i.dtype}"
    return f"{e.key}  {e.namespace:<24} {human_size(e.size):>10}  {created}  {shape}"


def _run_list(args: argparse.Namespace) -> int:
    cache = _cache(args)
    entries = cache.list()
    lines = [_summary(e) for e in entries] or [f"no entries under {cache.root}"]
    _emit(args, [e.to_json() for e in entries], "\n".join(lines))
    return 0


def isa_fit(inputs: CacheKeyInputs) -> dict[str, Any] | None:
    """The instruction-set features an entry was built for and which of them this host lacks (a
    CPU entry), or None (an entry that names none: a Neuron artifact)."""
    if inputs.isa_features is None:
        return None
    # Imported here: torch (a second's import) only where an entry names features.
    from neuron_lmi.models import host_isa

    return {"features": list(inputs.isa_features),
            "missing_here": list(missing_isa_features(inputs, host_isa.isa_features()))}  # fmt: skip


def _isa_text(fit: dict[str, Any] | None) -> str:
    if fit is None:
        return ""
    missing = fit["missing_here"]
    where = f"NOT on this host: it lacks {', '.join(missing)}" if missing else "runs on this host"
    return f"isa {' '.join(fit['features'])} ({where})"


def _run_show(args: argparse.Namespace) -> int:
    e = _cache(args).show(args.key)
    files = "\n".join(f"  {n}  {r.size} B  sha256 {r.sha256}" for n, r in sorted(e.manifest.files.items()))
    inputs = json.dumps(e.inputs.describe(), indent=2, sort_keys=True)
    fit = isa_fit(e.inputs)
    text = (
        f"key      {e.key}\npath     {e.path}\ncreated  {e.manifest.created.isoformat()}\n"
        f"size     {human_size(e.size)}\ntool     {dict(e.manifest.tool)}\n"
        + (f"{_isa_text(fit)}\n" if fit else "")
        + f"files:\n{files}\ninputs:\n{inputs}"
    )
    _emit(args, {**e.to_json(), "isa": fit}, text)
    return 0


def _run_verify(args: argparse.Namespace) -> int:
    """Exit 1 where an entry is damaged; an entry built for features this host lacks is intact (it
    serves the hosts that have them), so it is reported, not failed."""
    cache = _cache(args)
    reports = [cache.verify(args.key)] if args.key else cache.verify_all()
    fits = [isa_fit(cache.show(r.key).inputs) if r.ok else None for r in reports]
    lines = [
        f"{r.key}  {'ok' if r.ok else 'DAMAGED: ' + '; '.join(r.problems)}"
        + (f"  {_isa_text(fit)}" if fit else "")
        for r, fit in zip(reports, fits, strict=True)
    ]
    data = [{**r.to_json(), "isa": fit} for r, fit in zip(reports, fits, strict=True)]
    _emit(args, data, "\n".join(lines) or f"no entries under {cache.root}")
    return 0 if all(r.ok for r in reports) else 1


def _run_prune(args: argparse.Namespace) -> int:
    older = parse_duration(args.older_than) if args.older_than else None
    size = parse_size(args.max_size) if args.max_size else None
    if older is None and size is None:
        raise ValueError("prune: give --older-than and/or --max-size")
    report = _cache(args).prune(older_than=older, max_size=size)
    lines = [f"removed {k}" for k in report.removed] + [f"removed leftover {p}" for p in report.leftovers]
    lines += [f"skipped {k} (in use)" for k in report.skipped_locked]
    lines.append(f"freed {human_size(report.freed_bytes)}; {report.kept} entries kept")
    _emit(args, report.to_json(), "\n".join(lines))
    return 0


def _run_transfer(args: argparse.Namespace) -> int:
    cache = _cache(args)
    result = cache.push(args.key) if args.cache_command == "push" else cache.pull(args.key)
    lines = [f"{k}  {status}" for k, status in sorted(result.items())] or ["nothing to transfer"]
    _emit(args, result, "\n".join(lines))
    return 1 if "damaged" in result.values() else 0


def _run_key(args: argparse.Namespace) -> int:
    inputs = key_inputs_from_args(args)
    path = _cache(args).root / inputs.namespace / inputs.key()
    data = {"key": inputs.key(), "namespace": inputs.namespace, "path": str(path),
            "present": path.is_dir(), "inputs": inputs.describe()}  # fmt: skip
    text = (
        f"key        {inputs.key()}\nnamespace  {inputs.namespace}\n"
        f"path       {path} ({'present' if path.is_dir() else 'absent'})\n"
        f"inputs:\n{json.dumps(inputs.describe(), indent=2, sort_keys=True)}"
    )
    _emit(args, data, text)
    return 0


def add_parser(subparsers: Any) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--cache-dir", type=Path, help="local store (default $NEURON_LMI_CACHE_DIR or ~/.cache/…)"
    )
    common.add_argument("--cache-url", help="remote store s3://bucket/prefix (AWS_ENDPOINT_URL honoured)")
    common.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser = subparsers.add_parser("cache", help="manage the compiled-artifact cache", description=__doc__)
    sub = parser.add_subparsers(dest="cache_command", required=True)
    sub.add_parser("list", parents=[common], help="list entries").set_defaults(func=_run_list)
    p = sub.add_parser("show", parents=[common], help="show one entry's manifest")
    p.add_argument("key", help="key or unique prefix (6+ hex chars)")
    p.set_defaults(func=_run_show)
    p = sub.add_parser("verify", parents=[common], help="check files against manifests (exit 1 if damaged)")
    p.add_argument("key", nargs="?", help="key or prefix; default every entry")
    p.set_defaults(func=_run_verify)
    p = sub.add_parser("prune", parents=[common], help="remove entries unused for a while or over a size")
    p.add_argument("--older-than", help="remove entries unused for this long: 7d, 12h, 30m")
    p.add_argument("--max-size", help="then remove least recently used until under this: 10G, 500M")
    p.set_defaults(func=_run_prune)
    for name, what in (("push", "upload to"), ("pull", "download from")):
        p = sub.add_parser(name, parents=[common], help=f"{what} --cache-url")
        p.add_argument("key", nargs="?", help="key or prefix; default every entry")
        p.set_defaults(func=_run_transfer)
    p = sub.add_parser("key", parents=[common], help="print the key for these compile options")
    add_key_arguments(p)
    p.set_defaults(func=_run_key)
