"""Per-session state keyed by id, with handles, retries, budgets and expiry (docs/architecture.md,
"Handles and retries").

A handle names (session id, replica, committed length, epoch). A call whose handle matches the
session's current committed length is applied; a repeat of the last applied call gets the stored
response (never a second application); any other committed length is stale (ABORTED); an older
epoch or an unknown session is NOT_FOUND, and the orchestrator re-prefills.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from specdec.errors import InvalidInput, Overloaded, SessionNotFound, StaleHandle

State = TypeVar("State")
MAX_SESSION_ID_LENGTH = 128


@dataclass(frozen=True)
class SessionBudget:
    max_sessions: int = 64
    max_cached_tokens: int = 1_000_000
    ttl_seconds: float = 600.0  # idle sessions are dropped after this (an orchestrator died)

    def __post_init__(self) -> None:
        if self.max_sessions < 1 or self.max_cached_tokens < 1:
            raise ValueError("max_sessions and max_cached_tokens must be >= 1")
        if not self.ttl_seconds > 0:
            raise ValueError("ttl_seconds must be > 0")


@dataclass
class Session(Generic[State]):
    session_id: str
    epoch: int
    committed_length: int
    state: State
    last_used: float
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    replay_length: int = -1  # committed length of the handle that produced last_response
    last_response: Any = None

    def record(self, request_length: int, new_length: int, response: Any) -> None:
        """An applied call: remember its response for a retry of the same handle."""
        self.replay_length = request_length
        self.committed_length = new_length
        self.last_response = response


class SessionStore(Generic[State]):
    """Sessions of one replica. size_of(state) gives the tokens a session's caches hold."""

    def __init__(
        self,
        budget: SessionBudget,
        size_of: Callable[[State], int],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.budget = budget
        self._size_of = size_of
        self._clock = clock
        self._sessions: dict[str, Session[State]] = {}
        self._epochs = itertools.count(1)
        self._reserved_sessions = 0  # prefills admitted and still running
        self._reserved_tokens = 0

    def __len__(self) -> int:
        return len(self._sessions)

    @property
    def reserved_sessions(self) -> int:
        """Prefills admitted and still running."""
        return self._reserved_sessions

    def cached_tokens(self) -> int:
        # list(): the metrics thread reads this while the event loop may add sessions
        return sum(self._size_of(s.state) for s in list(self._sessions.values()))

    @contextmanager
    def admission(self, session_id: str, new_tokens: int) -> Iterator[None]:
        """Reserves room for a new session of new_tokens while its prefill runs.

        Raises Overloaded (RESOURCE_EXHAUSTED) past the budget; existing sessions are unaffected.
        """
        validate_session_id(session_id)
        replacing = self._sessions.get(session_id)
        others = len(self._sessions) - (replacing is not None) + self._reserved_sessions
        if others >= self.budget.max_sessions:
            raise Overloaded(f"session budget exhausted ({self.budget.max_sessions} sessions)")
        held = self.cached_tokens() + self._reserved_tokens
        held -= self._size_of(replacing.state) if replacing else 0
        if held + new_tokens > self.budget.max_cached_tokens:
            raise Overloaded(
                f"cached-token budget exhausted ({held} held + {new_tokens} requested > "
                f"{self.budget.max_cached_tokens})"
            )
        self._reserved_sessions += 1
        self._reserved_tokens += new_tokens
        try:
            yield
        finally:
            self._reserved_sessions -= 1
            self._reserved_tokens -= new_tokens

    def create(self, session_id: str, committed_length: int, state: State) -> Session[State]:
        """Adds (or replaces, under a new epoch) a session."""
        session = Session(
            session_id=session_id,
            epoch=next(self._epochs),
            committed_length=committed_length,
            state=state,
            last_used=self._clock(),
        )
        self._sessions[session_id] = session
        return session

    def lookup(self, session_id: str, epoch: int) -> Session[State]:
        session = self._sessions.get(session_id)
        if session is None:
            raise SessionNotFound(f"unknown session {session_id!r} (released, expired or never made)")
        if epoch != session.epoch:
            raise SessionNotFound(
                f"session {session_id!r} handle is from epoch {epoch}, the session is at epoch "
                f"{session.epoch}"
            )
        session.last_used = self._clock()
        return session

    def get(self, session_id: str) -> Session[State] | None:
        """The session, if held (no epoch check, no touch: for its owner's bookkeeping)."""
        return self._sessions.get(session_id)

    def release(self, session_id: str) -> bool:
        return self._sessions.pop(session_id, None) is not None

    def expire(self) -> list[str]:
        """Drops sessions idle for longer than the TTL; returns their ids."""
        deadline = self._clock() - self.budget.ttl_seconds
        expired = [sid for sid, s in self._sessions.items() if s.last_used < deadline and not s.lock.locked()]
        for sid in expired:
            del self._sessions[sid]
        return expired


def check_handle(session: Session[Any], committed_length: int) -> Any:
    """None if a call at committed_length should be applied now; the stored response if it is a
    repeat of the last applied call. Raises StaleHandle otherwise. Call with session.lock held."""
    if committed_length == session.committed_length:
        return None
    if committed_length == session.replay_length and session.last_response is not None:
        return session.last_response
    raise StaleHandle(
        f"session {session.session_id!r} is at committed length {session.committed_length}, "
        f"the handle says {committed_length}"
    )


def validate_session_id(session_id: str) -> None:
    if not session_id or len(session_id) > MAX_SESSION_ID_LENGTH:
        raise InvalidInput(f"session_id must be 1..{MAX_SESSION_ID_LENGTH} characters")
