"""Continuous batching with KV-row insert versus the recompute baseline, same arrivals, one run.

Requests arrive over time (Poisson), with mixed output lengths. ``insert`` prefills each new
request into a free KV row while the others keep decoding (the cache API); ``recompute`` encodes
every active row again whenever a request joins (what LMI did before its cache API). Latency is
arrival to last token, in wall-clock time on the real engine.

    python bench/continuous_batching.py [--model smollm2] [--requests 32] [--rate 2.0] [--rows 16]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass

from neuron_lmi.backends.cpu.llm import LLM
from neuron_lmi.engine.core import EngineCore
from neuron_lmi.engine.request import Request
from neuron_lmi.engine.scheduler import PrefillChunk, Scheduler, SchedulerOutput
from neuron_lmi.engine.types import SamplingParams, TokenEvent
from neuron_lmi.runners.base import BatchKind, StepBatch


class RecomputeOnJoin(Scheduler):
    """The pre-cache-API baseline: whenever a request joins, every running row is encoded again from
    its first token (one PREFILL line of all its tokens, which samples its next one) instead of
    decoding. The product's scheduler inserts rows; this subclass exists for this benchmark only."""

    def _batches(
        self, chunks: list[PrefillChunk], decision: SchedulerOutput
    ) -> list[tuple[StepBatch, list[Request]]]:
        if not (decision.prefill and decision.decode):
            return super()._batches(chunks, decision)
        joined = SchedulerOutput(prefill=decision.prefill, chunks=decision.chunks)
        again = list(decision.decode)
        n = len(again)
        recompute = StepBatch(
            BatchKind.PREFILL,
            tuple(r.row for r in again),  # type: ignore[misc]
            (0,) * n,
            tuple(tuple(r.all_ids) for r in again),
            (True,) * n,
        )
        return [*super()._batches(chunks, joined), (recompute, again)]


@dataclass(frozen=True)
class Arrival:
    at_s: float
    prompt: list[int]
    new_tokens: int


def make_arrivals(n: int, rate: float, vocab: int, seed: int) -> list[Arrival]:
    rng = random.Random(seed)
    t, arrivals = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        prompt = [rng.randrange(100, vocab) for _ in range(rng.randint(56, 64))]
        arrivals.append(Arrival(t, prompt, rng.choice([16, 32, 64, 96, 128])))
    return arrivals


def run(core: EngineCore, arrivals: list[Arrival]) -> list[float]:
    """Replay ``arrivals`` against ``core`` in real time; returns each request's latency."""
    done: dict[int, float] = {}
    start = time.perf_counter()
    pending = list(enumerate(arrivals))
    while pending or core.has_work():
        now = time.perf_counter() - start
        while pending and pending[0][1].at_s <= now:
            index, arrival = pending.pop(0)

            def sink(event: TokenEvent, index: int = index) -> None:
                if event.finish_reason is not None:
                    done[index] = time.perf_counter() - start

            params = SamplingParams(max_new_tokens=arrival.new_tokens, ignore_eos=True)
            core.add(core.make_request(arrival.prompt, params, sink=sink))
        if core.has_work():
            core.step()
        elif pending:
            time.sleep(max(0.0, pending[0][1].at_s - (time.perf_counter() - start)))
    return [done[i] - a.at_s for i, a in enumerate(arrivals)]


def summarize(latencies: list[float]) -> dict[str, float]:
    ordered = sorted(latencies)
    return {
        "mean_s": statistics.fmean(ordered),
        "p50_s": ordered[len(ordered) // 2],
        "p90_s": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--rate", type=float, default=2.0, help="mean arrivals per second")
    parser.add_argument("--rows", type=int, default=16, help="KV rows (max rolling batch size)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    insert_core = LLM(
        args.model, dtype="fp32", enforce_eager=True, max_rolling_batch_size=args.rows, n_positions=512
    ).core
    # The baseline shares the loaded model and its cache object; only the scheduler differs.
    recompute_core = EngineCore(insert_core.runner, insert_core.tokenizer, insert_core.eos_token_ids)
    plain = recompute_core.scheduler
    recompute_core.scheduler = RecomputeOnJoin(
        plain.max_prefill_tokens, plain.prefill, plain.prefix, plain.rows, plain.capabilities
    )
    arrivals = make_arrivals(args.requests, args.rate, insert_core.runner.vocab_size, args.seed)
    run(insert_core, make_arrivals(2, 100.0, insert_core.runner.vocab_size, 99))  # warm-up
    results = {}
    for name, core in (("insert", insert_core), ("recompute", recompute_core)):
        results[name] = summarize(run(core, arrivals))
        if core.runner.rows.occupancy().rows_used:
            raise RuntimeError(f"{name}: KV rows leaked")
    ins, rec = results["insert"], results["recompute"]
    print(f"{args.requests} requests, Poisson rate {args.rate}/s, {args.rows} rows, model {args.model}")
    print(f"{'policy':>10} {'mean s':>8} {'p50 s':>8} {'p90 s':>8}")
    for name, r in results.items():
        print(f"{name:>10} {r['mean_s']:>8.2f} {r['p50_s']:>8.2f} {r['p90_s']:>8.2f}")
    cut = 1 - ins["mean_s"] / rec["mean_s"]
    print(f"row insert cuts mean latency by {cut:.0%} (p90 by {1 - ins['p90_s'] / rec['p90_s']:.0%})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results, "mean_cut": cut}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
