"""One request's guess-verify loop (DESIGN.md section 2).

The orchestrator owns the committed sequence C. It prefills the draft and the target together,
then runs rounds: Propose K drafts (skipped at K = 0), Verify them on the target in one pass,
append the accepted drafts and the target's next token to C. It streams what is committed and
recovers from lost sessions by re-prefilling from C: a target replica that fails is replaced (the
stream goes on, output unchanged); a draft that fails turns rounds into K = 0 until a draft replica
can take the session again.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from orchestrator.clients import CallTiming, DraftClient, ProposeResult, TargetClient, VerifyResult
from orchestrator.k_policy import KPolicy, RoundObservation
from orchestrator.pool import Replica, ReplicaPool
from orchestrator.stats import GenerationStats
from orchestrator.text import Decoder, TextStream
from specdec.errors import InvalidInput, OutOfRange, Overloaded, Unavailable
from specdec.sampling import SamplingParams
from specdec.serving import Handle

log = logging.getLogger(__name__)

# The session is gone or out of step on that replica: rebuild it from C.
LOST_SESSION = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ABORTED)
# The replica itself is unreachable or stalled: rebuild elsewhere.
LOST_REPLICA = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)
MAX_TARGET_RECOVERIES = 8  # per round, before the request fails with UNAVAILABLE
# The replica refused the new session, and holds none of it: try another.
REFUSED = (grpc.StatusCode.RESOURCE_EXHAUSTED,)

# Releases still running after their Generate ended; kept here so they are not garbage-collected
# mid-flight, and so that a stopping orchestrator can wait for them (wait_for_releases).
_RELEASES: set[asyncio.Task[None]] = set()


async def wait_for_releases(timeout_seconds: float) -> None:
    """Lets the releases of finished or cancelled requests reach the replicas (on shutdown)."""
    if _RELEASES:
        await asyncio.wait(set(_RELEASES), timeout=timeout_seconds)


@dataclass(frozen=True)
class GenerationRequest:
    prompt_token_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise InvalidInput("the prompt is empty")
        if self.max_new_tokens < 1:
            raise InvalidInput(f"max_new_tokens must be > 0, got {self.max_new_tokens}")


@dataclass(frozen=True)
class GenerationLimits:
    """What the replicas allow, from their Info."""

    max_context: int
    max_num_speculative_tokens: int
    eos_token_ids: frozenset[int]
    draft_retry_rounds: int = 8  # K = 0 rounds between attempts to get a draft back


@dataclass(frozen=True)
class Chunk:
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None = None  # "length" | "eos" | "stop" | "context" on the last chunk
    stats: GenerationStats | None = None


@dataclass
class Placement:
    """Where one side of the session lives."""

    replica: Replica
    handle: Handle


class Generation:
    def __init__(
        self,
        request: GenerationRequest,
        policy: KPolicy,
        target_pool: ReplicaPool,
        draft_pool: ReplicaPool,
        tokenizer: Decoder | None,
        limits: GenerationLimits,
        speculate: bool = True,
    ) -> None:
        self.request = request
        self.speculate = speculate  # False: speculation off, no draft session at all
        self.policy = policy
        self.target_pool = target_pool
        self.draft_pool = draft_pool
        self.limits = limits
        self.session_id = uuid.uuid4().hex
        self.committed: list[int] = list(request.prompt_token_ids)
        self.text = TextStream(tokenizer, request.stop)
        self.stats = GenerationStats(prompt_tokens=len(request.prompt_token_ids))
        self.target: Placement | None = None
        self.draft: Placement | None = None
        # Every replica that may hold a cache of this session, by (role, address): one is added
        # before its Prefill is sent, since a cancelled Prefill may still have made the session.
        # All of them get a Release when the request ends, however it ends.
        self._holders: dict[tuple[str, str], Replica] = {}
        self._rounds_without_draft = 0
        if len(self.committed) >= limits.max_context:
            raise OutOfRange(
                f"the prompt has {len(self.committed)} tokens; the max context is {limits.max_context}"
            )

    async def run(self) -> AsyncIterator[Chunk]:
        started = time.perf_counter()
        try:
            first = await self._prefill()
            self.stats.time_to_first_token_seconds = time.perf_counter() - started
            chunk = self._commit([first])
            while chunk.finish_reason is None:
                yield chunk
                chunk = self._commit(await self._round())
            self.stats.wall_seconds = time.perf_counter() - started
            self.stats.controller_estimates = dict(self.policy.estimates())
            yield Chunk(chunk.token_ids, chunk.text + self.text.flush(), chunk.finish_reason, self.stats)
        finally:
            # Not awaited: a cancelled request must not wait (or be cancelled again) here, and a
            # finished stream ends for its client without waiting for a slow replica's Release.
            self._release_all()

    # -- prefill --------------------------------------------------------------------------------

    async def _prefill(self) -> int:
        draft_task = asyncio.create_task(self._attach_draft() if self.speculate else asyncio.sleep(0))
        try:
            first = await self._place_target(resume=False)
        except BaseException:
            draft_task.cancel()
            raise
        await draft_task
        assert first is not None
        return first

    async def _place_target(self, resume: bool, exclude: frozenset[str] = frozenset()) -> int | None:
        """Prefills the target side on the best replica (another on overload or failure)."""
        tried = set(exclude)
        last_error = "no target replica is available"
        while (replica := self.target_pool.pick(frozenset(tried))) is not None:
            tried.add(replica.address)
            client: TargetClient = replica.client  # type: ignore[assignment]
            self._holders[("target", replica.address)] = replica
            try:
                result = await client.prefill(self.session_id, list(self.committed), self.request.sampling, resume)
            except grpc.aio.AioRpcError as error:
                last_error = f"{replica.address}: {error.code().name}: {error.details()}"
                if error.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE):
                    raise InvalidInput(f"the target refused the prompt: {error.details()}") from error
                self._refused_or_failed("target", replica, error)
                continue
            self._move_target(Placement(replica, result.handle))
            self.stats.add_target_call(result.timing)
            return result.next_token_id
        if "RESOURCE_EXHAUSTED" in last_error:
            raise Overloaded(f"every target replica is at its session budget ({last_error})")
        raise Unavailable(f"no target replica could take the session ({last_error})")

    def _refused_or_failed(self, role: str, replica: Replica, error: grpc.aio.AioRpcError) -> None:
        """A Prefill on replica failed: a refusal (it holds nothing) or a failure (no new sessions
        go there until a probe answers). Either way the caller tries another replica."""
        pool = self.target_pool if role == "target" else self.draft_pool
        if error.code() in REFUSED:
            self._holders.pop((role, replica.address), None)
            log.info("%s replica %s refused session %s (%s: %s): trying another replica", role,
                     replica.address, self.session_id, error.code().name, error.details())
        else:
            log.warning("%s prefill on %s failed (%s): trying another replica", role,
                        replica.address, error.code().name)
            if error.code() in LOST_REPLICA:
                pool.mark_failed(replica)

    def _move_target(self, placement: Placement) -> None:
        if self.target is not None:
            self.target.replica.active_sessions -= 1
            old = self.target.replica
            if old is not placement.replica:
                self._release_in_background(old, "target")
        placement.replica.active_sessions += 1
        self.target = placement
        self.stats.target_replica = placement.replica.replica_id

    async def _attach_draft(self) -> None:
        """Prefills a draft replica with C (another one on overload or failure); if none takes
        the session, it goes on at K = 0 and tries again later."""
        self._rounds_without_draft = 0
        tried: set[str] = set()
        while (replica := self.draft_pool.pick(frozenset(tried))) is not None:
            tried.add(replica.address)
            client: DraftClient = replica.client  # type: ignore[assignment]
            self._holders[("draft", replica.address)] = replica
            try:
                result = await client.prefill(self.session_id, list(self.committed), self.request.sampling)
            except grpc.aio.AioRpcError as error:
                self._refused_or_failed("draft", replica, error)
                if error.code() in REFUSED + LOST_REPLICA:
                    continue
                return
            replica.active_sessions += 1
            self.draft = Placement(replica, result.handle)
            self.stats.add_draft_call(result.timing)
            self.stats.draft_replica = replica.replica_id
            return

    def _drop_draft(self) -> None:
        if self.draft is not None:
            self.draft.replica.active_sessions -= 1
            self._release_in_background(self.draft.replica, "draft")
            self.draft = None

    # -- rounds ---------------------------------------------------------------------------------

    def _max_num_draft(self) -> int:
        remaining = self.request.max_new_tokens - self.stats.generated_tokens
        context_left = self.limits.max_context - len(self.committed)
        return max(0, min(self.limits.max_num_speculative_tokens, remaining - 1, context_left - 1))

    async def _round(self) -> list[int]:
        if self.draft is None and self.speculate:
            self._rounds_without_draft += 1
            if self._rounds_without_draft >= self.limits.draft_retry_rounds:
                await self._attach_draft()
        cap = self._max_num_draft() if self.draft is not None else 0
        num_draft = self.policy.choose(cap)
        proposal = await self._propose(num_draft) if num_draft > 0 else None
        if self.speculate and self.draft is None:
            self.stats.draft_unavailable_rounds += 1
        drafts = proposal.token_ids if proposal else ()
        verify = await self._verify(drafts, proposal.distributions if proposal else ())
        accepted = list(drafts[: verify.num_accepted])
        committed = [*accepted, verify.next_token_id]
        self.stats.add_round(len(drafts), verify.num_accepted, len(committed))
        self.policy.observe(_observation(proposal, verify))
        return committed

    async def _propose(self, num_draft: int) -> ProposeResult | None:
        assert self.draft is not None
        for attempt in range(2):
            placement = self.draft
            new = self.committed[placement.handle.committed_length:]
            client: DraftClient = placement.replica.client  # type: ignore[assignment]
            try:
                result = await client.propose(placement.handle, new, num_draft)
            except grpc.aio.AioRpcError as error:
                log.warning("propose on %s failed: %s", placement.replica.address, error.code().name)
                if error.code() in LOST_SESSION:
                    # Gone or out of step there. No Release: it could overtake the Prefill that
                    # rebuilds the session from C on the same replica (and replaces it there).
                    placement.replica.active_sessions -= 1
                    self.draft = None
                    if attempt == 0:
                        await self._attach_draft()  # then try once more
                        if self.draft is not None:
                            continue
                    return None
                if error.code() in LOST_REPLICA:
                    self.draft_pool.mark_failed(placement.replica)
                self._drop_draft()
                return None
            placement.handle = result.handle
            self.stats.add_draft_call(result.timing)
            return result
        return None

    async def _verify(self, drafts: tuple[int, ...], distributions) -> VerifyResult:
        for _ in range(MAX_TARGET_RECOVERIES):
            placement = self.target
            assert placement is not None
            client: TargetClient = placement.replica.client  # type: ignore[assignment]
            try:
                result = await client.verify(placement.handle, drafts, distributions)
            except grpc.aio.AioRpcError as error:
                code = error.code()
                if code not in LOST_SESSION + LOST_REPLICA:
                    raise _client_error(placement.replica, error) from error
                log.warning("verify on %s failed (%s): re-prefilling from %d committed tokens",
                            placement.replica.address, code.name, len(self.committed))
                exclude: frozenset[str] = frozenset()
                if code in LOST_REPLICA:
                    self.target_pool.mark_failed(placement.replica)
                    exclude = frozenset({placement.replica.address})
                await self._recover_target(exclude)
                continue
            placement.handle = result.handle
            self.stats.add_target_call(result.timing)
            return result
        raise Unavailable(f"the target session could not be recovered after {MAX_TARGET_RECOVERIES} tries")

    async def _recover_target(self, exclude: frozenset[str]) -> None:
        """Re-prefills C on another replica if there is one, else on any that answers."""
        self.stats.re_prefills += 1
        try:
            await self._place_target(resume=True, exclude=exclude)
        except Unavailable:
            if not exclude:
                raise
            await asyncio.sleep(self.target_pool.config.refresh_seconds)
            await self._place_target(resume=True)

    # -- output ---------------------------------------------------------------------------------

    def _commit(self, tokens: list[int]) -> Chunk:
        """Appends a round's tokens to C, cutting at EOS, a stop string or max_new_tokens."""
        kept: list[int] = []
        finish = None
        for token in tokens:
            if self.stats.generated_tokens + len(kept) >= self.request.max_new_tokens:
                break
            kept.append(token)
            if token in self.limits.eos_token_ids:
                finish = "eos"
                break
        count, text = self.text.add(kept)
        if self.text.stopped:
            kept, finish = kept[:count], "stop"
        self.committed.extend(kept)
        self.stats.generated_tokens += len(kept)
        if finish is None and self.stats.generated_tokens >= self.request.max_new_tokens:
            finish = "length"
        if finish is None and len(self.committed) >= self.limits.max_context:
            finish = "context"
        return Chunk(tuple(kept), text, finish)

    def _release_in_background(self, replica: Replica, role: str) -> None:
        """Releases the session on replica without waiting (a stalled replica gets the call's
        deadline; its TTL is the backstop)."""
        self._holders.pop((role, replica.address), None)
        task = asyncio.get_running_loop().create_task(self._release(replica, role))
        _RELEASES.add(task)
        task.add_done_callback(_RELEASES.discard)

    async def _release(self, replica: Replica, role: str) -> None:
        try:
            await replica.client.release(self.session_id)
        except grpc.aio.AioRpcError as error:
            log.info("release of %s on %s %s failed: %s", self.session_id, role, replica.address,
                     error.code().name)

    def _release_all(self) -> None:
        """Releases the session on both sides at once, and on any replica a Prefill reached."""
        for placement in (self.target, self.draft):
            if placement is not None:
                placement.replica.active_sessions -= 1
        self.target = self.draft = None
        for (role, _), replica in list(self._holders.items()):
            self._release_in_background(replica, role)


def _client_error(replica: Replica, error: grpc.aio.AioRpcError) -> Exception:
    """A replica's refusal that recovery cannot fix, as the domain error the client gets."""
    message = f"target {replica.address}: {error.code().name}: {error.details()}"
    kind = {grpc.StatusCode.RESOURCE_EXHAUSTED: Overloaded, grpc.StatusCode.OUT_OF_RANGE: OutOfRange,
            grpc.StatusCode.INVALID_ARGUMENT: InvalidInput}.get(error.code(), Unavailable)
    return kind(message)


def _observation(proposal: ProposeResult | None, verify: VerifyResult) -> RoundObservation:
    draft_timing = proposal.timing if proposal else CallTiming(0.0, 0.0, 0.0)
    return RoundObservation(
        num_speculative_tokens=len(proposal.token_ids) if proposal else 0,
        num_accepted=verify.num_accepted,
        acceptance_signal=verify.acceptance_signal,
        draft_compute_seconds=draft_timing.compute_seconds,
        draft_wall_seconds=draft_timing.wall_seconds,
        draft_fed_tokens=proposal.fed_tokens if proposal else 0,
        verify_compute_seconds=verify.timing.compute_seconds,
        verify_wall_seconds=verify.timing.wall_seconds,
    )
