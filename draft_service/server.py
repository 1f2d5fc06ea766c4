"""Starts the draft service: health first, then the model, then the service port."""

from __future__ import annotations

import logging

from specdec.metrics import start_metrics_server
from specdec.models import LoadedModel, ModelConfig, load_model
from specdec.rpc.server import RunningServer, ServerConfig, serve_model_until_signal
from specdec.serving import ServiceConfig
from specdec.v1 import draft_pb2, draft_pb2_grpc
from draft_service.service import DraftConfig, DraftService
from draft_service.servicer import DraftServicer

log = logging.getLogger(__name__)
SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name


async def start(
    loaded: LoadedModel, service_config: ServiceConfig, server_config: ServerConfig,
    running: RunningServer | None = None, draft_config: DraftConfig = DraftConfig(),
) -> tuple[RunningServer, DraftService]:
    """Serves an already loaded model (tests use this directly, on port 0)."""
    if running is None:
        running = RunningServer(server_config, [SERVICE_NAME])
        await running.start_health()
    service = DraftService(loaded, service_config, draft_config)
    servicer = DraftServicer(service)
    await running.start(lambda server: draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, server))
    return running, service


async def serve(
    model_config: ModelConfig, service_config: ServiceConfig, server_config: ServerConfig,
    metrics_port: int | None = None,
    draft_config: DraftConfig = DraftConfig(),
) -> None:
    async def start_loaded(loaded: LoadedModel, running: RunningServer) -> DraftService:
        service = (await start(loaded, service_config, server_config, running, draft_config))[1]
        if metrics_port is not None:
            running.metrics_port = start_metrics_server(metrics_port, server_config.host,
                                                        service.info, service.worker)
            log.info("metrics on http://%s:%d/metrics", server_config.host, running.metrics_port)
        return service

    await serve_model_until_signal(
        "draft", SERVICE_NAME, server_config, lambda: load_model(model_config), start_loaded
    )
