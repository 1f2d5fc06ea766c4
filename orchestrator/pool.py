"""A pool of draft or target replicas: discovery, health, compatibility, placement.

A session sticks to the replicas that hold its caches; new sessions go to the usable replica with
the fewest sessions. Every refresh re-reads the replica source (orchestrator/discovery.py) and asks
each replica for Info, which also checks its model against the pair, so a replica that joins late
is checked before it gets a session. A replica the source stops listing leaves the pool: it gets
no new sessions, and each of its sessions fails over at its next call (UNAVAILABLE, which the
generation loop answers by re-prefilling the committed tokens on another replica).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import grpc

from orchestrator.clients import DraftClient, RpcTimeouts, TargetClient, open_channel
from orchestrator.discovery import Endpoint, ReplicaSource
from specdec.errors import IncompatibleModels, ReplicaError
from specdec.protocol import ReplicaInfo
from specdec.rpc.server import DEFAULT_MAX_MESSAGE_BYTES, TlsConfig

Client = TypeVar("Client", TargetClient, DraftClient)

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
class Replica(Generic[Client]):
    address: str
    client: Client
    replica_id: str = ""
    info: ReplicaInfo | None = None
    healthy: bool = False
    accepting: bool = True  # False: draining (terminating); keeps its sessions, takes no new ones
    active_sessions: int = 0  # sessions this orchestrator holds here: changed only by a Lease
    refused: str = ""  # why it is kept out (incompatible model), if it is
    failures: int = 0
    picks_since_probe: int = 0  # placements started since the last Info, not yet in its live_sessions
    left: bool = False  # the source no longer lists it
    probe: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def usable(self) -> bool:
        return self.healthy and self.accepting and not self.refused and not self.left

    @property
    def expected_sessions(self) -> int:
        """Sessions on it from every orchestrator as of its last Info, plus ours placed since."""
        reported = self.info.live_sessions if self.info is not None else 0
        return max(self.active_sessions, reported + self.picks_since_probe)


class Lease(Generic[Client]):
    """One session's hold on a replica. It counts in replica.active_sessions (what placement and
    draining go by) from the moment the pool hands it out until end(), which may be called more
    than once."""

    def __init__(self, replica: Replica[Client]) -> None:
        self.replica = replica
        self.ended = False
        replica.active_sessions += 1

    @property
    def client(self) -> Client:
        return self.replica.client

    def end(self) -> None:
        if not self.ended:
            self.ended = True
            self.replica.active_sessions -= 1


class ReplicaPool(Generic[Client]):
    def __init__(
        self,
        client_type: type[Client],
        source: ReplicaSource,
        config: PoolConfig = PoolConfig(),
        check: Callable[[ReplicaInfo], None] | None = None,
    ) -> None:
        self.client_type = client_type
        self.role: str = client_type.role
        self.source = source
        self.config = config
        self.check = check
        self.replicas: dict[str, Replica[Client]] = {}  # by address
        self._departed: list[tuple[Replica[Client], grpc.aio.Channel, float]] = []  # (replica, channel, left at)
        self._closing: dict[asyncio.Task[None], grpc.aio.Channel] = {}
        self._discovery_error = ""
        self._task: asyncio.Task[None] | None = None

    def _client(self, address: str, channel) -> Client:
        return self.client_type(address, channel, self.config.timeouts)

    async def refresh(self) -> None:
        """Re-discovers replicas and asks each for Info (health, identity, load). Waits up to
        refresh_seconds for the answers; a slower probe goes on in the background, so one stalled
        replica holds up neither discovery nor the rest of the pool."""
        try:
            endpoints = await self.source.endpoints()
        except Exception as error:  # keep the replicas we know when discovery hiccups
            if str(error) != self._discovery_error:
                log.warning("%s pool: discovery failed (%s); keeping %d known replicas",
                            self.role, error, len(self.replicas))
            self._discovery_error = str(error)
        else:
            if self._discovery_error:
                log.info("%s pool: discovery works again", self.role)
            self._discovery_error = ""
            self._sync(endpoints)
        self._close_departed()
        probes = [self._start_probe(replica) for replica in self.replicas.values()]
        if probes:
            await asyncio.wait(probes, timeout=self.config.refresh_seconds)

    def _sync(self, endpoints: list[Endpoint]) -> None:
        seen = {endpoint.address: endpoint for endpoint in endpoints}
        for address in [a for a in self.replicas if a not in seen]:
            self._depart(self.replicas.pop(address))
        for endpoint in seen.values():
            replica = self.replicas.get(endpoint.address)
            if replica is None:
                channel = open_channel(endpoint.address, self.config.tls, self.config.max_message_bytes)
                replica = Replica(endpoint.address, self._client(endpoint.address, channel),
                                  accepting=endpoint.ready)
                self.replicas[endpoint.address] = replica
                log.info("%s replica %s found: asking it for Info", self.role, endpoint.address)
            elif replica.accepting != endpoint.ready:
                log.info("%s replica %s %s", self.role, endpoint.address, "takes new sessions again"
                         if endpoint.ready else "is draining: keeps its sessions, takes no new ones")
            replica.accepting = endpoint.ready

    def _depart(self, replica: Replica[Client]) -> None:
        """The replica's sessions move at their next call; its channel stays open for calls
        already in flight and for Releases, and is closed once none of our sessions is left there."""
        log.info("%s replica %s left the pool; its %d sessions move to other replicas",
                 self.role, replica.address, replica.active_sessions)
        if replica.probe is not None:
            replica.probe.cancel()
        channel = replica.client.channel
        replica.left, replica.accepting, replica.healthy = True, False, False
        replica.client = self._client(replica.address, _LeftPoolChannel(replica.address, channel))
        self._departed.append((replica, channel, time.monotonic()))

    def _close_departed(self) -> None:
        timeouts = self.config.timeouts
        linger = max(timeouts.prefill_seconds, timeouts.step_seconds) + timeouts.control_seconds
        now = time.monotonic()
        staying = []
        for replica, channel, left_at in self._departed:
            if replica.active_sessions > 0 and now - left_at < linger:
                staying.append((replica, channel, left_at))
                continue
            # grace: a Release sent just before lets it land (it has the same deadline)
            task = asyncio.create_task(channel.close(grace=timeouts.control_seconds))
            self._closing[task] = channel
            task.add_done_callback(lambda done: self._closing.pop(done, None))
        self._departed = staying

    def _start_probe(self, replica: Replica[Client]) -> asyncio.Task[None]:
        if replica.probe is None or replica.probe.done():
            replica.probe = asyncio.create_task(self._probe(replica))
        return replica.probe

    async def _probe(self, replica: Replica[Client]) -> None:
        try:
            info = await replica.client.info()
        except ReplicaError as error:
            if replica.healthy:
                log.warning("%s replica %s unhealthy: %s", self.role, replica.address, error)
            replica.healthy = False
            return
        if self.check is not None:  # every time: the reference may have been set since
            try:
                self.check(info)
            except IncompatibleModels as error:
                if replica.refused != str(error):
                    log.error("%s replica %s refused: %s", self.role, replica.address, error)
                replica.refused = str(error)
            else:
                replica.refused = ""
        if replica.info is None and not replica.refused:
            log.info("%s replica %s joined the pool (%s, model %s)", self.role, replica.address,
                     info.replica_id, info.model_id)
        replica.info = info
        replica.replica_id = info.replica_id
        replica.picks_since_probe = 0
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
            await asyncio.gather(self._task, return_exceptions=True)
        probes = [r.probe for r in self.replicas.values() if r.probe is not None]
        for probe in probes:
            probe.cancel()
        await asyncio.gather(*probes, return_exceptions=True)
        await self.source.close()
        for task in self._closing:
            task.cancel()
        channels = [r.client.channel for r in self.replicas.values()]
        channels += [c for _, c, _ in self._departed] + list(self._closing.values())
        self._departed, self._closing = [], {}
        await asyncio.gather(*(channel.close() for channel in channels))

    def pick(self, exclude: frozenset[str] = frozenset()) -> Replica[Client] | None:
        """The usable replica with the fewest expected sessions, not in exclude (addresses); ties
        go to the lower load. The pick counts until the replica's next Info, so a burst of new
        sessions spreads out before any of their Prefills has landed."""
        candidates = [r for r in self.replicas.values() if r.usable and r.address not in exclude]
        if not candidates:
            return None
        best = min(candidates, key=lambda r: (r.expected_sessions, r.info.load if r.info else 0.0, r.address))
        best.picks_since_probe += 1
        return best

    def lease(self, replica: Replica[Client]) -> Lease[Client]:
        """A session now lives on replica (until the lease ends)."""
        return Lease(replica)

    def by_replica_id(self, replica_id: str) -> Replica[Client] | None:
        return next((r for r in self.replicas.values() if r.replica_id == replica_id), None)

    def mark_failed(self, replica: Replica[Client]) -> None:
        """A call failed with UNAVAILABLE or a deadline: no new sessions until a probe answers."""
        replica.failures += 1
        replica.healthy = False

    def usable_count(self) -> int:
        return sum(r.usable for r in self.replicas.values())


def _left_pool(address: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                details=f"replica {address} left the pool")


class _LeftPoolChannel:
    """Stands in for the channel of a replica that left the pool (duck-typing grpc.aio.Channel for
    the generated stubs). Prefill, Verify, Propose, Speculate, Follow and Info fail with
    UNAVAILABLE, without a round trip, so a session there is rebuilt elsewhere at its next call.
    Release still reaches the replica, which frees the caches now if it is up, not at their TTL."""

    def __init__(self, address: str, channel: grpc.aio.Channel) -> None:
        self.address = address
        self._channel = channel

    def unary_unary(self, method: str, *args, **kwargs):
        if method.rsplit("/", 1)[-1] == "Release":
            return _UnavailableOnceClosed(self.address, self._channel.unary_unary(method, *args, **kwargs))
        return _Unavailable(self.address)

    def unary_stream(self, method: str, *args, **kwargs):
        return lambda request, **call_kwargs: _UnavailableStream(self.address)  # Speculate

    def stream_stream(self, method: str, *args, **kwargs):
        return lambda **call_kwargs: _UnavailableStream(self.address)  # Follow

    async def close(self, grace: float | None = None) -> None:
        pass  # the pool closes the real channel


class _Unavailable:
    def __init__(self, address: str) -> None:
        self.address = address

    async def __call__(self, request, **kwargs):
        raise _left_pool(self.address)


class _UnavailableStream:
    """A streaming call to a replica that left the pool: its first read or write fails."""

    def __init__(self, address: str) -> None:
        self.address = address

    async def read(self):
        raise _left_pool(self.address)

    async def write(self, request) -> None:
        raise _left_pool(self.address)

    async def done_writing(self) -> None:
        raise _left_pool(self.address)

    def cancel(self) -> bool:
        return False


class _UnavailableOnceClosed:
    def __init__(self, address: str, call) -> None:
        self.address = address
        self._call = call

    async def __call__(self, request, **kwargs):
        try:
            return await self._call(request, **kwargs)
        except grpc.aio.UsageError as error:  # the pool closed the channel: nothing to free there
            raise _left_pool(self.address) from error
