"""The draft service's operations on sessions (no protobuf): Prefill, Propose, Speculate (a
Propose, then branches drafted ahead for the outcomes of the round it starts), and Follow (streamed
speculation: Speculate's answers from a C that grows as the caller sends it)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from draft_service.engine import (
    NUM_CANDIDATES,
    DraftEngine,
    DraftSessionState,
    bonus_candidates,
)
from specdec.errors import InvalidInput, OutOfRange, Overloaded
from specdec.models import LoadedModel
from specdec.protocol import (
    MAX_DRAFT_TOP_M,
    BranchProposal,
    DraftedAhead,
    Handle,
    Proposal,
    SamplingParams,
    Timing,
    check_token_ids,
)
from specdec.ragged import Job
from specdec.serving import ServiceConfig, SessionService


@dataclass(frozen=True)
class DraftConfig:
    top_m: int = MAX_DRAFT_TOP_M  # entries of q~ sent per draft token when sampling

    def __post_init__(self) -> None:
        if not 1 <= self.top_m <= MAX_DRAFT_TOP_M:
            raise ValueError(f"top_m must be in [1, {MAX_DRAFT_TOP_M}]")


@dataclass(frozen=True)
class FollowStep:
    """One message of a Follow stream: C's tokens after those the stream sent before, and how to
    draft from then on (fanout 0: no branches)."""

    new_committed: tuple[int, ...]
    num_speculative_tokens: int
    fanout: int = 0
    branch_num_speculative_tokens: int = 0
    branch_outcomes: int = 0


class DraftService(SessionService[DraftSessionState]):
    role = "draft"

    def __init__(self, loaded: LoadedModel, config: ServiceConfig, draft: DraftConfig = DraftConfig()):
        super().__init__(loaded, config, size_of=lambda state: len(state.cache))
        self.engine = DraftEngine(loaded, draft.top_m)

    async def prefill(
        self, session_id: str, token_ids: list[int], sampling: SamplingParams, cache_partition: str = ""
    ) -> tuple[Handle, None, Timing]:
        """cache_partition is for replicas that keep state across sessions; a model draft keeps none."""
        self.check_prompt(token_ids)

        def build() -> Job[tuple[DraftSessionState, int, None]]:
            state = yield from self.engine.prefill(token_ids, sampling)
            return state, len(token_ids), None

        return await self.new_session(session_id, token_ids, build)

    async def propose(
        self, handle: Handle, new_committed: list[int], num_speculative_tokens: int
    ) -> tuple[Handle, Proposal, Timing]:
        handle, new_committed = self._caught_up(handle, new_committed)
        new_length = check_propose(self, handle, new_committed, num_speculative_tokens)

        def apply(state: DraftSessionState) -> Job[tuple[int, Proposal]]:
            proposal = yield from self.engine.propose(state, new_committed, num_speculative_tokens)
            return new_length, proposal

        return await self.call(handle, apply)

    def _caught_up(self, handle: Handle, new_committed: list[int]) -> tuple[Handle, list[int]]:
        """A caller behind the session by tokens it sends anyway is taken as at the session's
        length, those tokens dropped from new_committed: it missed answers that moved the session
        on (a Follow cancelled while a proposal was on its way back), and drafts depend only on C,
        so the answer is the one a caller in step gets. Where the caller missed just the last
        call's answer, that call's stored answer (drafted from a shorter C than the caller sends)
        is not it. Anything else (a repeat of the last call, other tokens, another epoch) is left
        to the handle's check."""
        session = self.store.get(handle.session_id)
        if session is None or session.epoch != handle.epoch:
            return handle, new_committed
        start, at = handle.committed_length, session.committed_length
        behind = at - start
        if behind <= 0 or behind > len(new_committed):
            return handle, new_committed
        if behind == len(new_committed) and start == session.replay_length:
            return handle, new_committed  # a repeat of the last call: its stored answer
        if session.state.committed[start:at] != new_committed[:behind]:
            return handle, new_committed
        return replace(handle, committed_length=at), new_committed[behind:]

    async def speculate(
        self, handle: Handle, new_committed: list[int], num_speculative_tokens: int, fanout: int,
        branch_num_speculative_tokens: int, branch_outcomes: int = 0,
    ) -> AsyncIterator[tuple[Handle, Proposal, Timing] | tuple[DraftedAhead, Timing]]:
        """Propose, then draft ahead: yields the Propose's answer, then the branches for the
        outcomes of the round it starts (none where the session moved on meanwhile)."""
        check_branching(self, fanout, branch_num_speculative_tokens, branch_outcomes)
        new_handle, proposal, timing = await self.propose(handle, new_committed, num_speculative_tokens)
        yield new_handle, proposal, timing
        yield await self.draft_ahead(new_handle, fanout, branch_num_speculative_tokens, branch_outcomes)

    async def follow(
        self, handle: Handle, steps: AsyncIterator[FollowStep],
    ) -> AsyncIterator[tuple[Handle, Proposal, Timing] | tuple[DraftedAhead, Timing]]:
        """Streamed speculation (Follow): steps bring C's tokens as the caller learns them; each
        time the draft is free and a step has come since its last answer, it proposes from all the
        tokens sent so far, as Propose would, and with the step's fanout drafts ahead after it, as
        Speculate would (yields as speculate does). Steps that come while it drafts are answered
        together, from the newest C: a draft slower than the target skips the C's it is behind.
        Ends when the steps end and every step is answered; a step that fails its checks ends it
        with that error."""
        pending: list[int] = []  # C's tokens sent and not yet proposed from
        latest: FollowStep | None = None
        due = ended = False
        failed: BaseException | None = None
        changed = asyncio.Event()

        async def read() -> None:
            nonlocal latest, due, ended, failed
            try:
                async for step in steps:
                    if step.fanout:
                        check_branching(self, step.fanout, step.branch_num_speculative_tokens, step.branch_outcomes)
                    pending.extend(step.new_committed)
                    latest, due = step, True
                    changed.set()
            except Exception as error:  # noqa: BLE001 - raised by the answering loop below
                failed = error
            finally:
                ended = True
                changed.set()

        reader = asyncio.create_task(read())
        try:
            while True:
                if failed is not None:
                    raise failed
                if not due:
                    if ended:
                        return
                    changed.clear()
                    await changed.wait()
                    continue
                assert latest is not None
                step, new = latest, list(pending)
                due = False
                pending.clear()
                handle, proposal, timing = await self.propose(handle, new, step.num_speculative_tokens)
                yield handle, proposal, timing
                if step.fanout:
                    yield await self.draft_ahead(handle, step.fanout, step.branch_num_speculative_tokens,
                                                 step.branch_outcomes)
        finally:
            reader.cancel()

    async def draft_ahead(self, handle: Handle, fanout: int, branch_num_speculative_tokens: int,
                          branch_outcomes: int = 0) -> tuple[DraftedAhead, Timing]:
        """Branches for the outcomes of the proposal `handle` was answered with: for j = 0 .. K
        (j < branch_outcomes only, when that is > 0), "j drafts accepted, then t", t among the
        draft's top `fanout` candidates there (d(j+1) itself excluded: a rejected draft is never
        the correction; at the bonus position, sampled, first the draft's draw coupled to the
        target's: bonus_candidates), each with up to branch_num_speculative_tokens drafts. Their
        jobs are batched into the same passes."""
        started = time.perf_counter()

        def nothing() -> tuple[DraftedAhead, Timing]:
            return DraftedAhead(), Timing(0.0, time.perf_counter() - started)

        session = self.store.lookup(handle.session_id, handle.epoch)
        async with session.lock:
            state = session.state
            if session.committed_length != handle.committed_length or state.last is None:
                return nothing()
            drafted = state.last
            num_speculative_tokens = len(drafted.token_ids)
            room = self.loaded.max_context - (len(state.committed) + num_speculative_tokens + 1)
            branch_num_speculative_tokens = min(branch_num_speculative_tokens, room)
            if branch_num_speculative_tokens < 1:
                return nothing()
            candidates = [[t for t in drafted.candidates[j] if t != drafted.token_ids[j]]
                          for j in range(num_speculative_tokens)]
            bonus = bonus_cache = None
            if not 0 < branch_outcomes <= num_speculative_tokens:  # the bonus position is branched too
                try:
                    bonus = await self.worker.run_job(lambda: self.engine.bonus_logits(state),
                                                      on_behalf_of=handle.session_id)
                except Overloaded:  # drafting ahead is an optimisation: never a reason to fail
                    return nothing()
                bonus_cache, bonus_logits = bonus.value
                candidates.append(bonus_candidates(bonus_logits, state.sampling, round_start=len(state.committed)))
            outcomes = [(j, t) for j, tokens in enumerate(candidates)
                        if not 0 < branch_outcomes <= j for t in tokens[:fanout]]

            def job(j: int, t: int):
                parent = bonus_cache if j == num_speculative_tokens else state.cache
                return lambda: self.engine.branch(state, parent, j, t, branch_num_speculative_tokens)

            # Every branch job runs to its end (none is left half-fed) before a failure is raised.
            branched = await asyncio.gather(*(self.worker.run_job(job(j, t), on_behalf_of=handle.session_id)
                                              for j, t in outcomes),
                                            return_exceptions=True)
            failures = [timed for timed in branched if isinstance(timed, BaseException)]
            if any(isinstance(failure, Overloaded) for failure in failures):
                return nothing()
            if failures:
                raise failures[0]
            branches = [timed.value for timed in branched]
            state.branches = {(*drafted.token_ids[:b.num_accepted], b.next_token_id): b for b in branches}
            passes = branched or ([bonus] if bonus is not None else [])  # the bonus pass only if alone
            compute = (bonus.compute_seconds if bonus is not None else 0.0) + max(
                (t.compute_seconds for t in branched), default=0.0)
            rows = [t.pass_rows for t in passes] or [0.0]
            sessions = [t.pass_sessions for t in passes] or [0.0]
            first = bonus if bonus is not None else (branched[0] if branched else None)
            timing = Timing(compute, first.queue_seconds if first is not None else 0.0,
                            sum(rows) / len(rows), sum(sessions) / len(sessions))
            ahead = DraftedAhead(
                tuple(BranchProposal(b.num_accepted, b.next_token_id, b.drafted.proposal(fed_tokens=0))
                      for b in branches),
                tuple(tuple(c) for c in candidates))
            return ahead, timing


