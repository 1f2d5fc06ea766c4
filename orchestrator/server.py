"""Starts the orchestrator: the pools and the pair check, then the public API."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import TYPE_CHECKING

from orchestrator.recovery import wait_for_releases
from orchestrator.service import OrchestratorConfig, OrchestratorService
from orchestrator.servicer import OrchestratorServicer
from specdec.metrics import serve_registry
from specdec.rpc.auth import BearerTokenInterceptor
from specdec.rpc.server import CallGate, RunningServer, ServerConfig, check_port_free, ready_metrics
from specdec.v1 import orchestrator_pb2, orchestrator_pb2_grpc

if TYPE_CHECKING:
    from orchestrator.http_api import HttpConfig

log = logging.getLogger(__name__)
SERVICE_NAME = orchestrator_pb2.DESCRIPTOR.services_by_name["Orchestrator"].full_name


async def start(
    config: OrchestratorConfig, server_config: ServerConfig, running: RunningServer | None = None
) -> tuple[RunningServer, OrchestratorService]:
    if running is None:
        running = RunningServer(server_config, [SERVICE_NAME])
        await running.start_health()
    service = OrchestratorService(config)
    await service.start()
    # Bearer tokens, if the API asks for them: a request's token names its partition of shared state.
    tokens = next((i.tokens for i in server_config.interceptors if isinstance(i, BearerTokenInterceptor)), None)
    servicer = OrchestratorServicer(service, tokens)
    await running.start(lambda server: orchestrator_pb2_grpc.add_OrchestratorServicer_to_server(servicer, server))
    return running, service


async def serve(config: OrchestratorConfig, server_config: ServerConfig,
                metrics_port: int | None = None, http: HttpConfig | None = None) -> None:
    """On SIGTERM: NOT_SERVING, new requests refused with UNAVAILABLE, the streams in flight run
    to their end (up to the grace), their Releases land, then the process exits. metrics_port:
    serve Prometheus metrics there (0: a free port, named in the READY line). http: also serve
    the OpenAI-compatible HTTP API (orchestrator/http_api.py), drained together with gRPC (503
    for new requests) and named in the READY line."""
    gate = CallGate()
    server_config = dataclasses.replace(server_config, interceptors=(*server_config.interceptors, gate))
    running = RunningServer(server_config, [SERVICE_NAME])
    running.catch_signals()
    await running.start_health()
    if http is not None:
        check_port_free(http.host, http.port)  # before the wait for the pools
    running, service = await start(config, server_config, running)
    http_api = None
    if http is not None:
        from orchestrator.http_api import HttpApi

        http_api = HttpApi(service, http)
        await http_api.start()

    async def drain(seconds: float) -> None:  # both front doors at once
        await asyncio.gather(gate.drain(seconds), *([http_api.drain(seconds)] if http_api else []))
    if metrics_port is not None:
        running.metrics_port = serve_registry(metrics_port, server_config.host, service.telemetry.registry)
        log.info("metrics on http://%s:%d/metrics", server_config.host, running.metrics_port)
    print(f"READY orchestrator {server_config.host}:{running.port} health={running.health_port} "
          f"draft={config.draft} target={config.target}{ready_metrics(running)}"
          f"{f' http={http_api.url}' if http_api else ''}", flush=True)
    try:
        await running.wait_for_signal(drain)
    finally:
        if http_api is not None:
            await http_api.stop()
        # Streams that ended during the drain sent their Releases; let them land first.
        await wait_for_releases(server_config.grace_seconds)
        await service.close()
