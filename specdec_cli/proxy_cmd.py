"""`specdec proxy`: a TCP proxy that adds one-way delay and jitter, to put in front of a service."""

from __future__ import annotations

import argparse
import asyncio
import errno
import signal
import sys

from specdec.delay_proxy import DelayProxy, DelayProxyConfig
from specdec_cli.flags import UsageError, default_of


def parse_host_port(text: str) -> tuple[str, int]:
    """'host:port' or '[v6 address]:port' -> (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host.removeprefix("[").removesuffix("]"), int(port)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Listen on a port and forward every connection to HOST:PORT, holding the bytes in each"
        " direction for --delay-ms (plus jitter), so a round trip gains 2 x --delay-ms."
        " Prints the listening address, then runs until Ctrl-C."
    )
    parser.add_argument("--listen-host", default=default_of(DelayProxyConfig, "listen_host"),
                        help="address to listen on")
    parser.add_argument("--listen-port", type=int, default=default_of(DelayProxyConfig, "listen_port"),
                        help="port (0: pick a free one)")
    parser.add_argument(
        "--upstream", required=True, type=parse_host_port, metavar="HOST:PORT", help="service"
    )
    parser.add_argument("--delay-ms", type=float, default=default_of(DelayProxyConfig, "one_way_delay_ms"),
                        help="one-way delay added to each direction, ms")
    parser.add_argument("--jitter-ms", type=float, default=default_of(DelayProxyConfig, "jitter_ms"),
                        help="uniform jitter half-width per chunk, ms")
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
    received = asyncio.run(_serve(config))
    return 130 if received == signal.SIGINT else 0  # 130: the shell's code for Ctrl-C


async def _serve(config: DelayProxyConfig) -> signal.Signals:
    """Runs until SIGTERM or SIGINT; returns which. Both are caught here, as a background job
    started by a non-interactive shell inherits SIGINT ignored and gets no KeyboardInterrupt."""
    stop = asyncio.Event()
    received: list[signal.Signals] = []
    loop = asyncio.get_running_loop()
    for number in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(number, lambda number=number: (received.append(number), stop.set()))
    proxy = DelayProxy(config)
    try:
        await proxy.start()
    except OSError as error:
        if error.errno == errno.EADDRINUSE:
            raise UsageError(f"port {config.listen_port} is already in use") from error
        raise
    try:
        print(
            f"specdec proxy listening on {config.listen_host}:{proxy.port}"
            f" -> {config.upstream_host}:{config.upstream_port}"
            f" (one-way delay {config.one_way_delay_ms:g} ms, jitter {config.jitter_ms:g} ms)",
            flush=True,
        )
        await stop.wait()
    finally:
        await proxy.close()
    return received[0]
