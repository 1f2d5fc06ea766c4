"""A pool of draft or target replicas: discovery, health, compatibility, placement.

A session sticks to the replicas that hold its caches; new sessions go to the least-loaded healthy
replica that takes new sessions.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from orchestrator.clients import DraftClient, RpcTimeouts, TargetClient, open_channel
from orchestrator.discovery import Endpoint, ReplicaSource
from specdec.errors import IncompatibleModels
from specdec.rpc.server import DEFAULT_MAX_MESSAGE_BYTES, TlsConfig
from specdec.v1 import common_pb2

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolConfig:
    refresh_seconds: float = 2.0  # how often replicas are re-discovered and asked for Info
    tls: TlsConfig | None = None
    timeouts: RpcTimeouts = RpcTimeouts()
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES

    def __post_init__(self) -> None:
        if not self.refresh_seconds > 0:
            raise ValueError("refresh_seconds must be > 0")


@dataclass
class Replica:
    address: str
    client: TargetClient | DraftClient
    replica_id: str = ""
    info: common_pb2.InfoResponse | None = None
    healthy: bool = False
    accepting: bool = True
    active_sessions: int = 0  # sessions this orchestrator has placed here
    refused: str = ""  # why it is kept out (incompatible model), if it is
    failures: int = field(default=0)

    @property
    def usable(self) -> bool:
        return self.healthy and self.accepting and not self.refused


class ReplicaPool:
    def __init__(
        self,
        role: str,
        source: ReplicaSource,
        config: PoolConfig = PoolConfig(),
        check: Callable[[common_pb2.InfoResponse], None] | None = None,
    ) -> None:
        if role not in ("draft", "target"):
            raise ValueError(f"role must be draft or target, got {role!r}")
        self.role = role
        self.source = source
        self.config = config
        self.check = check
        self.replicas: dict[str, Replica] = {}  # by address
        self._task: asyncio.Task[None] | None = None

    def _client(self, address: str) -> TargetClient | DraftClient:
        channel = open_channel(address, self.config.tls, self.config.max_message_bytes)
        kind = TargetClient if self.role == "target" else DraftClient
        return kind(channel, self.config.timeouts)

    async def refresh(self) -> None:
        """Re-discovers replicas and asks each for Info (health, identity, load)."""
        try:
            endpoints = await self.source.endpoints()
        except Exception as error:  # keep the replicas we know when discovery hiccups
            log.warning("%s pool: discovery failed (%s); keeping %d known replicas",
                        self.role, error, len(self.replicas))
            endpoints = [Endpoint(a, r.accepting) for a, r in self.replicas.items()]
        seen = {e.address: e for e in endpoints}
        for address in list(self.replicas):
            if address not in seen:
                replica = self.replicas.pop(address)
                log.info("%s replica %s left the pool", self.role, address)
                await replica.client.channel.close()
        for endpoint in endpoints:
            replica = self.replicas.get(endpoint.address)
            if replica is None:
                replica = Replica(endpoint.address, self._client(endpoint.address))
                self.replicas[endpoint.address] = replica
                log.info("%s replica %s joined the pool", self.role, endpoint.address)
            replica.accepting = endpoint.ready
        await asyncio.gather(*(self._probe(r) for r in list(self.replicas.values())))

    async def _probe(self, replica: Replica) -> None:
        try:
            info = await replica.client.info()
        except grpc.aio.AioRpcError as error:
            if replica.healthy:
                log.warning("%s replica %s unhealthy: %s", self.role, replica.address, error.code().name)
            replica.healthy = False
            return
        if self.check is not None and not replica.refused:
            try:
                self.check(info)
            except IncompatibleModels as error:
                replica.refused = str(error)
                log.error("%s replica %s refused: %s", self.role, replica.address, error)
        replica.info = info
        replica.replica_id = info.replica_id
        replica.healthy = True
        replica.failures = 0

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._refresh_forever())

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.refresh_seconds)
            try:
                await self.refresh()
            except Exception:  # never let the watcher die
                log.exception("%s pool refresh failed", self.role)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for replica in self.replicas.values():
            await replica.client.channel.close()

    def pick(self, exclude: frozenset[str] = frozenset()) -> Replica | None:
        """The least-loaded usable replica, not in exclude (addresses)."""
        candidates = [r for r in self.replicas.values() if r.usable and r.address not in exclude]
        if not candidates:
            return None
        return min(candidates, key=lambda r: (r.active_sessions, r.info.load if r.info else 0.0))

    def by_replica_id(self, replica_id: str) -> Replica | None:
        return next((r for r in self.replicas.values() if r.replica_id == replica_id), None)

    def mark_failed(self, replica: Replica) -> None:
        """A call failed with UNAVAILABLE or a deadline: no new sessions until a probe answers."""
        replica.failures += 1
        replica.healthy = False

    def usable_count(self) -> int:
        return sum(r.usable for r in self.replicas.values())
