"""specdec serve target|draft|orchestrator: one real gRPC server per process."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from draft_service.lookup_service import LookupDraftConfig
from draft_service.service import DraftConfig
from orchestrator.clients import RpcTimeouts
from orchestrator.k_policy import SPECULATION_MODES
from orchestrator.local_draft import LookupConfig
from orchestrator.pipelining import PIPELINE_MODES
from orchestrator.pool import PoolConfig
from orchestrator.service import OrchestratorConfig
from specdec.lookup import DRAFT_METHODS, LOOKUP_METHODS, SUFFIX_CACHE_MODES
from specdec.models import ModelConfig
from specdec.packed_linear import ANY_ROWS, DEFAULT_PACKED_ROWS, check_row_counts, packing_text
from specdec.rpc.auth import TOKEN_ENV
from specdec.rpc.server import ServerConfig, TlsConfig, check_port_free
from specdec.serving import ServiceConfig
from specdec.sessions import SessionBudget
from specdec.worker import BatchLimits
from specdec_cli.client import DEFAULT_PORTS
from specdec_cli.flags import HelpFormatter, UsageError, default_of


def configure(serve: argparse.ArgumentParser) -> None:
    roles = serve.add_subparsers(dest="role", required=True, metavar="ROLE")
    for role in ("target", "draft"):
        parser = roles.add_parser(role, help=f"the {role} model service", formatter_class=HelpFormatter)
        _server_flags(parser, role)
        _model_flags(parser, role)
        parser.set_defaults(func=run_model_service)
    parser = roles.add_parser("orchestrator", help="the public API; runs the guess-verify loop",
                              formatter_class=HelpFormatter)
    _server_flags(parser, "orchestrator")
    orchestrator_flags(parser)
    parser.set_defaults(func=run_orchestrator)


def _server_flags(parser: argparse.ArgumentParser, role: str) -> None:
    parser.add_argument("--host", default=default_of(ServerConfig, "host"), help="address to bind")
    parser.add_argument("--port", type=int, default=DEFAULT_PORTS[role],
                        help="service port; 0 picks a free one")
    parser.add_argument("--health-port", type=int, default=None,
                        help="also serve grpc.health.v1 in plaintext on this port (for kubelet probes)")
    parser.add_argument("--max-message-bytes", type=int,
                        default=default_of(ServerConfig, "max_message_bytes"),
                        help="largest gRPC message sent or received")
    parser.add_argument("--grace-seconds", type=float, default=default_of(ServerConfig, "grace_seconds"),
                        help="on SIGTERM, how long in-flight calls may finish")
    parser.add_argument("--tls-cert", type=Path, help="PEM certificate of this server (enables TLS)")
    parser.add_argument("--tls-key", type=Path, help="PEM private key of this server")
    parser.add_argument("--tls-ca", type=Path,
                        help="PEM CA bundle; a server requires client certificates signed by it")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="serve Prometheus metrics on this HTTP port at /metrics (0: a free "
                             "one, named in the READY line); see deploy/README.md for the names")
    parser.add_argument("--cpus", default=None, metavar="LIST",
                        help="run this process on these CPUs only, pinned before its threads "
                             "start (Linux): 0, 0,1, 0-3, 0-1,4" + (
                                 "; torch then uses one thread per CPU unless --threads says "
                                 "otherwise" if role != "orchestrator" else "") + " (default: any CPU)")


def packed_rows_flag(value: str) -> str | tuple[int, ...]:
    """--packed-rows: "auto", "off" (no packing: ()), "any" (oneDNN's packing) or comma-separated
    row counts for MKL's, each >= 4."""
    if value in ("auto", "off", ANY_ROWS):
        return () if value == "off" else value
    try:
        return check_row_counts([int(part) for part in value.split(",") if part.strip()] or [0])
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"auto, off, {ANY_ROWS} or row counts such as 8,17 ({error})") from None


