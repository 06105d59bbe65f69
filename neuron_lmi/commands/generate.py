"""``neuron-lmi generate``: one prompt through the CPU engine; only the generated text on stdout.

The engine is configured as ``serve`` configures it (``config.load_config``): the flags here, then
``--properties`` (else the SageMaker model folder's serving.properties, when present), then
``OPTION_*`` and the other variables of the key table, then the defaults. One difference: one prompt
needs one KV row, so ``option.max_rolling_batch_size`` unset is
``config.options.GENERATE_MAX_ROLLING_BATCH_SIZE`` here.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING

from neuron_lmi.config.options import DEFAULT_MODEL, GENERATE_MAX_ROLLING_BATCH_SIZE, ConfigError
from neuron_lmi.engine.types import InvalidRequestError, SamplingParams

if TYPE_CHECKING:
    from neuron_lmi.config import ResolvedConfig

# The flags that are configuration keys, as load_config's highest-precedence source.
CONFIG_FLAGS = ("dtype", "quantize", "n_positions", "enforce_eager")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help="generate text for one prompt on the CPU engine")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument(
        "--model",
        dest="model_id",
        help=f"{DEFAULT_MODEL} (default), a Hugging Face directory or a .gguf file, s3://..., or a Hub id",
    )
    p.add_argument("--properties", help="an LMI serving.properties file (or the folder holding one)")
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
        choices=["auto", "fp32", "bf16"],
        help="option.dtype (unset or auto: bf16 on CPUs with native bf16, else fp32)",
    )
    p.add_argument("--quantize", choices=["int8", "int4"], help="weight-only quantization (option.quantize)")
    p.add_argument("--n-positions", type=int, help="option.n_positions")
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        default=None,
        help="option.enforce_eager: no compiled graphs (decode and prefill eagerly)",
    )
    p.set_defaults(func=run)


def resolve(args: argparse.Namespace, env: Mapping[str, str]) -> ResolvedConfig:
    """The configuration as ``serve`` resolves it, with one KV row unless a source sets the rows."""
    # Imported when the command runs, as serve's are: the CPU engine brings torch with it.
    from neuron_lmi.backends.cpu.llm import config_keys
    from neuron_lmi.config import load_config

    flags = {name: getattr(args, name) for name in CONFIG_FLAGS}
    resolved = load_config(config_keys(args.model_id, flags), args.properties, env)
    if any(
        not resolved.source_of(name).startswith("default")
        for name in ("max_rolling_batch_size", "batch_size")
    ):
        return resolved
    batching = resolved.config.batching.model_copy(
        update={"max_rolling_batch_size": GENERATE_MAX_ROLLING_BATCH_SIZE}
    )
    config = resolved.config.model_copy(update={"batching": batching})
    sources = {**resolved.sources, "max_rolling_batch_size": "default:generate (one prompt)"}
    return dataclasses.replace(resolved, config=config, sources=sources)


def run(args: argparse.Namespace) -> int:
    from neuron_lmi.backends.cpu.llm import LLM  # torch: when the command runs (as in resolve)

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
        resolved = resolve(args, os.environ)
    except (InvalidRequestError, ConfigError, FileNotFoundError) as exc:
        print(f"neuron-lmi generate: error: {exc}", file=sys.stderr)
        return 2
    llm = LLM.from_config(resolved, os.environ)
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
