"""Compile cache on SmolLM2: cold compile, warm start, and decode tokens/s compiled vs eager, in one run.

Each phase runs in a fresh Python process (so the warm start pays what a restarted replica pays):

    cold     empty store and empty TorchInductor cache: load weights, compile every bucket, first token
    warm     same settings, store populated: load weights, cache hit, load packages, first token
    decode   one process builds the eager ``CpuRunner`` and the ``CompiledCpuRunner`` on the same
             weights, fills all rows with a prompt each, and times greedy decode steps at batch
             ``--rows``, alternating eager/compiled ``--rounds`` times (best of each reported)

Times exclude Python's import of torch/transformers (the same for every phase). The warm start
is reported whole (weights + lookup + package load + first token) and from the cache hit on.
Targets: warm start <= 5% of cold compile; compiled decode >= 1.3x eager.

    .venv/bin/python bench/compile_cache.py --rows 8 --n-positions 256 --context-length-estimate 128
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Run as a script, this file's folder is sys.path[0] and this file would shadow the compile_cache
# package it measures: put the repository root first instead.
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]


def _setup(args: argparse.Namespace):
    import torch

    from compile_cache import CompileCache
    from neuron_lmi.backends.cpu.aot import CpuPlan
    from neuron_lmi.models import build_model
    from neuron_lmi.models.loader import load_checkpoint, resolve_model_path

    started = time.monotonic()
    path = resolve_model_path(args.model)
    ckpt = load_checkpoint(path, dtype=torch.float32)
    model = build_model(ckpt.config, ckpt.state_dict, n_positions=args.n_positions)
    estimate = (
        tuple(int(x) for x in args.context_length_estimate.split(","))
        if args.context_length_estimate
        else None
    )
    plan = CpuPlan.default(args.rows, args.n_positions, "fp32", estimate)
    return model, path, plan, CompileCache(args.store), time.monotonic() - started


def _first_token(runner, prompt: list[int]) -> int:
    row = runner.rows.allocate()
    token = int(runner.prefill([row], [prompt]).argmax(-1)[0])
    runner.rows.remove(row)
    return token


def phase_start(args: argparse.Namespace) -> dict[str, float | bool | str]:
    """Cold or warm start: weights, cache lookup (or compile), package load, first token."""
    import neuron_lmi.models.loader  # noqa: F401 - imports (torch, transformers) are not part of a start
    from neuron_lmi.backends.backend import get_or_compile
    from neuron_lmi.backends.cpu.backend import CPU_BACKEND, bucket_plan

    started = time.monotonic()
    model, path, plan, cache, load_s = _setup(args)
    hit_started = time.monotonic()
    built = bucket_plan(model, path, plan)
    artifacts = get_or_compile(CPU_BACKEND, built, cache, no_compile=args.phase == "warm")
    runner = CPU_BACKEND.load(built, artifacts)
    open_s = time.monotonic() - hit_started
    _first_token(runner, list(range(100, 120)))
    now = time.monotonic()
    entry = artifacts.entry("buckets")
    return {
        "seconds": now - started,
        "weights_s": load_s,
        "open_s": open_s,
        "lookup_to_token_s": now - hit_started,
        "compiled": bool(artifacts.compiled),
        "key": entry.key,
        "entry_bytes": entry.size,
    }


def _decode_rate(runner, rows: int, steps: int) -> float:
    slots = [runner.rows.allocate() for _ in range(rows)]
    logits = runner.prefill(slots, [list(range(100 + i, 120 + i)) for i in range(rows)])
    tokens = [int(t) for t in logits.argmax(-1)]
    runner.decode(slots, tokens)  # warm-up step
    started = time.perf_counter()
    for _ in range(steps):
        tokens = [int(t) for t in runner.decode(slots, tokens).argmax(-1)]
    elapsed = time.perf_counter() - started
    for s in slots:
        runner.rows.remove(s)
    return rows * steps / elapsed


def phase_decode(args: argparse.Namespace) -> dict[str, float]:
    from neuron_lmi.backends.backend import load_runner
    from neuron_lmi.backends.cpu.backend import CPU_BACKEND, bucket_plan
    from neuron_lmi.backends.cpu.runner import CpuRunner

    model, path, plan, cache, _ = _setup(args)
    compiled = load_runner(CPU_BACKEND, bucket_plan(model, path, plan), cache, no_compile=True)
    eager = CpuRunner(model, args.rows, args.n_positions)
    rates: dict[str, list[float]] = {"eager": [], "compiled": []}
    _decode_rate(eager, args.rows, 4)  # warm-up: first-call costs (thread pools, allocations)
    _decode_rate(compiled, args.rows, 4)
    for _ in range(args.rounds):
        rates["eager"].append(_decode_rate(eager, args.rows, args.steps))
        rates["compiled"].append(_decode_rate(compiled, args.rows, args.steps))
    return {
        "eager_tok_s": max(rates["eager"]),
        "compiled_tok_s": max(rates["compiled"]),
        "eager_all": rates["eager"],
        "compiled_all": rates["compiled"],
    }


def _child(args: argparse.Namespace, phase: str, inductor_dir: str) -> dict:
    argv = [
        sys.executable,
        __file__,
        "--phase",
        phase,
        "--store",
        args.store,
        "--model",
        args.model,
        "--rows",
        str(args.rows),
        "--n-positions",
        str(args.n_positions),
        "--steps",
        str(args.steps),
        "--rounds",
        str(args.rounds),
        "--context-length-estimate",
        args.context_length_estimate or "",
    ]
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": inductor_dir, "PYTHONPATH": str(ROOT)}
    started = time.monotonic()
    out = subprocess.run(argv, env=env, check=True, stdout=subprocess.PIPE, text=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    result["process_s"] = time.monotonic() - started
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--rows", type=int, default=8, help="max rolling batch size = decode batch")
    p.add_argument("--n-positions", type=int, default=256)
    p.add_argument("--context-length-estimate", default="128")
    p.add_argument("--steps", type=int, default=48, help="timed decode steps per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--store", help="compile store (default: a fresh temporary folder)")
    p.add_argument("--phase", choices=("cold", "warm", "decode"), help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help="also write the results as JSON here")
    args = p.parse_args()
    if args.phase:
        result = phase_decode(args) if args.phase == "decode" else phase_start(args)
        print(json.dumps(result))
        return 0
    with tempfile.TemporaryDirectory(prefix="nlmi-bench-") as tmp:
        args.store = args.store or str(Path(tmp) / "store")
        inductor = str(Path(tmp) / "inductor")  # empty: the cold compile gets no help from it
        cold = _child(args, "cold", inductor)
        warm = _child(args, "warm", inductor)
        decode = _child(args, "decode", inductor)
    ratio = warm["seconds"] / cold["seconds"]
    hit_ratio = warm["lookup_to_token_s"] / cold["seconds"]
    speedup = decode["compiled_tok_s"] / decode["eager_tok_s"]
    rows = [
        ("cold start (compile + first token)", f"{cold['seconds']:.1f} s", f"compiled={cold['compiled']}"),
        ("warm start (weights + hit + token)", f"{warm['seconds']:.2f} s", f"{100 * ratio:.1f}% of cold"),
        (
            "  cache hit -> first token",
            f"{warm['lookup_to_token_s']:.2f} s",
            f"{100 * hit_ratio:.1f}% of cold (target <= 5%)",
        ),
        ("  of which lookup + package load", f"{warm['open_s']:.2f} s", ""),
        ("  weights load (both starts)", f"{warm['weights_s']:.2f} s", ""),
        (f"decode eager, batch {args.rows}", f"{decode['eager_tok_s']:.1f} tok/s", ""),
        (
            f"decode compiled, batch {args.rows}",
            f"{decode['compiled_tok_s']:.1f} tok/s",
            f"{speedup:.2f}x (target >= 1.3x)",
        ),
        ("entry size", f"{cold['entry_bytes'] / 2**20:.1f} MiB", f"key {cold['key']}"),
    ]
    print(
        f"\nmodel {args.model}, rows {args.rows}, n_positions {args.n_positions}, "
        f"context buckets {args.context_length_estimate or 'default'}, torch threads {os.cpu_count()} cores"
    )
    for name, value, note in rows:
        print(f"  {name:<36} {value:>14}  {note}")
    est = f" --context-length-estimate {args.context_length_estimate}" if args.context_length_estimate else ""
    print(
        f"\nreproduce: .venv/bin/python bench/compile_cache.py --model {args.model} --rows {args.rows} "
        f"--n-positions {args.n_positions}{est} --steps {args.steps} --rounds {args.rounds}"
    )
    if args.out:
        args.out.write_text(json.dumps({"cold": cold, "warm": warm, "decode": decode}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
