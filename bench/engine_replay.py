"""The serving bench's load replayed on the engine alone: how much of a server's step is the server.

``bench/vllm_compare.py`` drives ``neuron-lmi serve`` over HTTP with ``neuron-lmi bench``'s
streamed requests. This runs the same requests (the same ``Workload``: prompts, lengths, seed) on
an ``EngineCore`` built in this process as the server builds its own (compiled graphs, the same
rolling batch and cache), closed-loop at ``--concurrency``: a new request joins the moment one
finishes. Nothing else shares the cores, so the tokens per second and the time per full-batch step
here, set against the server's (``/metrics``: ``neuron_lmi_engine_*_per_full_step``), say what
HTTP, the API process and the load client cost.

    python -m bench.engine_replay --model DIR --dtype bf16 [--concurrency 32 --requests 64]
        [--prompt-tokens 60 --output-tokens 128 --batch 32 --n-positions 512 --seed 0 --out F]

A warm-up round (other prompts) runs first. Printed and written: tokens per second, and per step
that decoded at least 90% of the rows, the wall and model milliseconds and the host's CPU
milliseconds outside the model (means); the steps that
forwarded prompt tokens and the decode-only ones, with their seconds (where a prefill-heavy load's
time goes: ``--prompt-tokens 1000 --output-tokens 50 --concurrency 16 --requests 32 --n-positions
2048``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from neuron_lmi.backends.cpu.llm import LLM
from neuron_lmi.bench.workload import TokenCount, Workload
from neuron_lmi.engine.core import EngineCore
from neuron_lmi.engine.step_clock import FULL_BATCH
from neuron_lmi.engine.types import SamplingParams, TokenEvent
from neuron_lmi.runners.base import StepBatch

WARMUP_SEED_OFFSET = 10_000  # as in vllm_compare: the warm-up's prompts are none of the measured ones


def replay(core: EngineCore, workload: Workload, concurrency: int, requests: int) -> dict[str, float]:
    """Run ``requests`` of ``workload``, ``concurrency`` at a time; the figures of that run."""
    runner, timer = core.runner, core.forward_timer
    live: set[str] = set()
    sent = 0
    # Prompt tokens forwarded, counted here (the runner's forward wrapped for this run) rather than
    # in the engine's ForwardTimer, which is on every serving step's path.
    prompt_tokens = 0
    plain_forward = runner.forward

    def forward(batch: StepBatch) -> object:
        nonlocal prompt_tokens
        prompt_tokens += sum(len(chunk) for chunk in batch.chunks) - batch.decodes
        return plain_forward(batch)

    def add() -> None:
        nonlocal sent
        spec = workload.request(sent)
        request_id = f"replay-{workload.seed}-{sent}"
        sent += 1

        def sink(event: TokenEvent, request_id: str = request_id) -> None:
            if event.finish_reason is not None:
                live.discard(request_id)

        # As the OpenAI route admits the serving bench's requests: no log-probabilities asked for.
        params = SamplingParams(max_new_tokens=spec.max_tokens, ignore_eos=True, logprobs=False)
        core.add(core.make_request(spec.prompt, params, request_id=request_id, sink=sink))
        live.add(request_id)

    full_rows = FULL_BATCH * runner.rows.n_rows
    full_wall = full_model = full_host_cpu = prefill_s = decode_only_s = 0.0
    full_steps = steps = tokens = prefill_steps = decode_only_steps = 0
    runner.forward = forward
    start = time.perf_counter()
    while sent < requests or core.has_work():
        while len(live) < concurrency and sent < requests:
            add()
        rows0, prompt0 = timer.decoded_rows, prompt_tokens
        model0, model_cpu0 = timer.forward_s, timer.forward_cpu_s
        step0, cpu0 = time.perf_counter(), time.thread_time()
        core.step()
        step_s, step_cpu_s = time.perf_counter() - step0, time.thread_time() - cpu0
        steps += 1
        rows = timer.decoded_rows - rows0
        tokens += rows
        if prompt_tokens > prompt0:
            prefill_steps += 1
            prefill_s += step_s
        elif rows:
            decode_only_steps += 1
            decode_only_s += step_s
        if rows >= full_rows:
            full_steps += 1
            full_wall += step_s
            full_model += timer.forward_s - model0
            full_host_cpu += step_cpu_s - (timer.forward_cpu_s - model_cpu0)
    wall = time.perf_counter() - start
    del runner.forward  # the class's own again
    return {
        "duration_s": wall,
        "steps": steps,
        "output_tokens": tokens + requests,  # decoded tokens plus each request's first token
        "output_tokens_per_s": (tokens + requests) / wall,
        "full_steps": full_steps,
        "wall_ms_per_full_step": 1000 * full_wall / max(full_steps, 1),
        "model_ms_per_full_step": 1000 * full_model / max(full_steps, 1),
        # The loop thread's own CPU time outside forward, as the server's step clock counts it
        # (neuron_lmi_engine_host_cpu_ms_per_full_step): what the host costs, whatever else runs.
        "host_cpu_ms_per_full_step": 1000 * full_host_cpu / max(full_steps, 1),
        "prefill_steps": prefill_steps,
        "prefill_s": prefill_s,
        "decode_only_steps": decode_only_steps,
        "decode_only_s": decode_only_s,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=60)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--n-positions", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    core = LLM(
        args.model, dtype=args.dtype, enforce_eager=False, max_rolling_batch_size=args.batch,
        n_positions=args.n_positions,
    ).core  # fmt: skip
    prompt, output = TokenCount("fixed", args.prompt_tokens), TokenCount("fixed", args.output_tokens)
    replay(core, Workload(prompt, output, args.seed + WARMUP_SEED_OFFSET), args.concurrency, args.concurrency)
    result = replay(core, Workload(prompt, output, args.seed), args.concurrency, args.requests)
    report = {"args": {k: str(v) for k, v in vars(args).items()}, "result": result}
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
