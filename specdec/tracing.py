"""OpenTelemetry traces across the three services.

Off unless the standard environment asks for it (configure_tracing): OTEL_TRACES_EXPORTER (otlp,
console or none), or an OTLP endpoint (OTEL_EXPORTER_OTLP_ENDPOINT,
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT); OTEL_SDK_DISABLED=true turns it off whatever else is set.
The OTLP exporter reads the rest of OTEL_EXPORTER_OTLP_* itself (headers, certificates,
timeout, compression), the SDK reads OTEL_TRACES_SAMPLER*, OTEL_BSP_*, OTEL_SERVICE_NAME and
OTEL_RESOURCE_ATTRIBUTES, and OTEL_PROPAGATORS picks the propagators (W3C trace context and
baggage by default).

The trace context crosses each hop in gRPC metadata (`traceparent`): ClientTracingInterceptor
opens a CLIENT span per call made inside a traced request and injects the context;
ServerTracingInterceptor extracts it and opens the SERVER span the handler runs in. Both are
installed only when a TracerProvider has been set (tracing_enabled), so an untraced process pays
nothing per call; the SDK and the exporter are imported only when tracing is configured. The
orchestrator's request and round spans are in orchestrator/telemetry.py.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from contextlib import asynccontextmanager
from typing import Any

import grpc

from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

log = logging.getLogger(__name__)

INSTRUMENTATION = "specdec"
# Calls that are not part of a request: probes (Info every 2 s per replica), the orchestrator's
# one tokenizer fetch at start, health, reflection.
UNTRACED_METHODS = ("/grpc.health.v1.Health/", "/grpc.reflection.")
UNTRACED_SUFFIXES = ("/Info", "/GetTokenizer")
# Reply fields of Prefill / Propose / Verify copied onto the CLIENT span.
TIMING_FIELDS = ("compute_seconds", "queue_seconds", "pass_rows", "pass_sessions")

_provider: Any = None  # the TracerProvider configure_tracing installed, for shutdown_tracing


_TRACER = trace.get_tracer(INSTRUMENTATION)  # a proxy: the provider set later is the one used


def tracer() -> trace.Tracer:
    """This package's tracer (a no-op one until a TracerProvider is set)."""
    return _TRACER


def tracing_enabled() -> bool:
    """Whether a real TracerProvider is installed (by configure_tracing, or by a test)."""
    return not isinstance(trace.get_tracer_provider(),
                          (trace.ProxyTracerProvider, trace.NoOpTracerProvider))


def _wanted_exporters(env: Mapping[str, str]) -> list[str]:
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    named = [name.strip().lower() for name in env.get("OTEL_TRACES_EXPORTER", "").split(",")
             if name.strip()]
    if named:
        return [name for name in named if name != "none"]
    if env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return ["otlp"]
    return []


def _otlp_exporter(env: Mapping[str, str]):
    protocol = (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                or "grpc").strip().lower()
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    if protocol == "http/protobuf":
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError as error:
            raise ValueError("OTLP over http/protobuf needs the opentelemetry-exporter-otlp-proto-http "
                             "package (pip install it, or set OTEL_EXPORTER_OTLP_PROTOCOL=grpc)") from error
        return OTLPSpanExporter()
    raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r} is not supported: use grpc or http/protobuf")


def configure_tracing(service_name: str, env: Mapping[str, str] | None = None) -> bool:
    """Installs a TracerProvider exporting this process's spans if the environment asks for it
    (see the module's docstring); returns whether it did. service_name ("specdec-target", ...)
    is the resource's service.name unless OTEL_SERVICE_NAME or OTEL_RESOURCE_ATTRIBUTES name one.
    Raises ValueError for a setting it cannot honour."""
    global _provider
    env = os.environ if env is None else env
    exporters = _wanted_exporters(env)
    if not exporters:
        return False
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: service_name}))
    provider = TracerProvider(resource=resource)
    for name in exporters:
        if name == "otlp":
            provider.add_span_processor(BatchSpanProcessor(_otlp_exporter(env)))
        elif name == "console":
            provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
        else:
            raise ValueError(f"OTEL_TRACES_EXPORTER={name!r} is not supported: use otlp, console or none")
    trace.set_tracer_provider(provider)
    _provider = provider
    log.info("tracing on: %s spans exported as %s", ", ".join(exporters),
             resource.attributes.get(SERVICE_NAME))
    return True


