"""The `specdec` command. Each subcommand lives in its own module under specdec_cli/ exposing
configure(parser), which adds its flags and sets its handler (func)."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from specdec.errors import SpecdecError
from specdec.openmp import bound_idle_spin
from specdec_cli.flags import HelpFormatter, UsageError

# Command -> (its module under specdec_cli/, one line of help). A module is imported only when its
# command runs, so `specdec generate` or `specdec pools` never pays for torch and transformers.
COMMANDS = {
    "serve": ("serve_cmd", "run one service (target, draft or orchestrator)"),
    "generate": ("generate_cmd", "send one request to an orchestrator"),
    "up": ("up_cmd", "start target, draft and orchestrator locally"),
    "demo": ("demo_cmd", "run the default pair locally and measure the speedup"),
    "distill": ("distill_cmd", "train a draft model for a target on the target's own greedy answers"),
    "distill-head": ("distill_head_cmd", "train a draft head for a target on the target's own greedy answers"),
    "pools": ("pools_cmd", "show the orchestrator's draft and target replicas"),
    "bench": ("bench_cmd", "measure a running pair: speculation off vs adaptive vs fixed K"),
    "proxy": ("proxy_cmd", "forward TCP to a service, adding network delay (for benchmarks)"),
}


class _LazyCommands(argparse._SubParsersAction):
    """Subcommands whose flags are added when the command is chosen (an import error of its
    module is raised, never hidden)."""

    def __call__(self, parser, namespace, values, option_string=None):
        configure_command(self._name_parser_map[values[0]], values[0])
        super().__call__(parser, namespace, values, option_string)


def configure_command(parser: argparse.ArgumentParser, name: str) -> None:
    """Imports the command's module and lets it add its flags, once per parser."""
    if getattr(parser, "_specdec_configured", False):
        return
    importlib.import_module(f"specdec_cli.{COMMANDS[name][0]}").configure(parser)
    parser._specdec_configured = True


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specdec", formatter_class=HelpFormatter,
        description="Distributed speculative decoding: draft and target services over gRPC.",
    )
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    parser.add_argument("--debug", action="store_true",
                        help="on an error, show the traceback instead of its one-line cause")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                       action=_LazyCommands)
    for name, (_, help_text) in COMMANDS.items():
        subparsers.add_parser(name, help=help_text, description=help_text,
                              formatter_class=HelpFormatter)
    return parser


def main(argv: list[str] | None = None) -> int:
    bound_idle_spin()  # before a command imports torch (specdec/openmp.py)
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (UsageError, SpecdecError) as error:
        if args.debug:
            raise
        print(f"specdec: {error}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
