"""Speculation (``option.speculative_config``) off and on, on a load that copies and one that does not.

Issue #39: prompt lookup pays where the output repeats the prompt, and costs a longer forward where
it does not. Two loads, replayed closed-loop on an ``EngineCore`` built in this process (as
``bench/engine_replay.py`` does: compiled graphs, the serving rolling batch), greedy:

- ``copy``: a chat-templated request to repeat a passage exactly, with one word replaced wherever it
  occurs (about ``--prompt-tokens`` tokens, up to ``--output-tokens`` new ones, EOS ends it). The
  passages are short sentences drawn from fixed word lists with a seed: no download.
- ``decode``: ``engine_replay``'s ``Workload`` (60-token word salad, 128 new tokens, ignore_eos).

    python -m bench.speculation [--model smollm2 --dtype fp32 --quantize int4 --loads copy,decode
        --concurrency 1,16 --requests N --k 4 --prompt-lookup-min 2 --prompt-lookup-max 4
        --n-positions 1024 --draft-model PATH --out F]

``--draft-model`` speculates with a draft model of the same tokenizer (vLLM's ``draft_model``, k =
``--k``) instead of the n-gram lookup; the draft runs eagerly in the same dtype and quantization.

The engine without speculation runs every (load, concurrency) first and is freed, then the engine
with it (each has the machine to itself). Each run follows a warm-up of ``concurrency`` other
prompts. Reported per run: output tokens per second, engine steps, and from the speculating engine's
counters (``EngineStats.extra``, what ``/metrics`` serves as ``vllm:spec_decode_*``) drafts, draft
and accepted tokens, acceptance (accepted / draft tokens) and accepted tokens per verify; then the
on/off ratio and the requests whose greedy output differs with speculation (fp32: expected none).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

from neuron_lmi.backends.cpu.llm import LLM
from neuron_lmi.bench.workload import TokenCount, Workload
from neuron_lmi.engine.core import EngineCore
from neuron_lmi.engine.types import SamplingParams, TokenEvent

WARMUP_SEED_OFFSET = 10_000  # the warm-up's prompts are none of the measured ones
COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
# The copy load's passages are simple sentences a small instruct model can copy, from these lines:
# adjectives, nouns, verbs, prepositions, and the words a noun is renamed to (none of the nouns).
WORD_LISTS = """
old small green quiet bright cold long red open dark young heavy
man river house road city tree window book door stone bird child ship garden letter
sees finds follows opens crosses paints carries watches reaches passes
near across behind under beside past toward
lantern violin harbor meadow copper falcon
"""
ADJECTIVES, NOUNS, VERBS, PREPOSITIONS, NEW_WORDS = (
    tuple(line.split()) for line in WORD_LISTS.strip().splitlines()
)

Key = tuple[str, int]  # (load, concurrency)


def sentence(rng: random.Random) -> str:
    adj, noun, verb, adj2, noun2 = (rng.choice(w) for w in (ADJECTIVES, NOUNS, VERBS, ADJECTIVES, NOUNS))
    return f"The {adj} {noun} {verb} the {adj2} {noun2} {rng.choice(PREPOSITIONS)} the {rng.choice(NOUNS)}."


def chat(tokenizer: Any, text: str) -> str:
    """``text`` as a user turn in the model's chat template (as it is, for a model without one)."""
    if getattr(tokenizer, "chat_template", None) is None:
        return text
    messages = [{"role": "user", "content": text}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def copy_prompts(tokenizer: Any, n: int, seed: int, prompt_tokens: int) -> list[str]:
    """``n`` requests to repeat a passage with one noun renamed, each about ``prompt_tokens`` long.
    Sentences are added while the template's tokens plus the sentences' stay under the target
    (counted apart, so the prompt is tokenized once per sentence, not once per prompt so far)."""
    prompts = []
    for index in range(n):
        rng = random.Random(seed * 1_000_003 + index)
        first = sentence(rng)
        old, new = first.split()[2], rng.choice(NEW_WORDS)  # the first sentence's noun
        ask = (
            f"Repeat the passage below exactly, word for word, but write '{new}' instead of '{old}' "
            f"every time it appears. Write nothing else.\n\n"
        )
        used = len(tokenizer.encode(chat(tokenizer, ask + first)))
        sentences = [first]
        while used < prompt_tokens:
            sentences.append(sentence(rng))
            used += len(tokenizer.encode(" " + sentences[-1]))
        prompts.append(chat(tokenizer, ask + " ".join(sentences)))
    return prompts


def spec_counters(core: EngineCore) -> dict[str, float]:
    extra = core.stats().extra
    return {name: extra.get(name, 0.0) for name in COUNTERS}


def replay(
    core: EngineCore, prompts: list[str], params: SamplingParams, concurrency: int, tag: str
) -> tuple[dict[str, float], list[list[int]]]:
    """Run ``prompts``, ``concurrency`` at a time (one joins as one finishes): the run's figures and
    each prompt's output ids."""
    outputs: list[list[int]] = [[] for _ in prompts]
    live: set[int] = set()
    errors = sent = 0

    def add() -> None:
        nonlocal sent
        index, sent = sent, sent + 1

        def sink(event: TokenEvent, index: int = index) -> None:
            nonlocal errors
            if event.token_id >= 0:
                outputs[index].append(event.token_id)
            if event.finish_reason is not None:
                errors += event.error is not None
                live.discard(index)

        core.add(core.make_request(prompts[index], params, request_id=f"{tag}-{index}", sink=sink))
        live.add(index)

    before, steps0 = spec_counters(core), core.steps
    start = time.perf_counter()
    while sent < len(prompts) or core.has_work():
        while len(live) < concurrency and sent < len(prompts):
            add()
        core.step()
    wall = time.perf_counter() - start
    after = spec_counters(core)
    drafts, draft_tokens, accepted = (after[c] - before[c] for c in COUNTERS)
    tokens = sum(len(o) for o in outputs)
    steps = core.steps - steps0
    result = {
        "requests": len(prompts),
        "errors": errors,
        "duration_s": wall,
        "steps": steps,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / wall,
        "tokens_per_step": tokens / max(steps, 1),
        "drafts": drafts,
        "draft_tokens": draft_tokens,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
        "accepted_per_verify": accepted / drafts if drafts else 0.0,
    }
    return result, outputs


def load_prompts(args: argparse.Namespace, tokenizer: Any, load: str, n: int, seed: int) -> list[str]:
    if load == "copy":
        return copy_prompts(tokenizer, n, seed, args.prompt_tokens)
    workload = Workload(TokenCount("fixed", 60), TokenCount("fixed", args.decode_output_tokens), seed)
    return [workload.request(i).prompt for i in range(n)]


def run_engine(
    args: argparse.Namespace, spec: bool, keys: list[Key]
) -> tuple[dict[Key, dict[str, float]], dict[Key, list[list[int]]], dict[str, float]]:
    """Build one engine, run every (load, concurrency) on it; its figures, outputs and mean prompt
    lengths. The engine is dropped on return, so the next one is built on a free machine."""
    speculative = None
    if spec and args.draft_model:
        speculative = {"method": "draft_model", "model": args.draft_model, "num_speculative_tokens": args.k}
    elif spec:
        speculative = {
            "method": "ngram",
            "num_speculative_tokens": args.k,
            "prompt_lookup_min": args.prompt_lookup_min,
            "prompt_lookup_max": args.prompt_lookup_max,
        }
    core = LLM(
        args.model, dtype=args.dtype, enforce_eager=args.eager, n_positions=args.n_positions,
        max_rolling_batch_size=args.batch or max(c for _, c in keys), speculative_config=speculative,
        **({"quantize": args.quantize} if args.quantize else {}),
    ).core  # fmt: skip
    results: dict[Key, dict[str, float]] = {}
    outputs: dict[Key, list[list[int]]] = {}
    lengths: dict[str, float] = {}
    for load, concurrency in keys:
        params = SamplingParams(
            max_new_tokens=args.output_tokens if load == "copy" else args.decode_output_tokens,
            temperature=0.0,
            ignore_eos=load == "decode",
            logprobs=False,
        )
        seed = args.seed + 100 * concurrency  # other prompts per concurrency: no prefix reused across
        n = args.requests or max(4, 2 * concurrency)
        tag = f"{load}-{concurrency}-{'on' if spec else 'off'}"
        warm = load_prompts(args, core.tokenizer, load, concurrency, seed + WARMUP_SEED_OFFSET)
        replay(core, warm, params, concurrency, tag + "-warm")
        measured = load_prompts(args, core.tokenizer, load, n, seed)
        lengths[load] = sum(len(core.tokenizer.encode(p)) for p in measured) / n
        results[load, concurrency], outputs[load, concurrency] = replay(
            core, measured, params, concurrency, tag
        )
        print(f"{tag}: {results[load, concurrency]['output_tokens_per_s']:.1f} tok/s", file=sys.stderr)
    del core
    gc.collect()
    return results, outputs, lengths


def table(rows: list[dict[str, Any]]) -> str:
    head = ("load", "conc", "spec", "tok/s", "steps", "tok/step", "drafts", "draft_tok", "accepted",
            "accept", "acc/verify", "ratio", "mismatch")  # fmt: skip
    lines = ["  ".join(f"{h:>10}" for h in head)]
    for r in rows:
        cells = (r["load"], r["concurrency"], r["spec"], f"{r['output_tokens_per_s']:.1f}", r["steps"],
                 f"{r['tokens_per_step']:.2f}", int(r["drafts"]), int(r["draft_tokens"]),
                 int(r["accepted_tokens"]), f"{r['acceptance_rate']:.3f}", f"{r['accepted_per_verify']:.2f}",
                 f"{r['ratio']:.2f}" if "ratio" in r else "", r.get("mismatched_requests", ""))  # fmt: skip
        lines.append("  ".join(f"{c!s:>10}" for c in cells))
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--quantize", choices=("int8", "int4"), help="option.quantize (smollm2: Q4_1 codes)")
    parser.add_argument("--loads", default="copy,decode")
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--requests", type=int, help="per run (default: 2 x concurrency, at least 4)")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument(
        "--draft-model",
        help="speculate with this draft model (same tokenizer; vLLM's draft_model) instead of n-gram lookup",
    )
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=300, help="the copy load's prompts")
    parser.add_argument("--output-tokens", type=int, default=256, help="the copy load's most new tokens")
    parser.add_argument("--decode-output-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, help="max_rolling_batch_size (default: the top concurrency)")
    parser.add_argument("--n-positions", type=int, default=1024)
    parser.add_argument("--eager", action="store_true", help="no compiled graphs (smoke tests)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    loads = args.loads.split(",")
    if unknown := set(loads) - {"copy", "decode"}:
        parser.error(f"--loads: unknown {sorted(unknown)}; known: copy, decode")
    keys = [(load, int(c)) for load in loads for c in args.concurrency.split(",")]
    off, off_out, lengths = run_engine(args, False, keys)
    on, on_out, _ = run_engine(args, True, keys)
    rows: list[dict[str, Any]] = []
    for key in keys:
        mismatched = sum(a != b for a, b in zip(off_out[key], on_out[key], strict=True))
        ratio = on[key]["output_tokens_per_s"] / off[key]["output_tokens_per_s"]
        base = {"load": key[0], "concurrency": key[1]}
        on_row = {**base, "spec": "on", **on[key], "ratio": ratio, "mismatched_requests": mismatched}
        rows += [{**base, "spec": "off", **off[key]}, on_row]
    print("mean prompt tokens: " + ", ".join(f"{k} {v:.0f}" for k, v in lengths.items()))
    print(table(rows))
    if args.out:
        report = {"args": {k: str(v) for k, v in vars(args).items()}, "prompt_tokens": lengths, "runs": rows}
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
