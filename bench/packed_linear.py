"""fp32 GEMMs on packed weights (``neuron_lmi.models.packed_linear``) against ATen's, on a real model.

Two measurements, both in one process so that every variant sees the same host at the same time:

    gemms    every matmul weight of the model (all layers and the head) multiplied by ``rows`` input
             rows, one pass = the GEMMs of one decode step: ``F.linear`` (ATen's GEMM) against
             ``neuron_lmi::mkl_linear`` and ``neuron_lmi::onednn_linear`` (packs made once)
    graphs   (--graphs) the CPU engine's compiled decode and extend packages, built once per variant
             (``NEURON_LMI_PACKED_GEMM`` = aten, mkl, onednn; compiled into the compile cache on a
             miss, minutes each), then a decode step at each row count (attention over
             ``--attn-len`` positions) and a prefill of ``--prompt-tokens`` tokens, variants
             interleaved round by round

Medians of ``--repeat`` passes; the variant ``host`` marks is what ``packed_linear.host_library``
picks on this CPU. ``--peak`` also measures the host's fp32 FMA peak (independent FMA chains on
every thread, built with g++ for this CPU) and gives each GEMM pass as a fraction of it: what is
left for a faster kernel at a prefill's row counts.

    .venv/bin/python -m bench.packed_linear --rows 1,8,32 --graphs --out results/packed_linear.json
    .venv/bin/python -m bench.packed_linear --rows 256,512 --peak
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from neuron_lmi.backends.cpu.compiled_decode import matmul_weights
from neuron_lmi.backends.cpu.llm import LLM
from neuron_lmi.models import ops, packed_linear

Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def fp32_engine(model: str, rows: int, n_positions: int, compiled: bool = False) -> LLM:
    """The fp32 engine as the server builds it (``llm.core.runner`` is its runner)."""
    options = {"max_rolling_batch_size": rows, "n_positions": n_positions, "dtype": "fp32"}
    return LLM(model, enforce_eager=not compiled, **options)


def median_ms(run: Callable[[], object], repeat: int) -> float:
    run()  # the first pass packs the weights and warms the caches
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return round(statistics.median(times) * 1e3, 2)


def time_gemms(weights: list[torch.Tensor], rows: list[int], repeat: int) -> dict[str, dict[int, float]]:
    variants: dict[str, Linear] = {"aten": F.linear}
    for library in packed_linear.LIBRARIES:
        if packed_linear.available(library):
            variants[library] = packed_linear.linear_op(library)
    out: dict[str, dict[int, float]] = {name: {} for name in variants}
    for n in rows:
        inputs = {w.shape[1]: torch.randn(n, w.shape[1]) for w in weights}
        for name, linear in variants.items():

            def one_step(linear: Linear = linear, inputs: dict[int, torch.Tensor] = inputs) -> None:
                for w in weights:
                    linear(inputs[w.shape[1]], w)

            out[name][n] = median_ms(one_step, repeat)
    return out


def open_variant(args: argparse.Namespace, variant: str):  # -> CpuRunner
    """The runner with ``variant``'s compiled decode and extend (env var set while their keys are made)."""
    previous = os.environ.get(packed_linear.LIBRARY_ENV)
    os.environ[packed_linear.LIBRARY_ENV] = variant
    try:
        runner = fp32_engine(args.model, max(args.rows), args.n_positions, compiled=True).core.runner
    finally:
        if previous is None:
            os.environ.pop(packed_linear.LIBRARY_ENV)
        else:
            os.environ[packed_linear.LIBRARY_ENV] = previous
    if runner.compiled_decode is None or runner.compiled_extend is None:
        raise SystemExit(f"{variant}: this model has no compiled graphs")
    return runner