def shutdown_tracing() -> None:
    """Flushes and stops what configure_tracing installed (at process exit)."""
    global _provider
    if _provider is not None:
        _provider.shutdown()
        _provider = None


def _traced(method: str) -> bool:
    return not (method.startswith(UNTRACED_METHODS) or method.endswith(UNTRACED_SUFFIXES))


def _rpc_attributes(method: str) -> dict[str, str]:
    service, _, name = method.lstrip("/").partition("/")
    return {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name}


class ServerTracingInterceptor(grpc.aio.ServerInterceptor):
    """A SERVER span around every call but probes, a child of the caller's span when its
    metadata carries a trace context."""

    async def intercept_service(self, continuation, handler_call_details):
        from specdec.rpc.server import _guarded  # the one way handlers are wrapped

        handler = await continuation(handler_call_details)
        method = handler_call_details.method or ""
        if handler is None or not _traced(method):
            return handler
        carrier = {item.key: item.value for item in (handler_call_details.invocation_metadata or ())
                   if isinstance(item.value, str)}
        parent = propagate.extract(carrier)

        @asynccontextmanager
        async def span(request, context):
            with tracer().start_as_current_span(method.lstrip("/"), context=parent, kind=SpanKind.SERVER,
                                                attributes=_rpc_attributes(method)):
                yield

        return _guarded(handler, span)


class ClientTracingInterceptor(grpc.aio.UnaryUnaryClientInterceptor):
    """A CLIENT span per call made inside a trace (a request's hop to a replica), with
    the trace context injected into the call's metadata and the replica's reported compute and
    queue time (and so the network time) on the span. Calls outside a request (pool probes) pass
    through untouched."""

    def __init__(self, address: str) -> None:
        self.address = address

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        method = client_call_details.method
        method = method.decode() if isinstance(method, bytes) else str(method)
        if not trace.get_current_span().get_span_context().is_valid or not _traced(method):
            return await continuation(client_call_details, request)
        attributes = {**_rpc_attributes(method), "server.address": self.address}
        with tracer().start_as_current_span(method.lstrip("/"), kind=SpanKind.CLIENT,
                                            attributes=attributes) as span:
            carrier: dict[str, str] = {}
            propagate.inject(carrier)
            metadata = grpc.aio.Metadata(*(client_call_details.metadata or ()))
            for key, value in carrier.items():
                metadata.add(key, value)
            details = client_call_details._replace(metadata=metadata)
            started = time.perf_counter()
            call = await continuation(details, request)
            try:
                response = await call
            except grpc.aio.AioRpcError as error:
                span.set_attribute("rpc.grpc.status_code", error.code().value[0])
                span.set_status(Status(StatusCode.ERROR, f"{error.code().name}: {error.details()}"))
                return call  # the caller awaits it and gets the error
            wall = time.perf_counter() - started
            span.set_attribute("rpc.grpc.status_code", 0)
            timing = {name: float(getattr(response, name)) for name in TIMING_FIELDS
                      if hasattr(response, name)}
            if timing:
                span.set_attributes({f"specdec.{name}": value for name, value in timing.items()})
                span.set_attribute("specdec.network_seconds", max(
                    0.0, wall - timing.get("compute_seconds", 0.0) - timing.get("queue_seconds", 0.0)))
            return call


def server_interceptors() -> tuple[grpc.aio.ServerInterceptor, ...]:
    """What a server adds when tracing is on."""
    return (ServerTracingInterceptor(),) if tracing_enabled() else ()


def client_interceptors(address: str) -> list[grpc.aio.ClientInterceptor]:
    """What a channel to address adds when tracing is on."""
    return [ClientTracingInterceptor(address)] if tracing_enabled() else []
