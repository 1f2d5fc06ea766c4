"""Assembles a grpc.aio server: the error map, health (also on a separate plaintext port for the
kubelet's probes, which present no client certificate), reflection, message limits, TLS, and a
graceful stop on SIGTERM: NOT_SERVING, drain, then stop, with health answering to the end."""

from __future__ import annotations

import asyncio
import errno
import inspect
import logging
import signal
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from google.protobuf.message import DecodeError

from specdec.errors import InvalidInput, Unavailable
from specdec.rpc.errors import ErrorMappingInterceptor
from specdec.tracing import server_interceptors
from specdec.worker import run_on_model_thread

log = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024
LIVENESS_SERVICE = "liveness"  # shallow: the process answers; "" is deep: the model answers


@dataclass(frozen=True)
class TlsConfig:
    """PEM files. With ca_file set, a server requires client certificates signed by it (mutual
    TLS); a client presents cert_file and trusts servers signed by ca_file (None: system roots).
    server_name: the name a client checks the server's certificate against instead of the host it
    dials (replicas are dialled by pod IP, their certificate names the Service)."""

    cert_file: Path
    key_file: Path
    ca_file: Path | None = None
    server_name: str | None = None

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.key_file.read_bytes(), self.cert_file.read_bytes())],
            root_certificates=self.ca_file.read_bytes() if self.ca_file else None,
            require_client_auth=self.ca_file is not None,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca_file.read_bytes() if self.ca_file else None,
            private_key=self.key_file.read_bytes(),
            certificate_chain=self.cert_file.read_bytes(),
        )


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 0  # 0: an ephemeral port
    health_port: int | None = None  # plaintext health-only port; None: none, 0: ephemeral
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    grace_seconds: float = 10.0  # in-flight calls get this long to finish on stop
    tls: TlsConfig | None = None
    interceptors: Sequence[grpc.aio.ServerInterceptor] = field(default=())

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65536), got {self.port}")
        if self.health_port is not None and not 0 <= self.health_port < 65536:
            raise ValueError(f"health_port must be in [0, 65536), got {self.health_port}")
        if self.max_message_bytes < 1024:
            raise ValueError("max_message_bytes must be >= 1024")


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


def server_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """grpcio binds with SO_REUSEPORT by default: a second server on a port in use would start
    and take half of its connections. Off, so it fails to bind instead."""
    return [*channel_options(max_message_bytes), ("grpc.so_reuseport", 0)]


def check_port_free(host: str, port: int) -> None:
    """Raises Unavailable ("port N is already in use") if host:port cannot be listened on; port 0
    (an ephemeral one) always can."""
    if port == 0:
        return
    host = host.strip("[]")
    try:
        family, _, _, _, address = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        socket.create_server(address, family=family).close()
    except OSError as error:
        if error.errno == errno.EADDRINUSE:
            raise Unavailable(f"port {port} is already in use") from error
        raise Unavailable(f"cannot listen on {host}:{port}: {error.strerror or error}") from error


def _bind(server: grpc.aio.Server, host: str, port: int,
          credentials: grpc.ServerCredentials | None = None) -> int:
    """Adds the port to the server; a failure says why (grpc's own error does not)."""
    address = f"{host}:{port}"
    try:
        if credentials is not None:
            return server.add_secure_port(address, credentials)
        return server.add_insecure_port(address)
    except RuntimeError as error:
        check_port_free(host, port)
        raise Unavailable(f"cannot listen on {address}") from error


@dataclass(frozen=True)
class MalformedRequest:
    """What a request body that does not parse becomes, so the handler can refuse it clearly."""

    error: str


Guard = Callable[[Any, grpc.aio.ServicerContext], AbstractAsyncContextManager[None]]


