"""specdec up: the three services as separate local processes, stopped cleanly on Ctrl-C."""

from __future__ import annotations

import argparse
import signal
import threading
from contextlib import ExitStack, contextmanager
from collections.abc import Iterator
from dataclasses import dataclass

from specdec_cli.processes import ServiceProcess, start_service
from specdec_cli.serve_cmd import add_speculation_flags


@dataclass(frozen=True)
class StackConfig:
    target: str = "default"
    draft: str = "default"
    device: str = "cpu"
    dtype: str = "auto"
    host: str = "127.0.0.1"
    port: int = 50050  # the orchestrator's; the model services take free ports
    speculation: str = "adaptive"
    num_speculative_tokens: int = 4
    max_num_speculative_tokens: int = 16
    echo: bool = True
    threads: int | None = None  # torch threads of each model service


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("up", help="start target, draft and orchestrator locally")
    add_stack_flags(parser)
    parser.set_defaults(func=run)


def add_stack_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="default", help="target model directory or 'default'")
    parser.add_argument("--draft", default="default", help="draft model directory or 'default'")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=50050, help="orchestrator port (default 50050)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads of each model service (default: torch's choice)")
    add_speculation_flags(parser)


def stack_config(args: argparse.Namespace, echo: bool = True) -> StackConfig:
    return StackConfig(args.target, args.draft, args.device, args.dtype, args.host, args.port,
                       args.speculation, args.num_speculative_tokens,
                       args.max_num_speculative_tokens, echo, args.threads)


@contextmanager
def local_stack(config: StackConfig) -> Iterator[dict[str, ServiceProcess]]:
    """Starts target and draft (concurrently), then the orchestrator; stops all on exit."""
    with ExitStack() as stack:
        started: dict[str, ServiceProcess] = {}

        def start(role: str, model: str) -> None:
            threads = ["--threads", str(config.threads)] if config.threads else []
            started[role] = start_service(role, [
                "--model", model, "--device", config.device, "--dtype", config.dtype,
                "--host", config.host, "--port", "0", *threads,
            ], echo=config.echo)

        threads = [threading.Thread(target=start, args=(role, model))
                   for role, model in (("target", config.target), ("draft", config.draft))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for service in started.values():
            stack.callback(service.stop)
        if set(started) != {"target", "draft"}:
            raise RuntimeError("a model service failed to start (see its output above)")
        orchestrator = start_service("orchestrator", [
            "--draft", started["draft"].address, "--target", started["target"].address,
            "--host", config.host, "--port", str(config.port),
            "--speculation", config.speculation,
            "--num-speculative-tokens", str(config.num_speculative_tokens),
            "--max-num-speculative-tokens", str(config.max_num_speculative_tokens),
        ], echo=config.echo)
        stack.callback(orchestrator.stop)
        started["orchestrator"] = orchestrator
        yield started


def run(args: argparse.Namespace) -> int:
    with local_stack(stack_config(args)) as services:
        address = services["orchestrator"].address
        print(f"\nspecdec is up: orchestrator at {address}\n"
              f"  try: specdec generate --orchestrator {address} --chat 'Write a haiku about GPUs.'\n"
              f"Ctrl-C stops all three services.", flush=True)
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        try:
            while not stop.wait(1.0):
                for service in services.values():
                    if service.process.poll() is not None:
                        print(f"{service.role} exited with {service.process.returncode}; stopping")
                        return 1
        except KeyboardInterrupt:
            print("\nstopping...", flush=True)
    return 0
