"""``neuron-lmi`` entry point: each subcommand lives in its own module under ``neuron_lmi.commands``."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# Subcommand modules, imported only to register their parsers; heavy imports stay inside their run().
COMMAND_MODULES = (
    "generate",
    "serve",
    "compile",
    "cache",
    "plan",
    "bench",
    "package",
    "deploy",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="neuron-lmi", description=__doc__)
    parser.add_argument("--log-level", default="INFO", help="logging level for stderr (default INFO)")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(f"neuron_lmi.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"neuron_lmi.commands.{name}":
                continue
            raise
        module.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"neuron-lmi {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
