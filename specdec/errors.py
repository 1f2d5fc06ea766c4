"""Domain errors. Services raise these; one interceptor (specdec.rpc.errors) maps them to gRPC
status codes. Nothing else should be turned into INTERNAL."""

from __future__ import annotations


class SpecdecError(Exception):
    """Base class of errors with a defined status code."""


class InvalidInput(SpecdecError):
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