def _guarded(handler: grpc.RpcMethodHandler, guard: Guard, request_deserializer=None) -> grpc.RpcMethodHandler:
    """The handler with `async with guard(request, context)` around its behavior (unary, server
    streaming, including a streaming coroutine that writes with context.write, or bidirectional:
    request None)."""
    deserializer = request_deserializer or handler.request_deserializer
    if handler.unary_unary is not None:
        behavior = handler.unary_unary

        async def unary(request, context):
            async with guard(request, context):
                return await behavior(request, context)

        return grpc.unary_unary_rpc_method_handler(
            unary, request_deserializer=deserializer, response_serializer=handler.response_serializer)
    if handler.unary_stream is not None:
        streaming = handler.unary_stream

        async def stream(request, context):
            async with guard(request, context):
                async for response in streaming(request, context):
                    yield response

        async def writing(request, context):
            async with guard(request, context):
                await streaming(request, context)

        return grpc.unary_stream_rpc_method_handler(
            stream if inspect.isasyncgenfunction(streaming) else writing,
            request_deserializer=deserializer, response_serializer=handler.response_serializer)
    if handler.stream_stream is not None:
        both = handler.stream_stream

        async def bidi(requests, context):
            async with guard(None, context):  # a stream's messages are checked as they come
                async for response in both(_parsed_messages(requests), context):
                    yield response

        return grpc.stream_stream_rpc_method_handler(
            bidi, request_deserializer=deserializer, response_serializer=handler.response_serializer)
    return handler


async def _parsed_messages(requests):
    """A request stream's messages; one that did not parse (MalformedRequestInterceptor) ends the
    call with INVALID_ARGUMENT."""
    async for message in requests:
        if isinstance(message, MalformedRequest):
            raise InvalidInput(f"a message of the stream is not valid ({message.error})")
        yield message


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """Bytes that are not the method's request message get INVALID_ARGUMENT. Left to grpc, a
    deserializer that raises gives INTERNAL, which callers read as a server bug."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        deserialize = handler.request_deserializer

        def tolerant(data: bytes) -> object:
            try:
                return deserialize(data)
            except (DecodeError, ValueError, TypeError) as error:
                return MalformedRequest(f"{type(error).__name__}: {error}")

        @asynccontextmanager
        async def parsed(request, context):
            if isinstance(request, MalformedRequest):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"the request is not a valid message ({request.error})")
            yield

        return _guarded(handler, parsed, tolerant)


class CallGate(grpc.aio.ServerInterceptor):
    """Counts the calls in flight; once closed (a drain), refuses new ones with UNAVAILABLE, a
    status clients retry elsewhere, while those in flight go on. Health stays open."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.closed = False

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or (handler_call_details.method or "").startswith("/grpc.health.v1.Health/"):
            return handler

        @asynccontextmanager
        async def counted(request, context):
            if self.closed:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
            self.in_flight += 1
            try:
                yield
            finally:
                self.in_flight -= 1

        return _guarded(handler, counted)

    async def drain(self, timeout_seconds: float) -> bool:
        """Closes the gate and waits up to timeout_seconds for the calls in flight to end."""
        self.closed = True
        deadline = time.monotonic() + timeout_seconds
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.in_flight == 0


