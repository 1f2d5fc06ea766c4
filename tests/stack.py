"""The three real services in one process, on ephemeral loopback ports (for service tests)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

import draft_service.server
import orchestrator.server
import target_service.server
from draft_service.service import DraftConfig
from orchestrator.pool import PoolConfig
from orchestrator.service import OrchestratorConfig
from specdec.models import ModelConfig, load_model
from specdec.rpc.server import RunningServer, ServerConfig
from specdec.serving import ServiceConfig
from specdec.sessions import SessionBudget
from specdec.v1 import orchestrator_pb2 as pb
from specdec.v1 import orchestrator_pb2_grpc


@dataclass
class Stack:
    target: Any  # TargetService
    draft: Any  # DraftService
    orchestrator: Any  # OrchestratorService
    servers: list[RunningServer] = field(default_factory=list)

    @property
    def target_address(self) -> str:
        return f"127.0.0.1:{self.servers[0].port}"

    @property
    def draft_address(self) -> str:
        return f"127.0.0.1:{self.servers[1].port}"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.servers[2].port}"

    async def stop(self) -> None:
        await self.orchestrator.close()
        for server in reversed(self.servers):
            await server.stop()


async def start_target(
    model_dir: Path, replica_id: str = "target-0", interceptors: tuple = (), draft_head: str = "auto", **service
) -> tuple[RunningServer, Any]:
    loaded = load_model(ModelConfig(str(model_dir), "target", dtype="float64", draft_head=draft_head))
    return await target_service.server.start(
        loaded, ServiceConfig(replica_id=replica_id, **service),
        ServerConfig(port=0, interceptors=interceptors),
    )


async def start_draft(
    model_dir: Path, replica_id: str = "draft-0", top_m: int = 64, interceptors: tuple = (), **service
) -> tuple[RunningServer, Any]:
    loaded = load_model(ModelConfig(str(model_dir), "draft", dtype="float64"))
    return await draft_service.server.start(
        loaded, ServiceConfig(replica_id=replica_id, **service),
        ServerConfig(port=0, interceptors=interceptors), draft_config=DraftConfig(top_m=top_m),
    )


async def start_stack(
    target_dir: Path, draft_dir: Path, num_speculative_tokens: int = 4, top_m: int = 64,
    budget: SessionBudget = SessionBudget(), interceptors: tuple = (),
) -> Stack:
    target_server, target = await start_target(target_dir, budget=budget, interceptors=interceptors)
    draft_server, draft = await start_draft(draft_dir, top_m=top_m, budget=budget, interceptors=interceptors)
    config = OrchestratorConfig(
        draft=f"127.0.0.1:{draft_server.port}",
        target=f"127.0.0.1:{target_server.port}",
        num_speculative_tokens=num_speculative_tokens,
        pool=PoolConfig(refresh_seconds=0.5),
        startup_timeout_seconds=30,
    )
    orchestrator_server, service = await orchestrator.server.start(config, ServerConfig(port=0))
    return Stack(target, draft, service, [target_server, draft_server, orchestrator_server])


def generate(address: str, request: pb.GenerateRequest, timeout: float = 300) -> tuple[list[int], str, pb.GenerateResponse]:
    """Calls Generate with a sync client; returns (token ids, text, last response)."""
    with grpc.insecure_channel(address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        token_ids: list[int] = []
        text = ""
        last = None
        for response in stub.Generate(request, timeout=timeout):
            token_ids.extend(response.token_ids)
            text += response.text
            last = response
    assert last is not None
    return token_ids, text, last


class PassSizes:
    """Records the sessions of every forward pass a service's worker runs while in a with block
    (the worker's observer; the previous one is put back after)."""

    def __init__(self, service) -> None:
        self._worker = service.worker
        self.sessions: list[int] = []

    def pass_ran(self, rows: int, sessions: int, seconds: float) -> None:
        self.sessions.append(sessions)

    def call_started(self, queue_seconds: float) -> None:
        pass

    def __enter__(self) -> "PassSizes":
        self._previous, self._worker.observer = self._worker.observer, self
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._worker.observer = self._previous


class SlowPasses(PassSizes):
    """Each forward pass of a service's worker takes `seconds` longer while in a with block, as on a
    slower device (its observer sleeps on the model thread after the pass): what overlapping
    the draft with the target needs to show on a tiny model, whose own passes take microseconds."""

    def __init__(self, service, seconds: float) -> None:
        super().__init__(service)
        self.seconds = seconds

    def pass_ran(self, rows: int, sessions: int, seconds: float) -> None:
        super().pass_ran(rows, sessions, seconds)
        time.sleep(self.seconds)


@contextmanager
def auto_pipelining_as_on_separate_hardware(orchestrator_service: Any) -> Iterator[None]:
    """Pipelining auto as though the draft computed on hardware of its own: it holds off where
    the draft shares the target's CPUs, as every test's services do on one machine; what such a
    test exercises is what auto does where it does not hold off."""
    saved = orchestrator_service.hold_auto_pipelining_on_shared_compute
    orchestrator_service.hold_auto_pipelining_on_shared_compute = False
    try:
        yield
    finally:
        orchestrator_service.hold_auto_pipelining_on_shared_compute = saved