def check_branching(service: SessionService, fanout: int, branch_num_speculative_tokens: int,
                    branch_outcomes: int = 0) -> None:
    """Checks a Speculate's drafting-ahead fields against the service's limits."""
    if branch_outcomes < 0:
        raise OutOfRange(f"branch_outcomes must be >= 0, got {branch_outcomes}")
    if not 1 <= fanout <= NUM_CANDIDATES:
        raise OutOfRange(f"fanout must be in [1, {NUM_CANDIDATES}], got {fanout}")
    limit = service.config.max_num_speculative_tokens
    if not 1 <= branch_num_speculative_tokens <= limit:
        raise OutOfRange(f"branch_num_speculative_tokens must be in [1, {limit}], "
                         f"got {branch_num_speculative_tokens}")


def check_propose(service: SessionService, handle: Handle, new_committed: list[int],
                  num_speculative_tokens: int) -> int:
    """Checks a Propose against the service's limits; returns the committed length it leads to."""
    limit = service.config.max_num_speculative_tokens
    if not 1 <= num_speculative_tokens <= limit:
        raise OutOfRange(f"num_speculative_tokens must be in [1, {limit}], got {num_speculative_tokens}")
    check_token_ids(new_committed, service.loaded.vocab_size, "new_committed_token_ids")
    new_length = handle.committed_length + len(new_committed)
    if new_length + num_speculative_tokens > service.loaded.max_context:
        raise OutOfRange(f"drafting {num_speculative_tokens} tokens at length {new_length} exceeds "
                         f"the max context {service.loaded.max_context}")
    if new_length < 1:
        raise InvalidInput("the committed sequence is empty")
    return new_length