def time_graphs(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    variants = ["aten", *(library for library in packed_linear.LIBRARIES if packed_linear.available(library))]
    runners = {v: open_variant(args, v) for v in variants}
    cases: list[tuple[str, Callable[[object], object]]] = []
    for n in args.rows:
        rows, chunks, starts = list(range(n)), [[1]] * n, [args.attn_len - 1] * n

        def decode(runner, rows=rows, chunks=chunks, starts=starts) -> object:
            return runner.compiled_decode(rows, chunks, starts, runner.cache.k, runner.cache.v)

        cases.append((f"decode {n} rows", decode))
    chunk = [[5] * args.prompt_tokens]

    def prefill(runner) -> object:
        return runner.compiled_extend([0], chunk, [0], runner.cache.k, runner.cache.v)

    cases.append((f"prefill {args.prompt_tokens} tokens", prefill))
    out: dict[str, dict[str, float]] = {v: {} for v in variants}
    with torch.no_grad():
        for name, case in cases:
            samples: dict[str, list[float]] = {v: [] for v in variants}
            for v in variants:
                case(runners[v])  # warm: packs made, pages touched
            for _ in range(args.repeat):  # interleaved: drift in the host's speed falls on all alike
                for v in variants:
                    started = time.perf_counter()
                    case(runners[v])
                    samples[v].append(time.perf_counter() - started)
            for v in variants:
                out[v][name] = round(statistics.median(samples[v]) * 1e3, 2)
    return out


FMA_CHAINS = r"""
#include <chrono>
#include <cstdio>
#include <omp.h>
#ifdef __AVX512F__
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float Vec __attribute__((vector_size(kLanes * 4)));
int main() {  // 12 independent chains per thread cover the FMA latency on two pipes
  const long iters = 100000000;
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    auto start = std::chrono::steady_clock::now();
    float sink = 0;
#pragma omp parallel reduction(+ : sink)
    {
      Vec acc[12], mul, add;
      for (int l = 0; l < kLanes; ++l) mul[l] = 1.0000001f, add[l] = 1e-9f;
      for (int i = 0; i < 12; ++i) for (int l = 0; l < kLanes; ++l) acc[i][l] = i;
      for (long n = 0; n < iters; ++n)
        for (int i = 0; i < 12; ++i) acc[i] = acc[i] * mul + add;
      for (int i = 0; i < 12; ++i) sink += acc[i][0];
    }
    double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    double flops = 2.0 * kLanes * 12 * iters * omp_get_max_threads();
    best = flops / seconds > best ? flops / seconds : best;
    if (sink == 42) std::puts("");  // keeps the chains
  }
  std::printf("%.1f\n", best / 1e9);
}
"""


def fma_peak_gflops(threads: int) -> float:
    """fp32 GFLOP/s of ``threads`` threads running nothing but FMAs (the best of three passes)."""
    with tempfile.TemporaryDirectory() as tmp:
        source, binary = Path(tmp) / "fma.cpp", Path(tmp) / "fma"
        source.write_text(FMA_CHAINS)
        flags = ["-O3", "-funroll-loops", "-march=native", "-fopenmp"]
        subprocess.run(["g++", *flags, str(source), "-o", str(binary)], check=True)
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        done = subprocess.run([str(binary)], env=env, check=True, capture_output=True, text=True)
        return float(done.stdout)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="a checkpoint directory, .gguf file or built-in name")
    p.add_argument("--rows", default="1,8,32", help="input rows (decode batch sizes), comma-separated")
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--graphs", action="store_true", help="also time the compiled decode and extend")
    p.add_argument("--n-positions", type=int, default=512)
    p.add_argument("--attn-len", type=int, default=124, help="decode attention length (graphs)")
    p.add_argument("--prompt-tokens", type=int, default=60, help="prefill length (graphs)")
    p.add_argument("--peak", action="store_true", help="also the host's fp32 FMA peak (needs g++)")
    p.add_argument("--out", type=Path, help="also write the results as JSON here")
    args = p.parse_args()
    args.rows = [int(r) for r in args.rows.split(",")]
    if max(args.rows) < 2 and args.graphs:
        p.error("--graphs: the compiled decode needs a cache of at least 2 rows; give --rows up to 2 or more")
    ops.kernels()
    model = fp32_engine(args.model, max(args.rows), args.n_positions).core.runner.model
    weights = [w for w in matmul_weights(model) if isinstance(w, torch.Tensor)]
    result: dict[str, object] = {
        "model": args.model,
        "cpu_vendor": packed_linear.cpu_vendor(),
        "host_library": packed_linear.host_library() or "aten",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "weights": len(weights),
        "weight_mb": round(sum(w.numel() * w.element_size() for w in weights) / 1e6, 1),
    }
    gemms = time_gemms(weights, args.rows, args.repeat)
    result["gemms_ms"] = gemms
    print(f"{result['model']}: {result['weights']} fp32 weights ({result['weight_mb']} MB), "
          f"{result['threads']} threads, {result['cpu_vendor'] or 'unknown vendor'}, host library "
          f"{result['host_library']}")  # fmt: skip
    print("one step's GEMMs, ms:  rows  " + "  ".join(f"{v:>8}" for v in gemms))
    for n in args.rows:
        print(f"{'':22}{n:5}  " + "  ".join(f"{gemms[v][n]:8.1f}" for v in gemms))
    if args.peak:
        # The layers' weights alone: a prompt chunk multiplies every token by those, the head by the
        # tokens whose logits are wanted only.
        layers = weights[:-1]
        layer_ms = time_gemms(layers, args.rows, args.repeat)
        peak = fma_peak_gflops(torch.get_num_threads())
        flops = 2 * sum(w.numel() for w in layers)  # per input row
        gflops = {v: {n: flops * n / (layer_ms[v][n] / 1e3) / 1e9 for n in args.rows} for v in layer_ms}
        result |= {"layer_gemms_ms": layer_ms, "layer_gemms_gflops": gflops, "fma_peak_gflops": peak}
        print(f"fp32 FMA peak, {torch.get_num_threads()} threads: {peak:.0f} GFLOP/s")
        print("the layers' GEMMs (no head), GFLOP/s and % of the peak:")
        for n in args.rows:
            cells = (f"{gflops[v][n]:5.0f} {100 * gflops[v][n] / peak:3.0f}%" for v in layer_ms)
            print(f"{'':22}{n:5}  " + "  ".join(cells))
    if args.graphs:
        graphs = time_graphs(args)
        result["graphs_ms"] = graphs
        names = list(next(iter(graphs.values())))
        print("compiled graphs, ms:" + "".join(f"  {v:>8}" for v in graphs))
        for name in names:
            print(f"  {name:18}" + "".join(f"  {graphs[v][name]:8.1f}" for v in graphs))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, **result}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
