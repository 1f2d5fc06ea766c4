"""Starts the draft service: health first, then the model, then the service port."""

from __future__ import annotations

import logging

from specdec.metrics import start_metrics_server
from specdec.models import LoadedModel, ModelConfig
from specdec.rpc.server import RunningServer, ServerConfig, serve_model_until_signal
from specdec.serving import ServiceConfig
from specdec.v1 import draft_pb2, draft_pb2_grpc
from specdec.warmup import load_warm
from draft_service.lookup_service import LookupDraftConfig, LookupDraftService, load_vocabulary
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


async def start_lookup(
    vocabulary: LoadedModel, service_config: ServiceConfig, server_config: ServerConfig,
    running: RunningServer | None = None, lookup: LookupDraftConfig = LookupDraftConfig(),
) -> tuple[RunningServer, LookupDraftService]:
    """Serves a lookup draft (no model) in the target's vocabulary (tests use this directly)."""
    if running is None:
        running = RunningServer(server_config, [SERVICE_NAME])
        await running.start_health()
    service = LookupDraftService(vocabulary, service_config, lookup)
    servicer = DraftServicer(service)  # the same RPCs: Prefill, Propose, Release, Info
    await running.start(lambda server: draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, server))
    return running, service


async def serve(
    model_config: ModelConfig, service_config: ServiceConfig, server_config: ServerConfig,
    metrics_port: int | None = None,
    draft_config: DraftConfig = DraftConfig(),
    lookup: LookupDraftConfig | None = None,
) -> None:
    """lookup: serve that lookup instead of a model (model_config.model then names the target,
    whose vocabulary it speaks)."""
    async def start_loaded(loaded: LoadedModel, running: RunningServer) -> DraftService | LookupDraftService:
        if lookup is None:
            service = (await start(loaded, service_config, server_config, running, draft_config))[1]
        else:
            service = (await start_lookup(loaded, service_config, server_config, running, lookup))[1]
        if metrics_port is not None:
            running.metrics_port = start_metrics_server(metrics_port, server_config.host,
                                                        service.info, service.worker)
            log.info("metrics on http://%s:%d/metrics", server_config.host, running.metrics_port)
        return service

    def load() -> LoadedModel:
        if lookup is None:
            return load_warm(model_config, service_config.max_num_speculative_tokens)
        return load_vocabulary(model_config.model, model_config.max_context)

    await serve_model_until_signal("draft", SERVICE_NAME, server_config, load, start_loaded)
