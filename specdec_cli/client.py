"""The client side of the public API, shared by the commands, the benchmarks and the tests: the
orchestrator's address and channel (TLS, bearer token), chat requests, and plain-text tables.
No torch here: `specdec generate` and `specdec pools` start in a fraction of a second."""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import grpc

from specdec.rpc.auth import TOKEN_ENV, bearer_metadata, load_token
from specdec.v1 import orchestrator_pb2 as pb
from specdec_cli.flags import UsageError

DEFAULT_PORTS = {"orchestrator": 50050, "target": 50051, "draft": 50052}


def with_default_port(address: str, port: int = DEFAULT_PORTS["orchestrator"]) -> str:
    """'host' -> 'host:PORT' (gRPC would dial 443); 'host:port', '[v6]:port' and gRPC target
    URIs (dns:///..., unix:...) are kept as they are."""
    if not address or ":/" in address or address.startswith(("unix:", "dns:", "ipv4:", "ipv6:")):
        return address
    if address.startswith("["):  # [v6] or [v6]:port
        return address if "]:" in address else f"{address}:{port}"
    colons = address.count(":")
    if colons == 1:
        return address
    return f"[{address}]:{port}" if colons > 1 else f"{address}:{port}"


def add_connection_flags(parser: argparse.ArgumentParser, timeout_seconds: float) -> None:
    """--orchestrator, --timeout, --auth-token-file and the TLS client flags."""
    default = f"127.0.0.1:{DEFAULT_PORTS['orchestrator']}"
    parser.add_argument("--orchestrator", type=with_default_port, default=default,
                        help="host[:port] of the orchestrator's API (port "
                             f"{DEFAULT_PORTS['orchestrator']} if left out)")
    parser.add_argument("--timeout", type=float, default=timeout_seconds, help="deadline in seconds")
    parser.add_argument("--auth-token-file", type=Path, default=None,
                        help=f"bearer token of the API (default: ${TOKEN_ENV} if set)")
    parser.add_argument("--tls-ca", type=Path, default=None,
                        help="PEM CA that signed the orchestrator's certificate (enables TLS)")
    parser.add_argument("--tls-cert", type=Path, default=None,
                        help="client certificate (mutual TLS; with --tls-key)")
    parser.add_argument("--tls-key", type=Path, default=None, help="its private key (mutual TLS)")
    parser.add_argument("--tls-server-name", default=None,
                        help="name the orchestrator's certificate must carry, when it differs from "
                             "the host dialled (default: that host)")


def open_channel(args: argparse.Namespace) -> grpc.Channel:
    """Plaintext, or TLS when --tls-ca is given (with a client certificate for mutual TLS)."""
    if args.tls_ca is None:
        if args.tls_cert or args.tls_key or args.tls_server_name:
            raise UsageError("--tls-cert, --tls-key and --tls-server-name need --tls-ca")
        return grpc.insecure_channel(args.orchestrator)
    if bool(args.tls_cert) != bool(args.tls_key):
        raise UsageError("--tls-cert and --tls-key go together")
    try:
        credentials = grpc.ssl_channel_credentials(
            root_certificates=args.tls_ca.read_bytes(),
            private_key=args.tls_key.read_bytes() if args.tls_key else None,
            certificate_chain=args.tls_cert.read_bytes() if args.tls_cert else None,
        )
    except OSError as error:
        raise UsageError(f"cannot read a TLS file: {error}") from error
    options = [("grpc.ssl_target_name_override", args.tls_server_name)] if args.tls_server_name else None
    return grpc.secure_channel(args.orchestrator, credentials, options=options)


def call_metadata(args: argparse.Namespace) -> tuple[tuple[str, str], ...] | None:
    """The bearer token of --auth-token-file or $SPECDEC_AUTH_TOKEN, as call metadata."""
    try:
        token = load_token(args.auth_token_file)
    except (OSError, ValueError) as error:
        raise UsageError(f"cannot read the auth token: {error}") from error
    return bearer_metadata(token) if token else None


def chat_request(messages: Iterable[Mapping[str, str]], max_new_tokens: int | None = None,
                 speculation: pb.SpeculationConfig | None = None, temperature: float = 0.0,
                 seed: int | None = None) -> pb.GenerateRequest:
    """A GenerateRequest of chat messages ({"role": ..., "content": ...}, as in the prompt sets)."""
    request = pb.GenerateRequest(
        messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages],
        max_new_tokens=max_new_tokens, speculation=speculation,
    )
    request.sampling.temperature = temperature
    if seed is not None:
        request.sampling.seed = seed
    return request


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]], markdown: bool = False,
                 left_columns: int = 1, rule: bool = True) -> str:
    """A plain-text or markdown table; the first `left_columns` columns are left-aligned (labels),
    the others right-aligned (figures). rule: a line of dashes under the headers (plain text)."""
    if markdown:
        align = [":---" if i < left_columns else "---:" for i in range(len(headers))]
        lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(align) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines)
    table = [list(headers), *map(list, rows)]
    widths = [max(len(line[i]) for line in table) for i in range(len(headers))]

    def render(line: Sequence[str]) -> str:
        return "  ".join(cell.ljust(w) if i < left_columns else cell.rjust(w)
                         for i, (cell, w) in enumerate(zip(line, widths))).rstrip()

    dashes = ["  ".join("-" * w for w in widths)] if rule else []
    return "\n".join([render(headers), *dashes, *map(render, rows)])
