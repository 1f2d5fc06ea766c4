"""Bearer-token authentication of the orchestrator's public API.

Every call must carry the metadata `authorization: Bearer <token>`; a missing or wrong token gets
UNAUTHENTICATED before the handler runs. Health (grpc.health.v1) stays open, because probes and
load balancers carry no token. The token comes from a file (a Kubernetes Secret mounted as one)
or the SPECDEC_AUTH_TOKEN environment variable; a server takes several, one per line (several
clients, each with its own token: state shared across requests, such as the orchestrator's
shared suffix cache, is then kept apart per token).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Awaitable, Callable, Iterable, Sequence
from pathlib import Path

import grpc

TOKEN_ENV = "SPECDEC_AUTH_TOKEN"
OPEN_PREFIXES = ("/grpc.health.v1.Health/",)
METADATA_KEY = "authorization"
SCHEME = "bearer "


def load_token(token_file: Path | None, environ: dict[str, str] | None = None) -> str | None:
    """The token from token_file if given, else from $SPECDEC_AUTH_TOKEN; None if neither is set.

    Surrounding whitespace (a trailing newline in a Secret) is dropped; an empty token is an error,
    since it would let any caller in."""
    environ = os.environ if environ is None else environ
    if token_file is not None:
        token, source = token_file.read_text(encoding="utf-8").strip(), str(token_file)
    elif environ.get(TOKEN_ENV) is not None:
        token, source = environ[TOKEN_ENV].strip(), f"${TOKEN_ENV}"
    else:
        return None
    if not token:
        raise ValueError(f"the auth token in {source} is empty")
    return token


def bearer_token_matches(value: str | None, token: str) -> bool:
    """Whether an authorization value ("Bearer <token>", the scheme in any case) carries `token`.
    Compared in constant time, so response timing does not reveal how much of a guess matched.
    Shared by the gRPC interceptor below and the HTTP API (orchestrator/http_api.py)."""
    if not value or value[: len(SCHEME)].lower() != SCHEME:
        return False
    return hmac.compare_digest(value[len(SCHEME):].strip().encode(), token.encode())


def load_tokens(token_file: Path | None, environ: dict[str, str] | None = None) -> tuple[str, ...] | None:
    """The tokens a server accepts: one per line of token_file if given, else of
    $SPECDEC_AUTH_TOKEN; None if neither is set. Several tokens are several clients, each with its
    own (a shared suffix cache is then partitioned per token: orchestrator/local_draft.py).
    Blank lines and surrounding whitespace are dropped; no token at all is an error."""
    environ = os.environ if environ is None else environ
    if token_file is not None:
        text, source = token_file.read_text(encoding="utf-8"), str(token_file)
    elif environ.get(TOKEN_ENV) is not None:
        text, source = environ[TOKEN_ENV], f"${TOKEN_ENV}"
    else:
        return None
    tokens = tuple(dict.fromkeys(line.strip() for line in text.splitlines() if line.strip()))
    if not tokens:
        raise ValueError(f"the auth token in {source} is empty")
    return tokens


def matching_token(value: str | None, tokens: Sequence[str]) -> str | None:
    """The token of `tokens` that an authorization value carries, or None. Every token is
    compared (in constant time), so timing reveals neither a guess's progress nor which matched."""
    found = None
    for token in tokens:
        if bearer_token_matches(value, token):
            found = token
    return found


def token_partition(token: str | None) -> str:
    """The name of a caller's partition of shared state: "" without a token, else a digest of
    the token (the token itself is kept nowhere but in the configuration)."""
    if token is None:
        return ""
    return hashlib.sha256(token.encode()).hexdigest()[:16]


def metadata_authorization(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The bearer authorization value of call metadata, if any."""
    for key, value in metadata or ():
        if key.lower() == METADATA_KEY and isinstance(value, str) and value[: len(SCHEME)].lower() == SCHEME:
            return value
    return None


def bearer_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """Call metadata that authenticates a client."""
    return ((METADATA_KEY, f"Bearer {token}"),)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Lets through the calls that carry one of the tokens (one token, or several clients')."""

    def __init__(self, token: str | Sequence[str]) -> None:
        self.tokens: tuple[str, ...] = (token,) if isinstance(token, str) else tuple(token)
        if not self.tokens or not all(self.tokens):
            raise ValueError("the auth token must not be empty")

    def _authenticated(self, metadata: tuple[tuple[str, str | bytes], ...] | None) -> bool:
        return matching_token(metadata_authorization(metadata), self.tokens) is not None

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method or ""
        if handler is None or method.startswith(OPEN_PREFIXES):
            return handler
        if self._authenticated(handler_call_details.invocation_metadata):
            return handler
        return _refusal(handler)


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind that answers UNAUTHENTICATED without reading the request."""

    async def refuse(request: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                            "missing or wrong bearer token (metadata 'authorization: Bearer <token>')")

    def raw(data: bytes) -> bytes:  # never parse what an unauthenticated caller sent
        return data

    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(refuse, request_deserializer=raw)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(refuse, request_deserializer=raw)
    if handler.stream_stream is not None:
        return grpc.stream_stream_rpc_method_handler(refuse, request_deserializer=raw)
    return grpc.unary_unary_rpc_method_handler(refuse, request_deserializer=raw)
