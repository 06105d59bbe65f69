"""Generated tokens/s: the neuron-lmi CPU engine versus transformers' ``generate``, side by side.

Same model (SmolLM2 by default), same prompts (56-64 tokens), same number of new tokens (EOS
ignored on both sides), static batches of 1, 8 and 32; transformers uses left padding. Each
configuration alternates the two engines so background load hits both alike.

    python bench/engine_throughput.py [--batch-sizes 1,8,32] [--dtype fp32|bf16] [--new-tokens 128]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

import torch

from compile_cache import default_cache_root
from neuron_lmi.backends.cpu.llm import LLM
from neuron_lmi.engine.types import SamplingParams

WORDS = [
    "the",
    "a",
    "model",
    "serves",
    "tokens",
    "quickly",
    "across",
    "many",
    "cores",
    "while",
    "users",
    "send",
    "requests",
    "about",
    "weather",
    "science",
    "history",
    "music",
    "code",
    "travel",
    "food",
    "sport",
    "art",
    "language",
    "numbers",
    "and",
    "stories",
]


def make_prompts(tokenizer, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        target = rng.randint(56, 64)
        ids: list[int] = []
        while len(ids) < target:
            ids += tokenizer.encode(" " + " ".join(rng.choice(WORDS) for _ in range(8)))
        prompts.append(ids[:target])
    return prompts


def hf_tokens_per_s(model, prompts: list[list[int]], new_tokens: int, pad_id: int) -> float:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=pad_id,
        )
    elapsed = time.perf_counter() - start
    return (out.shape[1] - width) * len(prompts) / elapsed


def ours_tokens_per_s(llm: LLM, prompts: list[list[int]], new_tokens: int) -> float:
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    return sum(len(r.token_ids) for r in results) / elapsed


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument(
        "--compiled", action="store_true", help="serve from AOTInductor artifacts (compiled on a cache miss)"
    )
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    from neuron_lmi.models.loader import resolve_model_path

    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    # --compiled: the AOT bucket runner on the default compile cache (option.compiled_graph_path).
    extra = {"compiled_graph_path": str(default_cache_root()), "context_length_estimate": (128,)}
    graphs = extra if args.compiled else {"enforce_eager": True}
    llm = LLM(
        args.model, dtype=args.dtype, max_rolling_batch_size=max(batch_sizes), n_positions=512, **graphs
    )
    path = resolve_model_path(args.model)
    if path.suffix == ".gguf":
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    else:
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    hf.eval()
    pad_id = llm.tokenizer.pad_token_id or 0
    # Warm both paths once (allocator, lazy init) before timing.
    warm = make_prompts(llm.tokenizer, 2, seed=99)
    hf_tokens_per_s(hf, warm, 4, pad_id)
    ours_tokens_per_s(llm, warm, 4)
    rows = []
    print(
        f"threads={torch.get_num_threads()} dtype={args.dtype} new_tokens={args.new_tokens}", file=sys.stderr
    )
    print(f"{'batch':>5} {'transformers tok/s':>19} {'neuron-lmi tok/s':>17} {'ratio':>6}")
    for batch in batch_sizes:
        prompts = make_prompts(llm.tokenizer, batch, seed=batch)
        hf_runs, our_runs = [], []
        for _ in range(args.repeat):
            hf_runs.append(hf_tokens_per_s(hf, prompts, args.new_tokens, pad_id))
            our_runs.append(ours_tokens_per_s(llm, prompts, args.new_tokens))
        hf_best, our_best = max(hf_runs), max(our_runs)
        rows.append(
            {"batch": batch, "transformers": hf_best, "neuron_lmi": our_best, "ratio": our_best / hf_best}
        )
        print(f"{batch:>5} {hf_best:>19.1f} {our_best:>17.1f} {our_best / hf_best:>6.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"dtype": args.dtype, "new_tokens": args.new_tokens, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
