"""``neuron-lmi generate``: one prompt through the CPU engine; only the generated text on stdout."""

from __future__ import annotations

import argparse
import sys

from neuron_lmi.config.options import DEFAULT_MODEL
from neuron_lmi.engine.types import InvalidRequestError, SamplingParams


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help="generate text for one prompt on the CPU engine")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument(
        "--model", default=DEFAULT_MODEL, help=f"{DEFAULT_MODEL}, a Hugging Face directory or a .gguf file"
    )
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop sequence (repeatable)")
    p.add_argument(
        "--chat", action="store_true", help="apply the tokenizer's chat template (one user message)"
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "fp32", "bf16"],
        help="auto: bf16 on CPUs with native bf16",
    )
    p.add_argument("--quantize", choices=["int8", "int4"], help="weight-only quantization (option.quantize)")
    p.add_argument("--n-positions", type=int, default=None)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from neuron_lmi.backends.cpu.llm import LLM

    params = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        stop=tuple(args.stop),
    )
    try:
        params.validate()
    except InvalidRequestError as exc:
        print(f"neuron-lmi generate: error: {exc}", file=sys.stderr)
        return 2
    n_positions = args.n_positions
    llm = LLM(
        args.model,
        dtype=args.dtype,
        quantize=args.quantize,
        max_rolling_batch_size=1,
        n_positions=n_positions,
    )
    prompt = args.prompt
    if args.chat:
        prompt = llm.tokenizer.apply_chat_template(  # type: ignore[attr-defined]
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
    try:
        (completion,) = llm.generate(prompt, params)
    except InvalidRequestError as exc:
        print(f"neuron-lmi generate: error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(completion.text + "\n")
    return 0 if completion.error is None else 1
