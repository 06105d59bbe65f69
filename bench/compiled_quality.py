"""Quality of the CPU engine's compiled graphs against the fp32 eager model: teacher-forced top-1
agreement of every decode step.

The fp32 eager runner prefills each prompt and decodes greedily ``--new-tokens`` tokens; each
variant's runner (``<dtype>-eager`` or ``<dtype>-compiled``, the latter through the compiled extend
and decode packages, from the compile cache or compiled on a miss) prefills the same prompts and is
fed the reference's tokens step by step; the share of steps whose top-1 token equals the
reference's is printed. ``bench.quantization`` measures the eager models only; this is the same
question for what the server runs.

    .venv/bin/python -m bench.compiled_quality --model smollm2 --variants bf16-eager,bf16-compiled
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench.quantization import PROMPTS, TEXT
from neuron_lmi.backends.cpu.llm import LLM


def build(model: str, dtype: str, compiled: bool, rows: int, n_positions: int) -> LLM:
    """The engine as the server builds it (``llm.core.runner`` is its runner)."""
    options = {"max_rolling_batch_size": rows, "n_positions": n_positions, "dtype": dtype}
    return LLM(model, enforce_eager=not compiled, **options)


def top1_tokens(
    runner, prompts: list[list[int]], new_tokens: int, forced: torch.Tensor | None
) -> torch.Tensor:
    """``[prompts, new_tokens]`` top-1 ids: each step fed ``forced`` (the reference's) or its own."""
    rows = list(range(len(prompts)))
    for row in rows:
        runner.rows.allocate(row)
    with torch.no_grad():
        tops = [runner.prefill(rows, prompts).argmax(-1)]
        for t in range(new_tokens - 1):
            feed = forced[:, t] if forced is not None else tops[-1]
            tops.append(runner.decode(rows, feed.tolist()).argmax(-1))
    return torch.stack(tops, 1)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="a checkpoint directory, .gguf file or built-in name")
    p.add_argument("--variants", default="bf16-eager,bf16-compiled", help="<fp32|bf16>-<eager|compiled>, ...")
    p.add_argument("--prompts", type=int, default=14, help="bench.quantization's, then its text's")
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--rows", type=int, default=32, help="cache rows (32 matches the server's packages)")
    p.add_argument("--n-positions", type=int, default=512)
    p.add_argument("--out", type=Path, help="also write the results as JSON here")
    args = p.parse_args()
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in variants:
        dtype, _, mode = v.partition("-")
        if dtype not in ("fp32", "bf16") or mode not in ("eager", "compiled"):
            p.error(f"--variants: {v!r} is not <fp32|bf16>-<eager|compiled>")
    reference = build(args.model, "fp32", False, args.rows, args.n_positions)
    tokenizer = reference.tokenizer
    words = TEXT.split()
    candidates = [*PROMPTS, *(" ".join(words[i : i + 40]) for i in range(0, len(words), 25))]
    prompts = [ids for ids in (tokenizer.encode(c) for c in candidates) if len(ids) > 4][: args.prompts]
    if len(prompts) > args.rows:
        p.error(f"--prompts {len(prompts)} exceeds --rows {args.rows}")
    want = top1_tokens(reference.core.runner, prompts, args.new_tokens, None)
    results: dict[str, float] = {}
    shape = f"{len(prompts)} prompts x {args.new_tokens} tokens"
    print(f"teacher-forced top-1 agreement with fp32 eager, {shape}")
    for v in variants:
        dtype, _, mode = v.partition("-")
        llm = build(args.model, dtype, mode == "compiled", args.rows, args.n_positions)
        got = top1_tokens(llm.core.runner, prompts, args.new_tokens, want)
        results[v] = round(float((got == want).float().mean()), 4)
        print(f"  {v:>14}  {results[v]:.4f}", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        record = {"args": vars(args) | {"out": str(args.out)}, "agreement": results}
        args.out.write_text(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
