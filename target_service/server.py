"""Starts the target service: health first, then the model, then the service port."""

from __future__ import annotations

import logging

from specdec.metrics import start_metrics_server
from specdec.models import LoadedModel, ModelConfig
from specdec.rpc.server import RunningServer, ServerConfig, serve_model_until_signal
from specdec.serving import ServiceConfig
from specdec.v1 import target_pb2, target_pb2_grpc
from specdec.warmup import load_warm
from target_service.service import TargetService
from target_service.servicer import TargetServicer

log = logging.getLogger(__name__)
SERVICE_NAME = target_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name


async def start(
    loaded: LoadedModel, service_config: ServiceConfig, server_config: ServerConfig,
    running: RunningServer | None = None,
) -> tuple[RunningServer, TargetService]:
    """Serves an already loaded model (tests use this directly, on port 0)."""
    if running is None:
        running = RunningServer(server_config, [SERVICE_NAME])
        await running.start_health()
    service = TargetService(loaded, service_config)
    servicer = TargetServicer(service)
    await running.start(lambda server: target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, server))
    return running, service


async def serve(
    model_config: ModelConfig, service_config: ServiceConfig, server_config: ServerConfig,
    metrics_port: int | None = None,
) -> None:
    async def start_loaded(loaded: LoadedModel, running: RunningServer) -> TargetService:
        service = (await start(loaded, service_config, server_config, running))[1]
        if metrics_port is not None:
            running.metrics_port = start_metrics_server(metrics_port, server_config.host,
                                                        service.info, service.worker)
            log.info("metrics on http://%s:%d/metrics", server_config.host, running.metrics_port)
        return service

    await serve_model_until_signal(
        "target", SERVICE_NAME, server_config,
        lambda: load_warm(model_config, service_config.max_num_speculative_tokens), start_loaded,
    )
