"""specdec serve target|draft|orchestrator: one real gRPC server per process."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import socket
from pathlib import Path

from orchestrator.clients import RpcTimeouts
from specdec.rpc.auth import TOKEN_ENV
from specdec.rpc.server import DEFAULT_MAX_MESSAGE_BYTES, ServerConfig, TlsConfig
from specdec.sampling import MAX_DRAFT_TOP_M

DEFAULT_PORTS = {"orchestrator": 50050, "target": 50051, "draft": 50052}


def register(subparsers: argparse._SubParsersAction) -> None:
    serve = subparsers.add_parser("serve", help="run one service (target, draft or orchestrator)")
    roles = serve.add_subparsers(dest="role", required=True, metavar="ROLE")
    for role in ("target", "draft"):
        parser = roles.add_parser(role, help=f"the {role} model service")
        _server_flags(parser, role)
        _model_flags(parser, role)
        parser.set_defaults(func=run_model_service)
    parser = roles.add_parser("orchestrator", help="the public API; runs the guess-verify loop")
    _server_flags(parser, "orchestrator")
    orchestrator_flags(parser)
    parser.set_defaults(func=run_orchestrator)


def _server_flags(parser: argparse.ArgumentParser, role: str) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORTS[role],
                        help=f"service port; 0 picks a free one (default {DEFAULT_PORTS[role]})")
    parser.add_argument("--health-port", type=int, default=None,
                        help="also serve grpc.health.v1 in plaintext on this port (for kubelet probes)")
    parser.add_argument("--max-message-bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES)
    parser.add_argument("--grace-seconds", type=float, default=10.0,
                        help="on SIGTERM, how long in-flight calls may finish (default 10)")
    parser.add_argument("--tls-cert", type=Path, help="PEM certificate of this server (enables TLS)")
    parser.add_argument("--tls-key", type=Path, help="PEM private key of this server")
    parser.add_argument("--tls-ca", type=Path,
                        help="PEM CA bundle; a server requires client certificates signed by it")


def _model_flags(parser: argparse.ArgumentParser, role: str) -> None:
    parser.add_argument("--model", required=True,
                        help="a local Hugging Face model directory, or 'default' for the default pair")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    parser.add_argument("--dtype", default="auto",
                        choices=["auto", "float32", "float16", "bfloat16", "float64"],
                        help="auto: float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--replica-id", default=None, help="this replica's name (default host:port)")
    parser.add_argument("--max-sessions", type=int, default=64, help="session budget (default 64)")
    parser.add_argument("--max-cached-tokens", type=int, default=1_000_000,
                        help="budget of tokens held in KV caches (default 1,000,000)")
    parser.add_argument("--session-ttl", type=float, default=600.0,
                        help="idle sessions are dropped after this many seconds (default 600)")
    parser.add_argument("--max-num-speculative-tokens", type=int, default=16,
                        help="largest K accepted per round (default 16)")
    parser.add_argument("--max-context", type=int, default=0,
                        help="longest sequence per session; 0: the model's own limit")
    parser.add_argument("--max-queue", type=int, default=64,
                        help="forward passes waiting before RESOURCE_EXHAUSTED (default 64)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads for forward passes (default: torch's choice)")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="serve Prometheus metrics (specdec_active_sessions, ...) on this HTTP port")
    if role == "draft":
        parser.add_argument("--top-m", type=int, default=MAX_DRAFT_TOP_M,
                            help=f"entries of each draft distribution sent when sampling (<= {MAX_DRAFT_TOP_M})")


def orchestrator_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--draft", required=True, help="draft replicas: host:port[,host:port], dns:///name:port or k8s://namespace/service:port")
    parser.add_argument("--target", required=True, help="target replicas: host:port[,host:port], dns:///name:port or k8s://namespace/service:port")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="tokenizer directory (default: fetched from a target replica)")
    add_speculation_flags(parser)
    parser.add_argument("--default-max-new-tokens", type=int, default=256)
    parser.add_argument("--startup-timeout", type=float, default=600.0,
                        help="seconds to wait for the pools at start (default 600)")
    parser.add_argument("--pool-refresh-seconds", type=float, default=2.0,
                        help="how often replicas are re-discovered and probed (default 2)")
    defaults = RpcTimeouts()
    parser.add_argument("--prefill-timeout", type=float, default=defaults.prefill_seconds,
                        help="deadline of a Prefill on a replica, seconds "
                             f"(default {defaults.prefill_seconds:g})")
    parser.add_argument("--step-timeout", type=float, default=defaults.step_seconds,
                        help="deadline of a Propose or Verify; a replica that stalls longer is "
                             f"treated as failed (default {defaults.step_seconds:g})")
    parser.add_argument("--control-timeout", type=float, default=defaults.control_seconds,
                        help="deadline of Info, Release and GetTokenizer "
                             f"(default {defaults.control_seconds:g})")
    parser.add_argument("--auth-token-file", type=Path, default=None,
                        help=f"clients of the API must send 'authorization: Bearer <token>' with "
                             f"the token in this file (default: ${TOKEN_ENV} if set, else no token)")
    parser.add_argument("--upstream-tls-cert", type=Path, default=None,
                        help="client certificate shown to the draft and target replicas "
                             "(default: --tls-cert)")
    parser.add_argument("--upstream-tls-key", type=Path, default=None,
                        help="its private key (default: --tls-key)")
    parser.add_argument("--upstream-tls-ca", type=Path, default=None,
                        help="CA bundle the replicas' certificates are checked against "
                             "(default: --tls-ca)")
    parser.add_argument("--upstream-tls-server-name", default=None,
                        help="name the replicas' certificates must carry, when it differs from "
                             "the address dialled (e.g. pod IPs behind a Service's name)")


def add_speculation_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--speculation", default="adaptive",
                        choices=["off", "fixed", "adaptive", "heuristic"],
                        help="default speculation mode for requests that do not set one (default adaptive)")
    parser.add_argument("--num-speculative-tokens", type=int, default=4,
                        help="K of fixed mode and the heuristic's starting K (default 4)")
    parser.add_argument("--max-num-speculative-tokens", type=int, default=16,
                        help="the cap of adaptive K (default 16; the servers' limit also applies)")


def server_config(args: argparse.Namespace) -> ServerConfig:
    tls = None
    if args.tls_cert or args.tls_key:
        if not (args.tls_cert and args.tls_key):
            raise SystemExit("--tls-cert and --tls-key go together")
        tls = TlsConfig(cert_file=args.tls_cert, key_file=args.tls_key, ca_file=args.tls_ca)
    return ServerConfig(
        host=args.host, port=args.port, health_port=args.health_port,
        max_message_bytes=args.max_message_bytes, grace_seconds=args.grace_seconds, tls=tls,
    )


def run_model_service(args: argparse.Namespace) -> int:
    from specdec.models import ModelConfig
    from specdec.serving import ServiceConfig
    from specdec.sessions import SessionBudget

    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    model = ModelConfig(args.model, args.role, device=args.device, dtype=args.dtype,
                        max_context=args.max_context)
    service = ServiceConfig(
        replica_id=args.replica_id or default_replica_id(args.port),
        budget=SessionBudget(args.max_sessions, args.max_cached_tokens, args.session_ttl),
        max_num_speculative_tokens=args.max_num_speculative_tokens,
        max_queue=args.max_queue,
    )
    if args.role == "target":
        from target_service.server import serve

        asyncio.run(serve(model, service, server_config(args), args.metrics_port))
    else:
        from draft_service.server import serve
        from draft_service.service import DraftConfig

        asyncio.run(serve(model, service, server_config(args), args.metrics_port,
                          DraftConfig(top_m=args.top_m)))
    return 0


def default_replica_id(port: int) -> str:
    host = socket.gethostname()
    return f"{host}:{port}" if port else f"{host}-{os.getpid()}"


def orchestrator_config(args: argparse.Namespace):
    from orchestrator.pool import PoolConfig
    from orchestrator.service import OrchestratorConfig

    return OrchestratorConfig(
        draft=args.draft,
        target=args.target,
        tokenizer=args.tokenizer,
        speculation=args.speculation,
        num_speculative_tokens=args.num_speculative_tokens,
        max_num_speculative_tokens=args.max_num_speculative_tokens,
        default_max_new_tokens=args.default_max_new_tokens,
        startup_timeout_seconds=args.startup_timeout,
        pool=PoolConfig(
            refresh_seconds=args.pool_refresh_seconds,
            tls=upstream_tls(args),
            timeouts=RpcTimeouts(args.prefill_timeout, args.step_timeout, args.control_timeout),
            max_message_bytes=args.max_message_bytes,
        ),
    )


def upstream_tls(args: argparse.Namespace) -> TlsConfig | None:
    """The orchestrator's TLS to the replicas: its own server certificate, key and CA unless the
    --upstream-tls-* flags name others (a client certificate, a CA for the replicas)."""
    cert = args.upstream_tls_cert or args.tls_cert
    key = args.upstream_tls_key or args.tls_key
    ca = args.upstream_tls_ca or args.tls_ca
    if not (cert or key or ca):
        if args.upstream_tls_server_name:
            raise SystemExit("--upstream-tls-server-name needs TLS to the replicas")
        return None
    if not (cert and key):
        raise SystemExit("TLS to the replicas needs a client certificate and key: "
                         "--upstream-tls-cert and --upstream-tls-key (or --tls-cert and --tls-key)")
    return TlsConfig(cert_file=cert, key_file=key, ca_file=ca, server_name=args.upstream_tls_server_name)


def run_orchestrator(args: argparse.Namespace) -> int:
    from orchestrator.server import serve
    from specdec.errors import IncompatibleModels, Unavailable

    from specdec.rpc.auth import BearerTokenInterceptor, load_token

    try:
        token = load_token(args.auth_token_file)
    except (OSError, ValueError) as error:
        raise SystemExit(f"specdec: cannot read the auth token: {error}")
    config = server_config(args)
    if token is not None:
        config = dataclasses.replace(config, interceptors=(BearerTokenInterceptor(token),))
    try:
        asyncio.run(serve(orchestrator_config(args), config))
    except (IncompatibleModels, Unavailable) as error:
        print(f"specdec: orchestrator cannot start: {error}", flush=True)
        return 2
    return 0
