"""`specdec proxy`: a TCP proxy that adds one-way delay and jitter, to put in front of a service."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from specdec.delay_proxy import DelayProxy, DelayProxyConfig


def parse_host_port(text: str) -> tuple[str, int]:
    """'host:port' or '[v6 address]:port' -> (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host.removeprefix("[").removesuffix("]"), int(port)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "proxy",
        help="forward TCP to a service, adding network delay (for benchmarks)",
        description=(
            "Listen on a port and forward every connection to HOST:PORT, holding the bytes in each"
            " direction for --delay-ms (plus jitter), so a round trip gains 2 x --delay-ms."
            " Prints the listening address, then runs until Ctrl-C."
        ),
    )
    parser.add_argument("--listen-host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--listen-port", type=int, default=0, help="port (0: pick a free one)")
    parser.add_argument(
        "--upstream", required=True, type=parse_host_port, metavar="HOST:PORT", help="service"
    )
    parser.add_argument(
        "--delay-ms", type=float, default=0.0, help="one-way delay added to each direction, ms"
    )
    parser.add_argument(
        "--jitter-ms", type=float, default=0.0, help="uniform jitter half-width per chunk, ms"
    )
    parser.add_argument("--seed", type=int, default=None, help="jitter random seed")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    upstream_host, upstream_port = args.upstream
    try:
        config = DelayProxyConfig(
            listen_host=args.listen_host,
            listen_port=args.listen_port,
            upstream_host=upstream_host,
            upstream_port=upstream_port,
            one_way_delay_ms=args.delay_ms,
            jitter_ms=args.jitter_ms,
            seed=args.seed,
        )
    except ValueError as exc:
        print(f"specdec proxy: {exc}", file=sys.stderr)
        return 2
    asyncio.run(_serve(config))
    return 0


async def _serve(config: DelayProxyConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)  # Ctrl-C arrives as KeyboardInterrupt
    async with DelayProxy(config) as proxy:
        print(
            f"specdec proxy listening on {config.listen_host}:{proxy.port}"
            f" -> {config.upstream_host}:{config.upstream_port}"
            f" (one-way delay {config.one_way_delay_ms:g} ms, jitter {config.jitter_ms:g} ms)",
            flush=True,
        )
        await stop.wait()
