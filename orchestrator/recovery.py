"""Where one request's sessions live, and how they move when a replica fails: the recovery policy.

- Placing a side: replicas are tried in the pool's order (fewest sessions first) until one takes
  the session. A refusal (Refused: the replica is full) leaves nothing there; a lost replica is
  marked failed so new sessions avoid it until it answers a probe; a prompt the replica refuses
  (InvalidInput, OutOfRange) ends the request.
- A lost target (SessionLost or ReplicaLost during a Verify): the committed tokens C are
  prefilled again (resume: no token is sampled) on another replica, or on the same one if it is
  the only one left, and the round is sent again. The output does not change: the target's state
  is a function of C alone. At most MAX_TARGET_RECOVERIES tries per round.
- A lost draft: SessionLost (it dropped the session or is out of step) is answered by one
  re-prefill; anything else drops the draft, and rounds go on at K = 0 (the target alone decodes,
  still exactly) until a draft replica takes the session again every draft_retry_rounds rounds.
- The draft's first Prefill runs beside the target's and is not waited for by the first token:
  the loop waits for it when it first needs the model draft. Under hybrid it is not even sent
  until then: a request that the lookup serves alone never takes a draft replica's session.
- Every replica a Prefill was sent to gets a Release when the request ends, however it ends: a
  cancelled Prefill may still have made the session there.

See docs/architecture.md ("Recovery").
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from orchestrator.clients import DecodeStep, DraftClient, FollowCall, SpeculateCall, TargetClient
from orchestrator.pool import Client, Lease, Replica, ReplicaPool
from orchestrator.stats import GenerationStats
from specdec.errors import (
    InvalidInput,
    OutOfRange,
    Overloaded,
    Refused,
    ReplicaError,
    ReplicaLost,
    SessionLost,
    SpecdecError,
    Unavailable,
)
from specdec.lookup import proposal_method
from specdec.protocol import (
    CallTiming,
    DecodeLookup,
    DraftedAhead,
    DraftOffer,
    Handle,
    Proposal,
    Reply,
    SamplingParams,
    VerifyOutcome,
)

log = logging.getLogger(__name__)


def _target_error(error: SpecdecError) -> SpecdecError:
    """A target call's failure as the request's error."""
    if isinstance(error, (InvalidInput, OutOfRange)):
        return type(error)(f"target {error}")
    if isinstance(error, Refused):
        return Overloaded(f"target {error}")
    if isinstance(error, ReplicaError):
        return Unavailable(f"target {error}")
    return error

Extra = TypeVar("Extra")
Result = TypeVar("Result")

MAX_TARGET_RECOVERIES = 8  # per round, before the request fails with UNAVAILABLE

# Releases still running after their Generate ended; kept here so they are not garbage-collected
# mid-flight, and so that a stopping orchestrator can wait for them (wait_for_releases).
_RELEASES: set[asyncio.Task[None]] = set()


async def wait_for_releases(timeout_seconds: float) -> None:
    """Lets the releases of finished or cancelled requests reach the replicas (on shutdown)."""
    if _RELEASES:
        await asyncio.wait(set(_RELEASES), timeout=timeout_seconds)


@dataclass
class Placement(Generic[Client]):
    """One side of the session: the lease on its replica and the handle of its state there."""

    lease: Lease[Client]
    handle: Handle

    @property
    def replica(self) -> Replica[Client]:
        return self.lease.replica


class SessionReplicas:
    """The target and draft sessions of one request, kept alive across replica failures."""

    def __init__(self, session_id: str, sampling: SamplingParams, target_pool: ReplicaPool[TargetClient],
                 draft_pool: ReplicaPool[DraftClient], stats: GenerationStats, draft_retry_rounds: int,
                 cache_partition: str = "") -> None:
        self.session_id = session_id
        self.sampling = sampling
        self.cache_partition = cache_partition  # the request's share of a draft replica's shared state
        self.target_pool = target_pool
        self.draft_pool = draft_pool
        self.stats = stats
        self.draft_retry_rounds = draft_retry_rounds
        self.target: Placement[TargetClient] | None = None
        self.draft: Placement[DraftClient] | None = None
        # Every replica that may hold a cache of this session, by (role, address).
        self._holders: dict[tuple[str, str], Replica[TargetClient] | Replica[DraftClient]] = {}
        self._rounds_without_draft = 0
        self._draft_attaching: asyncio.Task[None] | None = None  # the first draft Prefill, in flight
        self._draft_deferred = False  # the first draft Prefill waits until the draft is needed

    # -- prefill --------------------------------------------------------------------------------

    async def prefill(self, committed: Sequence[int], speculate: bool, defer_draft: bool = False) -> int:
        """Both sides at once; returns the target's first token as soon as the target has it. The
        draft's Prefill goes on (settle_draft waits for it), or with defer_draft is sent only by
        the first settle_draft; a draft that no replica takes leaves the session at K = 0 for now."""
        if speculate and defer_draft:
            self._draft_deferred = True
        elif speculate:
            self._draft_attaching = asyncio.create_task(self._attach_draft(list(committed)))
        first = await self._place_target(committed, resume=False)
        assert first is not None
        return first

    @property
    def draft_attaching(self) -> bool:
        """The draft's first Prefill is still to come: in flight, or deferred until needed."""
        return self._draft_deferred or (self._draft_attaching is not None and not self._draft_attaching.done())

    async def settle_draft(self, committed: Sequence[int]) -> None:
        """Waits for the draft's first Prefill (sending it now, of committed, if it was deferred);
        has_draft tells how it ended."""
        if self._draft_deferred:
            self._draft_deferred = False
            await self._attach_draft(committed)
            return
        attaching, self._draft_attaching = self._draft_attaching, None
        if attaching is not None:
            await attaching

    async def _place_target(self, committed: Sequence[int], resume: bool,
                            exclude: frozenset[str] = frozenset()) -> int | None:
        tried = set(exclude)
        errors: list[ReplicaError] = []
        while (replica := self.target_pool.pick(frozenset(tried))) is not None:
            tried.add(replica.address)
            self._holders[("target", replica.address)] = replica
            try:
                reply = await replica.client.prefill(self.session_id, committed, self.sampling, resume,
                                                     self.stats.prompt_tokens if resume else 0)
            except (InvalidInput, OutOfRange) as error:
                raise InvalidInput(f"the target refused the prompt: {error}") from error
            except ReplicaError as error:
                errors.append(error)
                self._prefill_failed("target", self.target_pool, replica, error)
                continue
            if self.target is not None:
                self.target.lease.end()
                if self.target.replica is not replica:
                    self._release_in_background(self.target.replica, "target")
            self.target = Placement(self.target_pool.lease(replica), reply.handle)
            self.stats.target_replica = replica.replica_id
            self.stats.add_target_call(reply.timing)
            return reply.value
        if errors and isinstance(errors[-1], Refused):
            raise Overloaded(f"every target replica is at its session budget ({errors[-1]})")
        cause = errors[-1] if errors else "no target replica is available"
        raise Unavailable(f"no target replica could take the session ({cause})")

    async def _attach_draft(self, committed: Sequence[int]) -> None:
        self._rounds_without_draft = 0
        tried: set[str] = set()
        while (replica := self.draft_pool.pick(frozenset(tried))) is not None:
            tried.add(replica.address)
            self._holders[("draft", replica.address)] = replica
            try:
                reply = await replica.client.prefill(self.session_id, committed, self.sampling, self.cache_partition)
            except (Refused, ReplicaLost) as error:
                self._prefill_failed("draft", self.draft_pool, replica, error)
                continue
            except (ReplicaError, InvalidInput, OutOfRange) as error:
                log.warning("draft prefill on %s failed (%s): going on without a draft", replica.address, error)
                return
            self.draft = Placement(self.draft_pool.lease(replica), reply.handle)
            self.stats.draft_replica = replica.replica_id
            self.stats.add_draft_call(reply.timing)
            return

    def _prefill_failed(self, role: str, pool: ReplicaPool[Client], replica: Replica[Client],
                        error: ReplicaError) -> None:
        if isinstance(error, Refused):  # it holds nothing of the session
            self._holders.pop((role, replica.address), None)
            log.info("%s replica %s refused session %s (%s): trying another replica", role,
                     replica.address, self.session_id, error)
            return
        log.warning("%s prefill on %s failed (%s): trying another replica", role, replica.address, error)
        if isinstance(error, ReplicaLost):
            pool.mark_failed(replica)

    # -- rounds ---------------------------------------------------------------------------------

    @property
    def has_draft(self) -> bool:
        return self.draft is not None

    @property
    def draft_method(self) -> str:
        """What the draft replica's proposals are counted under: "model", or the lookup of a
        replica that serves one (`specdec serve draft --method ngram|suffix`)."""
        info = self.draft.replica.info if self.draft is not None else None
        return proposal_method(info.model_id) if info is not None else "model"

    async def reattach_draft_if_due(self, committed: Sequence[int]) -> None:
        """Called once per round while the session has no draft (none while its first Prefill is
        still in flight)."""
        if self.draft_attaching:
            return
        await self.settle_draft(committed)  # a first Prefill that ended: its outcome is in self.draft
        if self.draft is not None:
            return
        self._rounds_without_draft += 1
        if self._rounds_without_draft >= self.draft_retry_rounds:
            await self._attach_draft(committed)

    async def propose(self, committed: Sequence[int], num_speculative_tokens: int) -> Reply[Proposal] | None:
        """The draft's proposal, or None if the draft is lost (the round then goes on at K = 0)."""
        async def call(client: DraftClient, handle: Handle, new: Sequence[int]) -> tuple[Reply[Proposal], None]:
            return await client.propose(handle, new, num_speculative_tokens), None

        answer = await self._draft_call(committed, call)
        return answer[0] if answer is not None else None

    async def speculate(self, committed: Sequence[int], num_speculative_tokens: int, fanout: int,
                        branch_num_speculative_tokens: int, branch_outcomes: int = 0,
                        ) -> tuple[Reply[Proposal], SpeculateCall] | None:
        """A Propose that also drafts ahead (the outcomes j < branch_outcomes; 0: all): the
        proposal, and the call whose branches() follow while the target verifies; None if the
        draft is lost (as for propose)."""
        async def call(client: DraftClient, handle: Handle, new: Sequence[int]) -> tuple[Reply[Proposal], SpeculateCall]:
            started = client.speculate(handle, new, num_speculative_tokens, fanout, branch_num_speculative_tokens,
                                       branch_outcomes)
            try:
                return await started.proposal(), started
            except BaseException:
                started.cancel()
                raise

        return await self._draft_call(committed, call)

    @property
    def draft_follows(self) -> bool:
        """Whether the session's draft replica takes Follow streams (not known to lack them)."""
        return self.draft is not None and self.draft.lease.client.follows

    async def follow(self, committed: Sequence[int], num_speculative_tokens: int, fanout: int,
                     branch_num_speculative_tokens: int, branch_outcomes: int = 0) -> FollowCall | None:
        """Opens a Follow on the draft session from C = committed (streamed speculation); its
        proposals go through followed(). None when the draft is gone or failed to take it: offers
        are an optimisation, and the next draft call finds out and handles what failed."""
        placement = self.draft
        if placement is None:
            return None
        call = placement.lease.client.follow(placement.handle, committed[placement.handle.committed_length:],
                                             num_speculative_tokens, fanout, branch_num_speculative_tokens,
                                             branch_outcomes)
        try:
            await call.start()
        except (ReplicaError, InvalidInput, OutOfRange) as error:
            call.cancel()
            log.info("following on %s failed: %s", placement.replica.address, error)
            return None
        return call

    def followed(self, reply: Reply[Proposal]) -> None:
        """A Follow's proposal: the draft session is at its handle, as after a Propose."""
        if self.draft is not None:
            self.draft.handle = reply.handle
            self.stats.add_draft_call(reply.timing)

    async def branches(self, call: SpeculateCall) -> tuple[DraftedAhead, CallTiming] | None:
        """The branches a Speculate drafted ahead; None if they did not come (drafting ahead is
        an optimisation: a failure here is found out, and handled, by the next draft call)."""
        try:
            return await call.branches()
        except (ReplicaError, InvalidInput, OutOfRange) as error:
            log.info("drafting ahead on %s failed: %s", call.address, error)
            return None

    async def _draft_call(self, committed: Sequence[int], call: Callable[
            [DraftClient, Handle, Sequence[int]], Awaitable[tuple[Reply[Proposal], Extra]]],
    ) -> tuple[Reply[Proposal], Extra] | None:
        """Runs call(client, handle, the committed tokens the draft lacks) on the draft: a lost
        session is re-prefilled once, a failed replica dropped (the round goes on at K = 0)."""
        for attempt in range(2):
            placement = self.draft
            assert placement is not None
            new = committed[placement.handle.committed_length:]
            try:
                reply, extra = await call(placement.lease.client, placement.handle, new)
            except SessionLost as error:
                # No Release: it could overtake the Prefill that rebuilds the session on the same
                # replica (which replaces it there).
                log.warning("propose on %s: %s; re-prefilling the draft", placement.replica.address, error)
                placement.lease.end()
                self.draft = None
                if attempt == 0:
                    await self._attach_draft(committed)
                    if self.draft is not None:
                        continue
                return None
            except (ReplicaError, InvalidInput, OutOfRange) as error:
                log.warning("propose on %s failed (%s): going on without a draft", placement.replica.address, error)
                if isinstance(error, ReplicaLost):
                    self.draft_pool.mark_failed(placement.replica)
                self._drop_draft()
                return None
            placement.handle = reply.handle
            self.stats.add_draft_call(reply.timing)
            return reply, extra
        return None

    async def verify(self, committed: Sequence[int], proposal: Proposal) -> Reply[VerifyOutcome]:
        return await self._target_call(committed, "verify",
                                       lambda client, handle: client.verify(handle, proposal))

    async def decode(self, committed: Sequence[int], max_tokens: int,
                     lookup: DecodeLookup | None = None) -> AsyncIterator[DecodeStep]:
        """Plain decoding of up to max_tokens tokens (with lookup, its passes also verify tokens
        looked up in the session's own: TargetClient.decode), each step as it comes: a
        step with tokens, and the call's last, which normally brings only its timing (also
        recorded here). committed must be the caller's live C, which takes every step's tokens
        before it asks for the next: a session lost mid-stream is re-prefilled from it and the rest
        decoded there."""
        left = max_tokens
        for _ in range(MAX_TARGET_RECOVERIES):
            placement = self.target
            assert placement is not None
            try:
                async for step in placement.lease.client.decode(placement.handle, left, lookup):
                    placement.handle = step.handle
                    if step.timing is not None:
                        self.stats.add_target_call(step.timing)
                    left -= len(step.token_ids)
                    if step.token_ids or step.timing is not None:
                        yield step
                return
            except (SessionLost, ReplicaLost) as error:
                await self._target_lost(placement, error, committed, "decode")
            except SpecdecError as error:
                raise _target_error(error) from error
        raise Unavailable(f"the target session could not be recovered after {MAX_TARGET_RECOVERIES} tries")

    @property
    def ends_decodes(self) -> bool:
        """Whether the session's target replica can end a running Decode early (end_decode)."""
        return self.target is not None and self.target.lease.client.ends_decodes

    async def end_decode(self, start: int) -> bool:
        """Ends the target session's running Decode that started from C of length `start` after
        its current pass: its stream then brings the rest of its tokens. Whether one was ending;
        a failure ends nothing (the Decode runs to its own end, its tokens as good)."""
        placement = self.target
        if placement is None:
            return False
        try:
            return await placement.lease.client.end_decode(placement.handle.session_id, start)
        except SpecdecError as error:
            log.info("ending a Decode on %s failed: %s", placement.replica.address, error)
            return False

    async def offer(self, offer: DraftOffer) -> tuple[bool, int]:
        """Offers drafts to the target session's running Decode (streamed speculation): whether it
        holds them, and the session's length when they arrived. Only an optimisation: a failure
        holds nothing, and the Decode itself reports a lost session."""
        placement = self.target
        if placement is None:
            return False, 0
        try:
            return await placement.lease.client.offer(placement.handle.session_id, offer)
        except SpecdecError as error:
            log.info("an offer of drafts to %s failed: %s", placement.replica.address, error)
            return False, 0

    async def _target_call(self, committed: Sequence[int], name: str,
                           call: Callable[[TargetClient, Handle], Awaitable[Reply[Result]]]) -> Reply[Result]:
        """call on the session's target replica; a lost session or replica is re-prefilled from C
        (on another replica if there is one) and the call made again."""
        for _ in range(MAX_TARGET_RECOVERIES):
            placement = self.target
            assert placement is not None
            try:
                reply = await call(placement.lease.client, placement.handle)
            except (SessionLost, ReplicaLost) as error:
                await self._target_lost(placement, error, committed, name)
                continue
            except SpecdecError as error:
                raise _target_error(error) from error
            placement.handle = reply.handle
            self.stats.add_target_call(reply.timing)
            return reply
        raise Unavailable(f"the target session could not be recovered after {MAX_TARGET_RECOVERIES} tries")

    async def _target_lost(self, placement: Placement[TargetClient], error: SpecdecError,
                           committed: Sequence[int], name: str) -> None:
        log.warning("%s on %s failed (%s): re-prefilling from %d committed tokens",
                    name, placement.replica.address, error, len(committed))
        exclude: frozenset[str] = frozenset()
        if isinstance(error, ReplicaLost):
            self.target_pool.mark_failed(placement.replica)
            exclude = frozenset({placement.replica.address})
        await self._recover_target(committed, exclude)

    async def _recover_target(self, committed: Sequence[int], exclude: frozenset[str]) -> None:
        """Re-prefills C on another replica if there is one, else on any that answers."""
        self.stats.re_prefills += 1
        try:
            await self._place_target(committed, resume=True, exclude=exclude)
        except Unavailable:
            if not exclude:
                raise
            await asyncio.sleep(self.target_pool.config.refresh_seconds)
            await self._place_target(committed, resume=True)

    # -- release --------------------------------------------------------------------------------

    def _drop_draft(self) -> None:
        if self.draft is not None:
            self.draft.lease.end()
            self._release_in_background(self.draft.replica, "draft")
            self.draft = None

    def release_all(self) -> None:
        """Releases the session on both sides, and on any replica a Prefill reached. Not awaited:
        a cancelled request must not wait (or be cancelled again) here, and a finished stream
        ends for its client without waiting for a slow replica's Release."""
        if self._draft_attaching is not None:
            self._draft_attaching.cancel()  # its replica is among the holders: released below
            self._draft_attaching = None
        for placement in (self.target, self.draft):
            if placement is not None:
                placement.lease.end()
        self.target = self.draft = None
        for (role, _), replica in list(self._holders.items()):
            self._release_in_background(replica, role)

    def _release_in_background(self, replica: Replica[TargetClient] | Replica[DraftClient], role: str) -> None:
        """A stalled replica gets the call's deadline; its session TTL is the backstop."""
        self._holders.pop((role, replica.address), None)
        task = asyncio.get_running_loop().create_task(self._release(replica, role))
        _RELEASES.add(task)
        task.add_done_callback(_RELEASES.discard)

    async def _release(self, replica: Replica[TargetClient] | Replica[DraftClient], role: str) -> None:
        try:
            await replica.client.release(self.session_id)
        except ReplicaError as error:
            log.info("release of %s on %s %s failed: %s", self.session_id, role, replica.address, error)
