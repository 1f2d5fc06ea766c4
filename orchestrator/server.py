"""Starts the orchestrator: the pools and the pair check, then the public API."""

from __future__ import annotations

import dataclasses

from orchestrator.recovery import wait_for_releases
from orchestrator.service import OrchestratorConfig, OrchestratorService
from orchestrator.servicer import OrchestratorServicer
from specdec.rpc.server import CallGate, RunningServer, ServerConfig
from specdec.v1 import orchestrator_pb2, orchestrator_pb2_grpc

SERVICE_NAME = orchestrator_pb2.DESCRIPTOR.services_by_name["Orchestrator"].full_name


async def start(
    config: OrchestratorConfig, server_config: ServerConfig, running: RunningServer | None = None
) -> tuple[RunningServer, OrchestratorService]:
    if running is None:
        running = RunningServer(server_config, [SERVICE_NAME])
        await running.start_health()
    service = OrchestratorService(config)
    await service.start()
    servicer = OrchestratorServicer(service)
    await running.start(lambda server: orchestrator_pb2_grpc.add_OrchestratorServicer_to_server(servicer, server))
    return running, service


async def serve(config: OrchestratorConfig, server_config: ServerConfig) -> None:
    """On SIGTERM: NOT_SERVING, new requests refused with UNAVAILABLE, the streams in flight run
    to their end (up to the grace), their Releases land, then the process exits."""
    gate = CallGate()
    server_config = dataclasses.replace(server_config, interceptors=(*server_config.interceptors, gate))
    running = RunningServer(server_config, [SERVICE_NAME])
    running.catch_signals()
    await running.start_health()
    running, service = await start(config, server_config, running)
    print(f"READY orchestrator {server_config.host}:{running.port} health={running.health_port} "
          f"draft={config.draft} target={config.target}", flush=True)
    try:
        await running.wait_for_signal(gate.drain)
    finally:
        # Streams that ended during the drain sent their Releases; let them land first.
        await wait_for_releases(server_config.grace_seconds)
        await service.close()