def _model_flags(parser: argparse.ArgumentParser, role: str) -> None:
    parser.add_argument("--model", required=True,
                        help="a local Hugging Face model directory, or 'default' for the default pair")
    parser.add_argument("--device", default=default_of(ModelConfig, "device"), help="cpu or cuda[:N]")
    parser.add_argument("--dtype", default=default_of(ModelConfig, "dtype"),
                        choices=["auto", "float32", "float16", "bfloat16", "float64"],
                        help="auto: bfloat16 on CUDA and on a CPU with native bfloat16 (AVX512-BF16, "
                             "AMX), whose passes are then batch-invariant; float32 on other CPUs")
    parser.add_argument("--packed-rows", type=packed_rows_flag, default="auto",
                        metavar=f"auto|off|{ANY_ROWS}|N,N",
                        help="pack the linear layers' weights once for the CPU's matrix product: "
                             f"{ANY_ROWS}: oneDNN's layout, one copy of the weights that serves a pass "
                             "of any row count; N,N: MKL's, a copy per row count, a pass of 4 rows or "
                             "more padded to the next (float32 only). Multi-row passes (verify "
                             "rounds, batched sessions) run much faster. auto: on a CPU in float32, "
                             f"whichever of {ANY_ROWS} and {packing_text(DEFAULT_PACKED_ROWS)} "
                             "multiplies faster on this machine, measured at load; in bfloat16 on a "
                             f"CPU with native bfloat16, {ANY_ROWS}; else off")
    parser.add_argument("--replica-id", default=None, help="this replica's name (default host:port)")
    parser.add_argument("--max-sessions", type=int, default=default_of(SessionBudget, "max_sessions"),
                        help="session budget")
    parser.add_argument("--max-cached-tokens", type=int,
                        default=default_of(SessionBudget, "max_cached_tokens"),
                        help="budget of tokens held in KV caches")
    parser.add_argument("--session-ttl", type=float, default=default_of(SessionBudget, "ttl_seconds"),
                        help="idle sessions are dropped after this many seconds")
    parser.add_argument("--max-num-speculative-tokens", type=int,
                        default=default_of(ServiceConfig, "max_num_speculative_tokens"),
                        help="largest K accepted per round")
    parser.add_argument("--max-context", type=int, default=default_of(ModelConfig, "max_context"),
                        help="longest sequence per session; 0: the model's own limit")
    parser.add_argument("--max-queue", type=int, default=default_of(ServiceConfig, "max_queue"),
                        help="calls queued or running before RESOURCE_EXHAUSTED")
    parser.add_argument("--max-pass-tokens", type=int, default=default_of(BatchLimits, "max_pass_tokens"),
                        help="rows (tokens, all sessions together) of one forward pass; longer "
                             "prompts are fed in chunks")
    parser.add_argument("--max-pass-sessions", type=int,
                        default=default_of(BatchLimits, "max_pass_sessions"),
                        help="sessions batched into one forward pass")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads for forward passes (default: one per CPU of "
                             "--cpus, else torch's choice)")
    parser.add_argument("--pass-lock", type=Path, default=None, metavar="FILE",
                        help="take turns with the model services on this machine that name the "
                             "same file: their forward passes never overlap, so services that share "
                             "CPU cores do not slow each other's passes down (`specdec up` sets it; "
                             "default: none, for a service with cores of its own)")
    if role == "target":
        parser.add_argument("--draft-head", default=default_of(ModelConfig, "draft_head"), metavar="DIR",
                            help="a draft head (`specdec distill-head`) whose drafts the target verifies in "
                                 "its own Decode passes where nothing else proposes: a directory, auto "
                                 "(the head shipped for the default target, with --model default) or "
                                 "none (default: %(default)s)")
    if role == "draft":
        parser.add_argument("--top-m", type=int, default=default_of(DraftConfig, "top_m"),
                            help="entries of each draft distribution sent when sampling (default "
                                 "and maximum: %(default)s)")
        parser.add_argument("--method", choices=("model", *LOOKUP_METHODS), default="model",
                            help="model: the draft model proposes; ngram / suffix: a lookup in the "
                                 "session's tokens proposes, no model loaded (--model then names "
                                 "the target, whose config and tokenizer give the vocabulary)")
        parser.add_argument("--suffix-cache", choices=SUFFIX_CACHE_MODES,
                            default=default_of(LookupDraftConfig, "suffix_cache"),
                            help="with --method suffix: the session's own tokens (session), or "
                                 "also a bounded cache of the outputs of this replica's sessions "
                                 "(shared; kept apart per the orchestrator's API tokens)")


