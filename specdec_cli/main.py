"""The `specdec` command. Each subcommand lives in its own module exposing register(subparsers)."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# Modules under specdec_cli/ that each define register(subparsers); a module that is not there yet
# is skipped, so commands can land one at a time.
COMMAND_MODULES = (
    "serve_cmd",
    "generate_cmd",
    "up_cmd",
    "demo_cmd",
    "distill_cmd",
    "pools_cmd",
    "proxy_cmd",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specdec",
        description="Distributed speculative decoding: draft and target services over gRPC.",
    )
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(f"specdec_cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"specdec_cli.{name}":
                continue
            raise
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
