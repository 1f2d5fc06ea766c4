"""Domain errors. Services raise these; one interceptor (specdec.rpc.errors) maps them to gRPC
status codes. Nothing else should be turned into INTERNAL."""

from __future__ import annotations


class SpecdecError(Exception):
    """Base class of errors with a defined status code."""


class InvalidInput(SpecdecError, ValueError):
    """A malformed request: INVALID_ARGUMENT."""


class OutOfRange(SpecdecError):
    """A value outside what this server supports (context, K, vocabulary): OUT_OF_RANGE."""


class SessionNotFound(SpecdecError):
    """Unknown session, or a handle from an older epoch: NOT_FOUND. The caller re-prefills."""


class StaleHandle(SpecdecError):
    """A handle whose committed length is not the session's current one: ABORTED."""


class Overloaded(SpecdecError):
    """Session or token budget exhausted, or the worker queue is full: RESOURCE_EXHAUSTED."""


class IncompatibleModels(SpecdecError):
    """Draft and target disagree on vocabulary or tokenizer: FAILED_PRECONDITION."""


class Unavailable(SpecdecError):
    """No replica can serve, or the server is shutting down: UNAVAILABLE."""


# What a replica's client raises (orchestrator/clients.py): the caller decides what to do about a
# replica's failure from these kinds, never from a status code or a message.


class ReplicaError(SpecdecError):
    """A draft or target replica answered a call with an error that no other kind below covers
    (the orchestrator reports it as UNAVAILABLE if it cannot work around it)."""

    def __init__(self, address: str, message: str) -> None:
        super().__init__(f"{address}: {message}")
        self.address = address


class SessionLost(ReplicaError):
    """The replica no longer has the session, or it is out of step there (NOT_FOUND, ABORTED):
    rebuild it from the committed tokens."""


class ReplicaLost(ReplicaError):
    """The replica did not answer, stalled past the deadline, or failed (UNAVAILABLE,
    DEADLINE_EXCEEDED, CANCELLED, INTERNAL, UNKNOWN): rebuild the session elsewhere."""


class Refused(ReplicaError):
    """The replica is at its session or queue budget (RESOURCE_EXHAUSTED) and holds nothing of
    the call: another replica may take it."""
