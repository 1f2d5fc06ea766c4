"""ReplicaPool in process: placement, a replica that leaves, a stalled replica, an empty pool."""

from __future__ import annotations

import asyncio
import socket
from collections import Counter
from dataclasses import dataclass, field

import pytest

from orchestrator.clients import DraftClient, TargetClient
from orchestrator.discovery import Endpoint
from orchestrator.pool import PoolConfig, ReplicaPool
from orchestrator.service import OrchestratorConfig, OrchestratorService
from specdec.errors import ReplicaLost, Unavailable
from specdec.protocol import PROTOCOL_VERSION, Proposal, ReplicaInfo, SamplingParams

from tests import stack
from tests.waiting import eventually_async


@dataclass
class ListSource:
    """A replica source the test edits."""

    addresses: list[str] = field(default_factory=list)
    description: str = "test list"

    async def endpoints(self) -> list[Endpoint]:
        return [Endpoint(address) for address in self.addresses]

    async def close(self) -> None:
        pass


def _info(live_sessions: int) -> ReplicaInfo:
    return ReplicaInfo(PROTOCOL_VERSION, "target", "test", 16, "", 64, 4, "float32", "cpu",
                       live_sessions, 0, 0.0, "test-replica")


def _unused_address() -> str:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{unused.getsockname()[1]}"


def test_a_burst_of_new_sessions_spreads_before_any_prefill_lands():
    """The generation loop counts a session on a replica once its Prefill returns; picks made
    meanwhile count too, so simultaneous new sessions do not all land on the same replica."""
    addresses = [_unused_address() for _ in range(3)]

    async def scenario():
        pool = ReplicaPool(TargetClient, ListSource(list(addresses)), PoolConfig(refresh_seconds=0.1))
        await pool.refresh()  # nobody answers: we play the Info answers below
        try:
            for replica in pool.replicas.values():
                replica.healthy, replica.info = True, _info(live_sessions=0)
            burst = Counter(pool.pick().address for _ in range(6))
            assert burst == {address: 2 for address in addresses}
            # Sessions other orchestrators placed (live_sessions in Info) count as well.
            for replica, live in zip(pool.replicas.values(), (4, 0, 0)):
                replica.info, replica.picks_since_probe = _info(live_sessions=live), 0
            assert Counter(pool.pick().address for _ in range(4)) == {addresses[1]: 2, addresses[2]: 2}
            assert pool.pick(exclude=frozenset(addresses[1:])).address == addresses[0]
        finally:
            await pool.close()

    asyncio.run(scenario())


def test_a_replica_that_leaves_hands_its_sessions_over_and_still_gets_their_release(loop_thread, tiny_pair):
    async def scenario():
        server, target = await stack.start_target(tiny_pair.target_dir, replica_id="leaving")
        address = f"127.0.0.1:{server.port}"
        source = ListSource([address])
        pool = ReplicaPool(TargetClient, source, PoolConfig(refresh_seconds=0.1))
        try:
            await pool.refresh()
            replica = pool.replicas[address]
            assert replica.usable
            prefill = await replica.client.prefill("session-1", [5, 6, 7], SamplingParams())
            lease = pool.lease(replica)  # as the generation loop does
            assert replica.active_sessions == 1

            source.addresses = []
            await pool.refresh()
            assert address not in pool.replicas and replica.left and not replica.usable
            # The session's next call fails the way a lost replica does, so the generation loop
            # re-prefills it elsewhere from the committed tokens ...
            with pytest.raises(ReplicaLost, match="left the pool"):
                await replica.client.verify(prefill.handle, Proposal(token_ids=()))
            # ... and its Release still reaches the replica, which frees the cache now.
            assert await replica.client.release("session-1")
            assert target.info().live_sessions == 0
            lease.end()
            lease.end()  # a second end changes nothing
            assert replica.active_sessions == 0

            async def channel_closed() -> bool:  # none of our sessions is left there
                await pool.refresh()
                try:
                    await replica.client.release("session-1")
                except ReplicaLost:
                    return True  # not a grpc UsageError
                return False

            await eventually_async(channel_closed, "the channel of the replica that left to close")
        finally:
            await pool.close()
            await server.stop()

    loop_thread.run(scenario())


def test_a_draft_that_leaves_fails_its_sessions_next_call_of_every_kind(loop_thread, tiny_pair):
    """A draft replica that left the pool: Propose, Speculate and Follow (streamed offers) fail the
    way a lost replica's do, without a round trip, so its sessions go on elsewhere."""
    async def scenario():
        server, _ = await stack.start_draft(tiny_pair.draft_dir, replica_id="leaving-draft")
        address = f"127.0.0.1:{server.port}"
        source = ListSource([address])
        pool = ReplicaPool(DraftClient, source, PoolConfig(refresh_seconds=0.1))
        try:
            await pool.refresh()
            replica = pool.replicas[address]
            prefill = await replica.client.prefill("session-1", [5, 6, 7], SamplingParams())
            source.addresses = []
            await pool.refresh()
            assert replica.left and not replica.usable
            with pytest.raises(ReplicaLost, match="left the pool"):
                await replica.client.propose(prefill.handle, [], 2)
            with pytest.raises(ReplicaLost, match="left the pool"):
                await replica.client.speculate(prefill.handle, [], 2, 1, 1).proposal()
            follow = replica.client.follow(prefill.handle, [], 2)
            with pytest.raises(ReplicaLost, match="left the pool"):
                await follow.start()
            with pytest.raises(ReplicaLost, match="left the pool"):
                await follow.read()
            assert await replica.client.release("session-1")
        finally:
            await pool.close()
            await server.stop()

    loop_thread.run(scenario())


def test_a_stalled_replica_holds_up_neither_discovery_nor_the_pool():
    """A replica that accepts connections and never answers: refresh() goes on without its Info."""
    with socket.socket() as stalled:
        stalled.bind(("127.0.0.1", 0))
        stalled.listen()
        stalled_address = f"127.0.0.1:{stalled.getsockname()[1]}"

        async def scenario():
            source = ListSource([stalled_address])
            pool = ReplicaPool(TargetClient, source, PoolConfig(refresh_seconds=0.1))
            try:
                await pool.refresh()
                probe = pool.replicas[stalled_address].probe
                assert probe is not None and not probe.done()  # still waiting, within its deadline
                newcomer = _unused_address()
                source.addresses.append(newcomer)
                await pool.refresh()
                assert newcomer in pool.replicas
                assert pool.replicas[stalled_address].probe is probe  # one probe at a time
            finally:
                await pool.close()

        asyncio.run(scenario())


def test_a_request_while_the_target_pool_is_empty_is_unavailable():
    """Discovery can list no target for a while (a rollout of a one-replica pool)."""
    service = OrchestratorService(OrchestratorConfig(draft=_unused_address(), target=_unused_address()))
    with pytest.raises(Unavailable, match="no target replica"):
        service.limits()
