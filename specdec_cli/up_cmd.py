"""specdec up: the three services as separate local processes, stopped cleanly on Ctrl-C."""

from __future__ import annotations

import argparse
import re
import time

from specdec_cli.flags import UsageError, default_of
from specdec_cli.processes import ServiceProcess
from specdec_cli.serve_cmd import add_speculation_flags, packed_rows_flag
from specdec_cli.stack import (
    DEFAULT_HTTP_PORT,
    StackConfig,
    local_stack,
    stop_on_signals,
)

STACK_DRAFT_METHODS = ("hybrid", "model")  # a local stack always runs a draft model
HTTP_URL = re.compile(r"^READY orchestrator .* http=(\S+)")


def configure(parser: argparse.ArgumentParser) -> None:
    add_stack_flags(parser)
    parser.add_argument("--http-port", type=int, default=DEFAULT_HTTP_PORT,
                        help="port of the orchestrator's OpenAI-compatible HTTP API; 0 picks a "
                             "free one")
    parser.add_argument("--no-http", action="store_true", help="no OpenAI-compatible HTTP API")
    parser.set_defaults(func=run)


def http_url(orchestrator: ServiceProcess) -> str | None:
    """The HTTP API's base URL from the orchestrator's READY line; None if it serves none."""
    for line in list(orchestrator.lines):
        match = HTTP_URL.match(line)
        if match:
            return match.group(1)
    return None


def add_stack_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default=default_of(StackConfig, "target"),
                        help="target model directory or 'default'")
    parser.add_argument("--draft", default=default_of(StackConfig, "draft"),
                        help="draft model directory or 'default'")
    parser.add_argument("--device", default=default_of(StackConfig, "device"),
                        help="cpu or cuda[:N] (default: `specdec serve`'s)")
    parser.add_argument("--dtype", default=default_of(StackConfig, "dtype"),
                        help="auto, float32, float16, bfloat16 or float64 (default: `specdec serve`'s)")
    parser.add_argument("--host", default=default_of(StackConfig, "host"), help="address to bind")
    parser.add_argument("--port", type=int, default=default_of(StackConfig, "port"),
                        help="orchestrator port; 0 picks a free one")
    parser.add_argument("--threads", type=int, default=default_of(StackConfig, "threads"),
                        help="torch threads of each model service (default: torch's choice)")
    parser.add_argument("--packed-rows", type=packed_rows_text, default=default_of(StackConfig, "packed_rows"),
                        metavar="auto|off|any|N,N",
                        help="the model services' --packed-rows: their linear layers' weights packed "
                             "once (oneDNN's layout for any row count, or MKL's per row count), for "
                             "faster multi-row passes at the cost of a copy of the weights "
                             "(default: `specdec serve`'s, auto)")
    parser.add_argument("--draft-method", choices=STACK_DRAFT_METHODS, default=None,
                        help="hybrid: per round the suffix lookup's proposal or the draft model's, "
                             "whichever the K controller expects to commit tokens faster; model: the "
                             f"draft model alone (default: {default_of(StackConfig, 'draft_method')}; "
                             "model with --pipeline on, auto or stream, which draft ahead with the model)")
    parser.add_argument("--draft-head", default=None, metavar="auto|none|DIR",
                        help="the target's --draft-head: a draft head whose drafts the target verifies "
                             "in its own Decode passes where nothing else proposes (default: "
                             "`specdec serve`'s, auto: the head shipped for the default target)")
    add_speculation_flags(parser)


def packed_rows_text(value: str) -> str:
    """--packed-rows checked as `specdec serve` reads it, passed on as given."""
    packed_rows_flag(value)
    return value


def stack_draft_method(draft_method: str | None, pipeline: str | None) -> str:
    """--draft-method as given, else the stack's default; model when pipelining is asked for
    (a lookup answers at once: there is nothing to draft ahead of)."""
    pipelined = pipeline in ("on", "auto", "stream")
    if draft_method is None:
        return "model" if pipelined else default_of(StackConfig, "draft_method")
    if pipelined and draft_method != "model":
        raise UsageError(f"--pipeline {pipeline} drafts ahead with the draft model: it needs "
                         f"--draft-method model, not {draft_method}")
    return draft_method


def stack_config(args: argparse.Namespace, echo: bool = True) -> StackConfig:
    return StackConfig(
        target=args.target, draft=args.draft, device=args.device, dtype=args.dtype, host=args.host,
        port=args.port, speculation=args.speculation, num_speculative_tokens=args.num_speculative_tokens,
        max_num_speculative_tokens=args.max_num_speculative_tokens, pipeline=args.pipeline,
        pipeline_fanout=args.pipeline_fanout,
        draft_method=stack_draft_method(args.draft_method, args.pipeline), echo=echo, threads=args.threads,
        packed_rows=args.packed_rows, draft_head=args.draft_head,
        # `specdec demo` shares these flags but has no HTTP API (no --http-port of its own)
        http_port=None if getattr(args, "no_http", True) else args.http_port)


def metrics_lines(services: dict[str, ServiceProcess]) -> str:
    """The Prometheus endpoint of each service, one line each."""
    lines = "".join(f"    {role}: {service.metrics_url}\n" for role, service in services.items()
                    if service.metrics_url)
    return f"  metrics:\n{lines}" if lines else ""


def run(args: argparse.Namespace) -> int:
    config = stack_config(args)  # a mistake in the flags is refused before anything starts
    stop_on_signals()  # Ctrl-C or SIGTERM, at any point: the services started so far are stopped
    try:
        with local_stack(config) as services:
            address = services["orchestrator"].address
            url = http_url(services["orchestrator"])
            http = f"  OpenAI-compatible HTTP: {url}\n" if url else ""
            print(f"\nspecdec is up: orchestrator at {address}\n{http}"
                  f"  try: specdec generate --orchestrator {address} --chat 'Write a haiku about GPUs.'\n"
                  f"{metrics_lines(services)}"
                  f"Ctrl-C stops all three services.", flush=True)
            try:
                while True:
                    time.sleep(1.0)
                    for service in services.values():
                        if service.process.poll() is not None:
                            print(f"{service.role} exited with {service.process.returncode}; stopping",
                                  flush=True)
                            return 1
            except KeyboardInterrupt:
                print("\nstopping...", flush=True)
    except KeyboardInterrupt:
        print("\nstopped before the services were up", flush=True)
        return 130
    return 0
