"""Time to first token with and without prefix reuse, for prompts sharing a long system prompt.

Two engine cores share one runner (same weights, same KV cache): one reuses cached prefixes (the
default on the CPU runner), one prefills every prompt from scratch. Requests run one after
another, each a shared ``--system-tokens`` prefix plus its own ``--user-tokens``; the first
request of each core warms it (and, with reuse, leaves the system prompt in a retained row).
``--while-running`` keeps one request decoding meanwhile, so the prefix is copied from a running
row instead of claimed from a finished one. Greedy outputs of the two cores are compared.

    python -m bench.prefix_reuse [--model smollm2|tiny] [--system-tokens 1000] [--requests 5]

(``-m`` from the repository root: run as a file, ``bench/compile_cache.py`` would shadow the
``compile_cache`` package.)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time

import torch

from neuron_lmi.backends.cpu.llm import LLM
from neuron_lmi.engine.core import EngineCore
from neuron_lmi.engine.types import SamplingParams, TokenEvent


def tiny_model_dir() -> str:
    """The serving-overhead model of issue 12: a 2-layer random Llama, hidden 128, head dim 64."""
    from neuron_lmi.testing.checkpoints import make_tiny_checkpoint

    out = tempfile.mkdtemp(prefix="tiny_llama_bench_")
    return str(
        make_tiny_checkpoint(
            out, "llama", hidden_size=128, intermediate_size=512, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=4096,
        )
    )  # fmt: skip


def first_token_s(core: EngineCore, prompt: list[int], params: SamplingParams) -> tuple[float, list[int]]:
    """Add one request, step until it finishes; returns (seconds to its first token, its tokens)."""
    tokens: list[int] = []
    first: list[float] = []

    def sink(event: TokenEvent) -> None:
        if event.token_id >= 0:
            tokens.append(event.token_id)
            if not first:
                first.append(time.perf_counter())

    start = time.perf_counter()
    request = core.make_request(prompt, params, sink=sink)
    core.add(request)
    while request.finish_reason is None:
        core.step()
    return first[0] - start, tokens


def measure(core: EngineCore, prompts: list[list[int]], params: SamplingParams) -> tuple[list[float], list]:
    first_token_s(core, prompts[0], params)  # warm-up (and, with reuse, the prefix's first owner)
    times, outputs = [], []
    for prompt in prompts[1:]:
        seconds, tokens = first_token_s(core, prompt, params)
        times.append(seconds)
        outputs.append(tokens)
    return times, outputs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="a model name, directory or 'tiny'")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--user-tokens", type=int, default=24)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--requests", type=int, default=5, help="measured requests (plus one warm-up)")
    ap.add_argument("--while-running", action="store_true", help="keep a sharer decoding meanwhile")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args(argv)

    model = tiny_model_dir() if args.model == "tiny" else args.model
    n_positions = 1 << (args.system_tokens + args.user_tokens + args.new_tokens + 256).bit_length()
    if args.threads:
        torch.set_num_threads(args.threads)
    reuse = LLM(
        model, dtype=args.dtype, enforce_eager=True, max_rolling_batch_size=4, n_positions=n_positions
    ).core
    fresh = EngineCore(reuse.runner, reuse.tokenizer, reuse.eos_token_ids, prefix_reuse=False)
    rng = random.Random(args.seed)
    vocab = reuse.runner.vocab_size
    system = [rng.randrange(100, vocab) for _ in range(args.system_tokens)]
    prompts = [
        system + [rng.randrange(100, vocab) for _ in range(args.user_tokens)]
        for _ in range(args.requests + 1)
    ]
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)

    results = {}
    for name, core in (("without reuse", fresh), ("with reuse", reuse)):
        if args.while_running:  # a long-running sharer holds the system prompt in a live row
            core.add(core.make_request([*system, 7], SamplingParams(max_new_tokens=1000, ignore_eos=True)))
            core.step()
        times, outputs = measure(core, prompts, params)
        for request_id in list(core.requests):
            core.abort(request_id)
        results[name] = (times, outputs)
        print(f"{name:>14}: TTFT median {statistics.median(times) * 1000:8.1f} ms  "
              f"({', '.join(f'{t * 1000:.0f}' for t in times)} ms)")  # fmt: skip
    ratio = statistics.median(results["with reuse"][0]) / statistics.median(results["without reuse"][0])
    identical = results["with reuse"][1] == results["without reuse"][1]
    print(f"ratio with/without: {ratio:.3f}   greedy outputs identical: {identical}")
    print(json.dumps({"model": args.model, "system_tokens": args.system_tokens, "ratio": round(ratio, 4),
                      "identical": identical, "while_running": args.while_running}))  # fmt: skip
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