def orchestrator_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--draft", required=True, help="draft replicas: host:port[,host:port], dns:///name:port or k8s://namespace/service:port; "
                                                        "or local:ngram / local:suffix, a model-free draft run in the orchestrator (no draft replicas)")
    parser.add_argument("--draft-method", choices=DRAFT_METHODS, default=None,
                        help="model: the draft replicas propose (the default with an address); "
                             "hybrid: per round the suffix lookup's proposal or the draft replicas', "
                             "whichever the K controller expects to commit tokens faster (with fixed K: "
                             "the lookup where its match is strong); ngram / suffix: as --draft local:METHOD")
    parser.add_argument("--suffix-cache", choices=SUFFIX_CACHE_MODES, default=default_of(LookupConfig, "suffix_cache"),
                        help="what the suffix lookup knows: the request's own tokens (session), or "
                             "also a bounded cache of recent outputs of all requests (shared)")
    parser.add_argument("--target", required=True, help="target replicas: host:port[,host:port], dns:///name:port or k8s://namespace/service:port")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="tokenizer directory (default: fetched from a target replica)")
    add_speculation_flags(parser)
    parser.add_argument("--default-max-new-tokens", type=int,
                        default=default_of(OrchestratorConfig, "default_max_new_tokens"),
                        help="max_new_tokens of a request that does not set it")
    parser.add_argument("--startup-timeout", type=float,
                        default=default_of(OrchestratorConfig, "startup_timeout_seconds"),
                        help="seconds to wait at start for a target replica to answer (the wait "
                             "is logged every few seconds; SIGTERM or Ctrl-C stop it)")
    parser.add_argument("--pool-refresh-seconds", type=float,
                        default=default_of(PoolConfig, "refresh_seconds"),
                        help="how often replicas are re-discovered and probed")
    parser.add_argument("--prefill-timeout", type=float, default=default_of(RpcTimeouts, "prefill_seconds"),
                        help="deadline of a Prefill on a replica, seconds")
    parser.add_argument("--step-timeout", type=float, default=default_of(RpcTimeouts, "step_seconds"),
                        help="deadline of a Propose or Verify; a replica that stalls longer is "
                             "treated as failed")
    parser.add_argument("--control-timeout", type=float, default=default_of(RpcTimeouts, "control_seconds"),
                        help="deadline of Info, Release and GetTokenizer")
    parser.add_argument("--http-port", type=int, default=None,
                        help="also serve the OpenAI-compatible HTTP API (/v1/completions, "
                             "/v1/chat/completions, /v1/models) on this port; 0 picks a free one "
                             "(default: no HTTP API)")
    parser.add_argument("--http-host", default=None,
                        help="address the HTTP API binds (default: --host)")
    parser.add_argument("--auth-token-file", type=Path, default=None,
                        help=f"clients of the API (gRPC and HTTP) must send 'authorization: Bearer "
                             f"<token>' with the token in this file, or with one of its lines (several "
                             f"clients, each with its own token; a shared suffix cache is kept apart "
                             f"per token) (default: ${TOKEN_ENV} if set, else no token)")
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
    parser.add_argument("--speculation", default=default_of(OrchestratorConfig, "speculation"),
                        choices=SPECULATION_MODES,
                        help="speculation mode of requests that do not set one")
    parser.add_argument("--num-speculative-tokens", type=int,
                        default=default_of(OrchestratorConfig, "num_speculative_tokens"),
                        help="K of fixed mode, the heuristic's starting K, and under --pipeline stream the "
                             "most offered drafts a target pass verifies for adaptive requests")
    parser.add_argument("--max-num-speculative-tokens", type=int,
                        default=default_of(OrchestratorConfig, "max_num_speculative_tokens"),
                        help="adaptive K's maximum (the servers' limit also applies)")
    parser.add_argument("--pipeline", default=default_of(OrchestratorConfig, "pipeline"),
                        choices=PIPELINE_MODES,
                        help="drafting ahead while the target verifies, for requests that do not set "
                             "it: off; on (every drafted round); auto (with adaptive K: drafting ahead where "
                             "the controller expects it to pay, or streaming the request unless rounds "
                             "measure clearly faster); stream (no rounds: the target decodes on and "
                             "verifies up to K of the draft's offered drafts in each pass)")
    parser.add_argument("--pipeline-fanout", type=int,
                        default=default_of(OrchestratorConfig, "pipeline_fanout"),
                        help="the draft's candidates per outcome to draft ahead for (on; default 3); the "
                             "maximum (auto, which picks the fan-out by its cost model; default 8, all the "
                             "draft's candidates); 0 drafts nothing ahead (streamed offers' branches take "
                             "only a request's own pipeline_fanout)")


