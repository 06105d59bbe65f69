"""``neuron-lmi bench``: measure a running server at one or more concurrency levels."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path
from urllib.parse import urlsplit

DEFAULT_REQUESTS = 100


def _concurrency_list(text: str) -> tuple[int, ...]:
    try:
        levels = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"concurrency levels must be >= 1, got {text!r}")
    return levels


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "bench",
        help="load-test a running OpenAI/TGI/LMI-compatible server",
        description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--url", required=True, help="server base URL, or a full endpoint URL with a path")
    parser.add_argument("--api", choices=("openai", "lmi", "tgi"), default="openai", help="wire format")
    parser.add_argument(
        "--openai-endpoint", choices=("chat", "completions"), default="chat", help="OpenAI route to use"
    )
    parser.add_argument("--concurrency", type=_concurrency_list, default=(1,), help="levels, e.g. 1,8,32")
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--requests", type=int, help=f"requests per level (default {DEFAULT_REQUESTS})")
    budget.add_argument("--duration", type=float, help="seconds per level (no new request after that)")
    parser.add_argument("--prompt-tokens", default="256", help="N, uniform:LOW:HIGH or normal:MEAN:SD")
    parser.add_argument("--output-tokens", default="128", help="N, uniform:LOW:HIGH or normal:MEAN:SD")
    parser.add_argument("--stream", action="store_true", help="stream responses (needed for TTFT and ITL)")
    parser.add_argument("--ignore-eos", action="store_true", help="ask the server to ignore EOS")
    parser.add_argument(
        "--model", help="model name for the OpenAI API; several comma-separated (adapters): in turn"
    )
    parser.add_argument("--api-key", help="sent as 'Authorization: Bearer ...' (or $NEURON_LMI_API_KEY)")
    parser.add_argument("--seed", type=int, default=0, help="seed for prompts and token counts")
    parser.add_argument("--timeout", type=float, default=300.0, help="per-request timeout in seconds")
    parser.add_argument("--out", type=Path, help="write results to a .json or .csv file")
    parser.add_argument("--plot", type=Path, help="write latency/throughput vs concurrency as PNG")
    parser.add_argument(
        "--timeline", type=Path, help="write each request's send time and token arrivals as JSON"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.set_defaults(func=run)
    return parser


def _openai_endpoint(args: argparse.Namespace) -> str:
    """A full URL's path decides the OpenAI body shape (chat messages or a plain prompt)."""
    path = urlsplit(args.url).path.rstrip("/")
    if path.endswith("/chat/completions"):
        return "chat"
    if path.endswith("/completions"):
        return "completions"
    return str(args.openai_endpoint)


def run(args: argparse.Namespace) -> int:
    # The load generator (httpx, asyncio, plotting) loads when the command runs, not on every CLI start.
    from neuron_lmi.bench.protocols import Api, RequestOptions
    from neuron_lmi.bench.report import format_table, plot, summarize, write_results, write_timeline
    from neuron_lmi.bench.runner import LoadConfig, run_sweep
    from neuron_lmi.bench.workload import Workload, parse_token_count

    if args.out is not None and args.out.suffix.lower() not in (".json", ".csv"):
        raise ValueError(f"--out {args.out}: expected a .json or .csv file name")
    if args.timeline is not None and args.timeline.suffix.lower() != ".json":
        raise ValueError(f"--timeline {args.timeline}: expected a .json file name")
    options = RequestOptions(
        models=tuple(name for name in (args.model or "").split(",") if name),
        ignore_eos=args.ignore_eos,
        openai_endpoint=_openai_endpoint(args),
    )
    workload = Workload(
        parse_token_count(args.prompt_tokens), parse_token_count(args.output_tokens), args.seed
    )
    requests = args.requests if args.requests is not None or args.duration is not None else DEFAULT_REQUESTS
    config = LoadConfig(
        url=args.url,
        api=Api(args.api, options),
        workload=workload,
        concurrency=tuple(args.concurrency),
        stream=args.stream,
        requests=requests,
        duration=args.duration,
        timeout=args.timeout,
        api_key=args.api_key or os.environ.get("NEURON_LMI_API_KEY"),
        progress=not args.no_progress,
    )
    config.validate()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request would bury the bar
    runs = asyncio.run(run_sweep(config))
    summaries = [summarize(r) for r in runs]
    print(format_table(summaries))
    described = {
        "url": config.endpoint(),
        "api": args.api,
        "stream": args.stream,
        "concurrency": list(config.concurrency),
        "requests": requests,
        "duration_s": args.duration,
        "prompt_tokens": workload.prompt_tokens.describe(),
        "output_tokens": workload.output_tokens.describe(),
        "model": args.model,
        "seed": args.seed,
    }
    if args.out is not None:
        write_results(args.out, described, summaries)
        print(f"results written to {args.out}", file=sys.stderr)
    if args.timeline is not None:
        write_timeline(args.timeline, runs)
        print(f"timeline written to {args.timeline}", file=sys.stderr)
    if args.plot is not None:
        plot(args.plot, summaries, f"{args.api} {config.endpoint()} ({'stream' if args.stream else 'whole'})")
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0 if any(s["successes"] for s in summaries) else 1
