"""Inter-token latency of running streams while a burst of long prompts arrives, chunked or not.

``--streams`` requests decode steadily; then ``--burst`` prompts of ``--burst-tokens`` arrive at
once. With whole-prompt prefill the step that prefills them stalls every stream; with chunked
prefill (``ChunkedPrefill``: ``--step-tokens`` per step shared by decodes and prompt chunks) each
step stays short. Both runs use the same runner and arrivals. Printed per policy: the streams'
inter-token latency p50/p99 over the window from the burst until its last first token (plus
``--after-steps``), the p99/p50 ratio (issue 12's target: <= 3 at 64 streams) and the burst's TTFT.

    python -m bench.chunked_prefill [--model tiny|smollm2] [--streams 64] [--burst 8] [--compile-graphs]

``--compile-graphs`` runs the compiled step graph, as ``serve`` does (eager otherwise), and
``--step-tokens`` (default: the engine's ``DEFAULT_STEP_TOKENS``) may list several budgets, each
measured as its own chunked policy.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import torch

from bench.prefix_reuse import tiny_model_dir
from neuron_lmi.backends.cpu.llm import LLM
from neuron_lmi.bench.report import percentile
from neuron_lmi.engine.core import EngineCore
from neuron_lmi.engine.scheduler import DEFAULT_STEP_TOKENS, ChunkedPrefill, WholePrompts
from neuron_lmi.engine.types import SamplingParams, TokenEvent


def run(core: EngineCore, args: argparse.Namespace, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    vocab = core.runner.vocab_size
    times: dict[int, list[float]] = {}

    def add(i: int, n_prompt: int, new_tokens: int) -> None:
        times[i] = []

        def sink(event: TokenEvent) -> None:
            if event.token_id >= 0:
                times[i].append(time.perf_counter())

        prompt = [rng.randrange(100, vocab) for _ in range(n_prompt)]
        params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
        core.add(core.make_request(prompt, params, sink=sink))

    stream_tokens = core.runner.n_positions - args.stream_prompt
    for i in range(args.streams):
        add(i, args.stream_prompt, stream_tokens)
    while any(not times[i] for i in range(args.streams)):
        core.step()
    for _ in range(args.warm_steps):
        core.step()
    burst_at = time.perf_counter()
    burst = range(args.streams, args.streams + args.burst)
    for i in burst:
        add(i, args.burst_tokens, 4)
    while any(not times[i] for i in burst):
        core.step()
    for _ in range(args.after_steps):
        core.step()
    end = time.perf_counter()
    gaps = [
        b - a
        for i in range(args.streams)
        for a, b in zip(times[i], times[i][1:], strict=False)
        if b >= burst_at and b <= end
    ]
    for request_id in list(core.requests):
        core.abort(request_id)
    p50, p99 = percentile(gaps, 50), percentile(gaps, 99)
    return {
        "itl_p50_ms": p50 * 1000,
        "itl_p99_ms": p99 * 1000,
        "itl_max_ms": max(gaps) * 1000,
        "p99_over_p50": p99 / p50,
        "burst_ttft_median_s": statistics.median(times[i][0] - burst_at for i in burst),
        "window_s": end - burst_at,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="'tiny' (issue 12's 2-layer model) or a model")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--stream-prompt", type=int, default=60)
    ap.add_argument("--burst", type=int, default=8)
    ap.add_argument("--burst-tokens", type=int, default=1000)
    ap.add_argument("--step-tokens", default=str(DEFAULT_STEP_TOKENS), help="one budget or several: 256,512")
    ap.add_argument("--compile-graphs", action="store_true", help="the compiled step graph, as served")
    ap.add_argument("--warm-steps", type=int, default=10)
    ap.add_argument("--after-steps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args(argv)

    model = tiny_model_dir() if args.model == "tiny" else args.model
    if args.threads:
        torch.set_num_threads(args.threads)
    base = LLM(
        model,
        dtype=args.dtype,
        enforce_eager=not args.compile_graphs,
        max_rolling_batch_size=args.streams + args.burst,
        n_positions=2048,
    ).core
    policies = {"whole prompts": WholePrompts(max_tokens=4096)}  # the engine before chunks
    for step_tokens in (int(n) for n in args.step_tokens.split(",")):
        policies[f"chunked ({step_tokens}/step)"] = ChunkedPrefill(step_tokens)
    out = {}
    for name, policy in policies.items():
        core = EngineCore(base.runner, base.tokenizer, base.eos_token_ids, prefill=policy, prefix_reuse=False)
        r = run(core, args, args.seed)
        out[name] = r
        print(
            f"{name:>22}: ITL p50 {r['itl_p50_ms']:7.1f} ms  p99 {r['itl_p99_ms']:8.1f} ms  "
            f"max {r['itl_max_ms']:8.1f} ms  p99/p50 {r['p99_over_p50']:5.2f}  "
            f"burst TTFT median {r['burst_ttft_median_s']:.2f} s"
        )
    print(json.dumps({"model": args.model, "streams": args.streams, "burst": args.burst, **{
        k: {m: round(v, 3) for m, v in r.items()} for k, r in out.items()}}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