def server_config(args: argparse.Namespace) -> ServerConfig:
    tls = None
    if args.tls_cert or args.tls_key:
        if not (args.tls_cert and args.tls_key):
            raise UsageError("--tls-cert and --tls-key go together")
        tls = TlsConfig(cert_file=args.tls_cert, key_file=args.tls_key, ca_file=args.tls_ca)
    return ServerConfig(
        host=args.host, port=args.port, health_port=args.health_port,
        max_message_bytes=args.max_message_bytes, grace_seconds=args.grace_seconds, tls=tls,
    )


def run_model_service(args: argparse.Namespace) -> int:
    if args.metrics_port:  # the service port and the health port are checked before the model loads
        check_port_free(args.host, args.metrics_port)
    threads = args.threads
    if args.cpus is not None:  # before any thread of ours starts (tracing's exporter included)
        cpus = pin_cpus(args.cpus)
        threads = len(cpus) if threads is None else threads
    start_tracing(f"specdec-{args.role}")
    if args.pass_lock is not None:
        check_pass_lock(args.pass_lock)
        logging.getLogger(__name__).info("forward passes take turns with the services that name %s "
                                         "(--pass-lock)", args.pass_lock)
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    with flag_values():
        model = ModelConfig(args.model, args.role, device=args.device, dtype=args.dtype,
                            max_context=args.max_context,
                            packed_rows=None if args.packed_rows == "auto" else args.packed_rows,
                            draft_head=getattr(args, "draft_head", "none"))
        if model.draft_head not in ("auto", "none"):
            from specdec.draft_head import is_head_dir

            if not is_head_dir(Path(model.draft_head)):
                raise UsageError(f"--draft-head {model.draft_head}: not a draft head directory "
                                 "(no specdec_head.json; `specdec distill-head` makes one)")
        service = ServiceConfig(
            replica_id=args.replica_id or default_replica_id(args.port),
            budget=SessionBudget(args.max_sessions, args.max_cached_tokens, args.session_ttl),
            max_num_speculative_tokens=args.max_num_speculative_tokens,
            max_queue=args.max_queue,
            batch=BatchLimits(args.max_pass_tokens, args.max_pass_sessions),
            pass_lock=args.pass_lock,
        )
        server = server_config(args)
        draft = DraftConfig(top_m=args.top_m) if args.role == "draft" else None
        lookup = (LookupDraftConfig(method=args.method, suffix_cache=args.suffix_cache)
                  if args.role == "draft" and args.method != "model" else None)
    if args.role == "target":
        from target_service.server import serve

        with tracing_flushed():
            asyncio.run(serve(model, service, server, args.metrics_port))
    else:
        from draft_service.server import serve

        with tracing_flushed():
            asyncio.run(serve(model, service, server, args.metrics_port, draft, lookup))
    return 0


def check_pass_lock(path: Path) -> None:
    """--pass-lock: a file this process can open (created if absent), checked before the model
    loads; else a usage error."""
    from specdec.pass_lock import PassLock

    try:
        PassLock(path).close()
    except OSError as error:
        raise UsageError(f"--pass-lock {path}: {error.strerror or error}") from None


