"""What the draft and target services share above the model: sessions, the worker, Info and
expiry. Plain Python types (specdec.protocol); the servicers convert to and from protobuf."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from specdec import compute_units
from specdec.errors import InvalidInput, OutOfRange, SessionNotFound, Unavailable
from specdec.models import LoadedModel
from specdec.pass_lock import PassLock
from specdec.protocol import PROTOCOL_VERSION, Handle, ReplicaInfo, Timing, check_token_ids
from specdec.sessions import Session, SessionBudget, SessionStore, check_handle
from specdec.ragged import Job
from specdec.worker import BatchLimits, ModelWorker, Timed

log = logging.getLogger(__name__)
State = TypeVar("State")
Result = TypeVar("Result")


@dataclass(frozen=True)
class ServiceConfig:
    """Limits shared by the draft and target services."""

    replica_id: str
    budget: SessionBudget = SessionBudget()
    max_num_speculative_tokens: int = 16
    max_queue: int = 64  # calls waiting for the worker before RESOURCE_EXHAUSTED
    batch: BatchLimits = BatchLimits()  # what one forward pass may hold
    # A file the model services sharing these cores name alike: their passes take turns
    # (specdec.pass_lock). None: no turns (a service with cores of its own).
    pass_lock: Path | None = None

    def __post_init__(self) -> None:
        if not self.replica_id:
            raise ValueError("replica_id must not be empty")
        if not 1 <= self.max_num_speculative_tokens <= 256:
            raise ValueError("max_num_speculative_tokens must be in [1, 256]")


class SessionService(Generic[State]):
    """Sessions of one model on one replica. Subclasses add Prefill and Verify / Propose."""

    role = ""

    def __init__(self, loaded: LoadedModel, config: ServiceConfig, size_of: Callable[[State], int]):
        self.loaded = loaded
        self.config = config
        self.store: SessionStore[State] = SessionStore(config.budget, size_of)
        pass_lock = PassLock(config.pass_lock) if config.pass_lock is not None else None
        self.worker = ModelWorker(config.max_queue, config.batch, loaded.model, pass_lock)
        self.pass_lock_id = pass_lock.lock_id if pass_lock is not None else ""
        self.draining = False  # set on SIGTERM: existing sessions go on, new ones are refused
        # Where it computes (specdec/compute_units.py), after any --cpus pinning: Info reports it.
        self.host_id = compute_units.host_id()
        self.compute_units = compute_units.compute_units(loaded.device)

    def check_prompt(self, token_ids: list[int], what: str = "token_ids") -> None:
        if not token_ids:
            raise InvalidInput(f"{what} must not be empty")
        if len(token_ids) > self.loaded.max_context:
            raise OutOfRange(
                f"{what} has {len(token_ids)} tokens, more than the max context "
                f"{self.loaded.max_context}"
            )
        check_token_ids(token_ids, self.loaded.vocab_size, what)

    async def new_session(
        self, session_id: str, token_ids: list[int], build: Callable[[], Job[tuple[State, int, Result]]]
    ) -> tuple[Handle, Result, Timing]:
        """Runs the job build() (-> state, committed length, result) on the worker as a new epoch."""
        self._refuse_if_draining()
        with self.store.admission(session_id, len(token_ids)):
            timed = await self.run_job(build, session_id)
        state, committed_length, result = timed.value
        session = self.store.create(session_id, committed_length, state)
        return self._handle(session), result, _timing(timed)

    async def call(
        self, handle: Handle, apply: Callable[[State], Job[tuple[int, Result]]]
    ) -> tuple[Handle, Result, Timing]:
        """Applies the job apply(state) (-> new committed length, result) once per handle.

        A repeat of the last applied handle returns the stored answer; see specdec.sessions.
        """
        if handle.replica_id != self.config.replica_id:
            raise SessionNotFound(
                f"session {handle.session_id!r} belongs to replica {handle.replica_id!r}, "
                f"this is {self.config.replica_id!r}"
            )
        session = self.store.lookup(handle.session_id, handle.epoch)
        async with session.lock:
            replay = check_handle(session, handle.committed_length)
            if replay is not None:
                return replay

            def work() -> Job[tuple[Handle, Result]]:
                new_length, result = yield from apply(session.state)
                new_handle = self._handle(session, new_length)
                # Recorded on the worker, with the state change, so a caller cancelled meanwhile
                # cannot leave the cache advanced but the handle (or the replayable response)
                # not: its retry gets this very response (its timing filled in below).
                session.record(handle.committed_length, new_length, (new_handle, result, Timing(0.0, 0.0)))
                return new_handle, result

            timed = await self.run_job(work, handle.session_id)
            new_handle, result = timed.value
            timing = _timing(timed)
            session.last_response = (new_handle, result, timing)
            return new_handle, result, timing

    async def run_job(self, make_job: Callable[[], Job[Any]], session_id: str) -> Timed:
        """Runs a session's job: on the model worker, batched into its forward passes (a service
        without a model, draft_service/lookup_service.py, runs its jobs itself)."""
        return await self.worker.run_job(make_job, key=session_id)

    async def release(self, session_id: str) -> bool:
        return self.store.release(session_id)

    def info(self) -> ReplicaInfo:
        # Routers pick replicas by Info; one that is draining must not look like a candidate.
        self._refuse_if_draining()
        loaded = self.loaded
        return ReplicaInfo(
            protocol_version=PROTOCOL_VERSION,
            role=self.role,
            model_id=loaded.model_id,
            vocab_size=loaded.vocab_size,
            tokenizer_hash=loaded.tokenizer_hash,
            max_context=loaded.max_context,
            max_num_speculative_tokens=self.config.max_num_speculative_tokens,
            dtype=loaded.dtype,
            device=loaded.device,
            live_sessions=len(self.store),
            cached_tokens=self.store.cached_tokens(),
            load=self.worker.load,
            replica_id=self.config.replica_id,
            eos_token_ids=loaded.eos_token_ids,
            max_sessions=self.config.budget.max_sessions,
            max_cached_tokens=self.config.budget.max_cached_tokens,
            linear_packing=loaded.linear_packing,
            host_id=self.host_id,
            compute_units=self.compute_units,
            pass_lock=self.pass_lock_id,
            **dataclasses.asdict(self.worker.counters),
        )

    async def expire_forever(self, interval_seconds: float | None = None) -> None:
        """Drops idle sessions; by default checks four times per TTL (at most every 5 s)."""
        if interval_seconds is None:
            interval_seconds = min(5.0, self.config.budget.ttl_seconds / 4)
        while True:
            await asyncio.sleep(interval_seconds)
            for session_id in self.store.expire():
                log.info("session %s expired after %.0f s idle", session_id,
                         self.config.budget.ttl_seconds)

    @property
    def drained(self) -> bool:
        """No session, no prefill being admitted, no forward pass queued or running."""
        return len(self.store) == 0 and self.store.reserved_sessions == 0 and self.worker.idle

    async def drain(self, timeout_seconds: float) -> bool:
        """On SIGTERM: refuses new sessions (and Info, so routers stop picking this replica),
        keeps serving the calls of existing sessions until they are released or expire, or until
        timeout_seconds. True if it drained."""
        self.draining = True
        deadline = time.monotonic() + timeout_seconds
        while not self.drained and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if not self.drained:
            log.warning("drain timed out with %d sessions left", len(self.store))
        return self.drained

    def _refuse_if_draining(self) -> None:
        if self.draining:
            raise Unavailable(f"replica {self.config.replica_id} is shutting down: "
                              "it takes no new sessions")

    def _handle(self, session: Session[Any], committed_length: int | None = None) -> Handle:
        return Handle(
            session_id=session.session_id,
            replica_id=self.config.replica_id,
            committed_length=session.committed_length if committed_length is None else committed_length,
            epoch=session.epoch,
        )


def _timing(timed: Timed) -> Timing:
    return Timing(timed.compute_seconds, timed.queue_seconds, timed.pass_rows, timed.pass_sessions)