class RunningServer:
    """A started server and its health state."""

    def __init__(self, config: ServerConfig, service_names: Sequence[str]) -> None:
        self.config = config
        self.service_names = list(service_names)
        self.health = health.aio.HealthServicer()
        self._servers: list[grpc.aio.Server] = []  # the service port's
        self._health_servers: list[grpc.aio.Server] = []  # the plaintext health port's
        self.port = 0
        self.health_port: int | None = None
        self.metrics_port: int | None = None  # the Prometheus endpoint's, once one is started
        self._stop_requested = asyncio.Event()
        self._catching_signals = False
        self._starting: asyncio.Task | None = None  # cancelled by a signal until the server is up

    async def start_health(self) -> None:
        """Health first, NOT_SERVING, so probes answer while the model loads. A port in use fails
        here, before a model loads or the pools are waited for."""
        check_port_free(self.config.host, self.config.port)
        if self.config.health_port is not None:
            check_port_free(self.config.host, self.config.health_port)
        for name in ("", *self.service_names):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        if self.config.health_port is None:
            return
        server = grpc.aio.server(options=server_options(64 * 1024))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        self.health_port = _bind(server, self.config.host, self.config.health_port)
        await server.start()
        self._health_servers.append(server)

    async def start(self, register: Callable[[grpc.aio.Server], None]) -> None:
        """Starts the service port with the servicers register() adds, then reports SERVING."""
        server = grpc.aio.server(
            interceptors=[*self.config.interceptors, *server_interceptors(), MalformedRequestInterceptor(),
                          ErrorMappingInterceptor()],
            options=server_options(self.config.max_message_bytes),
        )
        register(server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            [*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server
        )
        credentials = self.config.tls.server_credentials() if self.config.tls is not None else None
        self.port = _bind(server, self.config.host, self.config.port, credentials)
        await server.start()
        self._servers.append(server)
        await self.set_serving(True)

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    async def stop(self, drain: Callable[[float], Awaitable[object]] | None = None) -> None:
        """NOT_SERVING first (probes and routers stop sending new work), then drain(seconds) while
        the port still serves existing sessions, then stop: in-flight calls get the rest of the
        grace, new calls are refused. The health port answers (NOT_SERVING) until the end."""
        deadline = time.monotonic() + self.config.grace_seconds
        await self.set_serving(False)
        if drain is not None:
            await drain(self.config.grace_seconds)
        left = max(0.0, deadline - time.monotonic())
        await asyncio.gather(*(s.stop(left) for s in self._servers))
        await asyncio.gather(*(s.stop(0) for s in self._health_servers))

    def catch_signals(self, cancel_start: bool = True) -> None:
        """From now on SIGTERM and SIGINT ask for a graceful stop. Call it first thing in a server
        process: a signal that lands before the handler is installed (say, between the READY line
        and wait_for_signal) kills the process outright. cancel_start: a signal that comes before
        wait_for_signal cancels the calling task (a start waiting for its pools stops at once:
        asyncio.run raises CancelledError); else the stop waits until the start is done. The
        handlers replace SIG_IGN, so a background job (SIGINT ignored) stops on Ctrl-C too."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        self._catching_signals = True
        self._starting = asyncio.current_task() if cancel_start else None

    def _on_signal(self, sig: signal.Signals) -> None:
        self._stop_requested.set()
        if self._starting is not None:
            log.info("%s while starting: stopping", sig.name)
            self._starting.cancel()
            self._starting = None

    async def wait_for_signal(self, drain: Callable[[float], Awaitable[object]] | None = None) -> None:
        """Blocks until SIGTERM or SIGINT (at once if one came earlier), then stops gracefully."""
        if not self._catching_signals:
            self.catch_signals()
        self._starting = None  # started: a signal now drains and stops
        await self._stop_requested.wait()
        log.info("signal received: draining for up to %.0f s", self.config.grace_seconds)
        await self.stop(drain)


def ready_metrics(running: RunningServer) -> str:
    """The READY line's metrics field (" metrics=PORT"), empty without a metrics endpoint."""
    return "" if running.metrics_port is None else f" metrics={running.metrics_port}"


async def serve_model_until_signal(
    role: str,
    service_name: str,
    server_config: ServerConfig,
    load: Callable[[], Any],
    start: Callable[[Any, RunningServer], Awaitable[Any]],
) -> None:
    """The life of a model service process: health up (NOT_SERVING) while load() runs on the
    model thread (specdec.worker), start(loaded, running) -> service opens the service port, a
    READY line is printed, and on SIGTERM / SIGINT the service drains (no new sessions; existing
    ones finish), the server stops, and the service's worker and expiry stop."""
    running = RunningServer(server_config, [service_name])
    # A SIGTERM while the model loads stops the process cleanly after the load (a thread that
    # cannot be interrupted).
    running.catch_signals(cancel_start=False)
    await running.start_health()
    loaded = await run_on_model_thread(load)  # the thread that will run its forward passes
    service = await start(loaded, running)
    expiry = asyncio.create_task(service.expire_forever())
    print(f"READY {role} {server_config.host}:{running.port} health={running.health_port} "
          f"model={loaded.model_id} vocab={loaded.vocab_size}{ready_metrics(running)}", flush=True)
    try:
        await running.wait_for_signal(service.drain)
    finally:
        expiry.cancel()
        service.worker.shutdown()