def pin_cpus(text: str) -> frozenset[int]:
    """--cpus: this process on those CPUs (specdec/cpu_affinity.py); a bad list is a usage error."""
    from specdec.cpu_affinity import format_cpu_list, pin_to_cpus

    with flag_values():
        cpus = pin_to_cpus(text)
    logging.getLogger(__name__).info("pinned to CPU(s) %s", format_cpu_list(cpus))
    return cpus


def start_tracing(service_name: str) -> None:
    """OpenTelemetry traces, if the OTEL_* environment asks for them (specdec/tracing.py)."""
    from specdec.tracing import configure_tracing

    with flag_values():
        configure_tracing(service_name)


@contextmanager
def tracing_flushed() -> Iterator[None]:
    """Exports the spans still buffered when the server stops."""
    from specdec.tracing import shutdown_tracing

    try:
        yield
    finally:
        shutdown_tracing()


@contextmanager
def flag_values() -> Iterator[None]:
    """A config's ValueError (a flag's value out of range) is a usage error: one line, exit 2."""
    try:
        yield
    except ValueError as error:
        raise UsageError(str(error)) from error


def default_replica_id(port: int) -> str:
    host = socket.gethostname()
    return f"{host}:{port}" if port else f"{host}-{os.getpid()}"


def orchestrator_config(args: argparse.Namespace) -> OrchestratorConfig:
    return OrchestratorConfig(
        draft=args.draft,
        target=args.target,
        draft_method=args.draft_method or "",
        lookup=LookupConfig(suffix_cache=args.suffix_cache),
        tokenizer=args.tokenizer,
        speculation=args.speculation,
        num_speculative_tokens=args.num_speculative_tokens,
        max_num_speculative_tokens=args.max_num_speculative_tokens,
        pipeline=args.pipeline,
        pipeline_fanout=args.pipeline_fanout,
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
            raise UsageError("--upstream-tls-server-name needs TLS to the replicas")
        return None
    if not (cert and key):
        raise UsageError("TLS to the replicas needs a client certificate and key: "
                         "--upstream-tls-cert and --upstream-tls-key (or --tls-cert and --tls-key)")
    return TlsConfig(cert_file=cert, key_file=key, ca_file=ca, server_name=args.upstream_tls_server_name)


def run_orchestrator(args: argparse.Namespace) -> int:
    from orchestrator.server import serve
    from specdec.errors import IncompatibleModels, Unavailable
    from specdec.rpc.auth import BearerTokenInterceptor, load_tokens

    try:
        token = load_tokens(args.auth_token_file)  # one or several (one per line)
    except (OSError, ValueError) as error:
        raise UsageError(f"cannot read the auth token: {error}") from error
    if args.cpus is not None:
        pin_cpus(args.cpus)
    with flag_values():
        config = server_config(args)
        orchestrator = orchestrator_config(args)
        http = http_config(args, config, token)
    if token is not None:
        config = dataclasses.replace(config, interceptors=(BearerTokenInterceptor(token),))
    if args.metrics_port:  # before the wait for the pools
        check_port_free(args.host, args.metrics_port)
    start_tracing("specdec-orchestrator")
    try:
        with tracing_flushed():
            asyncio.run(serve(orchestrator, config, metrics_port=args.metrics_port, http=http))
    except asyncio.CancelledError:  # SIGTERM or SIGINT before it was up (specdec.rpc.server)
        print("specdec: orchestrator stopped by a signal before it was ready", flush=True)
        return 0
    except (IncompatibleModels, Unavailable) as error:
        print(f"specdec: orchestrator cannot start: {error}", flush=True)
        return 2
    return 0


def http_config(args: argparse.Namespace, server: ServerConfig, token: tuple[str, ...] | None):
    """The HTTP API's settings, None without --http-port: the gRPC port's host (unless
    --http-host), bearer token and TLS (HTTPS, client certificates when --tls-ca)."""
    if args.http_port is None:
        if args.http_host is not None:
            raise UsageError("--http-host needs --http-port")
        return None
    from orchestrator.http_api import HttpConfig

    return HttpConfig(host=args.http_host or args.host, port=args.http_port, auth_token=token,
                      tls=server.tls)
