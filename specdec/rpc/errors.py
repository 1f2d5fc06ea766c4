"""The one error map: domain errors to gRPC status codes, applied to every handler."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from specdec import errors

log = logging.getLogger(__name__)

STATUS_OF: dict[type[errors.SpecdecError], grpc.StatusCode] = {
    errors.InvalidInput: grpc.StatusCode.INVALID_ARGUMENT,
    errors.OutOfRange: grpc.StatusCode.OUT_OF_RANGE,
    errors.SessionNotFound: grpc.StatusCode.NOT_FOUND,
    errors.StaleHandle: grpc.StatusCode.ABORTED,
    errors.Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.IncompatibleModels: grpc.StatusCode.FAILED_PRECONDITION,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
    errors.Refused: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.ReplicaError: grpc.StatusCode.UNAVAILABLE,
}


def status_of(error: errors.SpecdecError) -> grpc.StatusCode:
    for kind in type(error).__mro__:
        if kind in STATUS_OF:
            return STATUS_OF[kind]
    return grpc.StatusCode.INTERNAL


def _wrap_unary(behavior: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await behavior(request, context)
        except errors.SpecdecError as error:
            await context.abort(status_of(error), str(error))

    return wrapped


def _wrap_stream(behavior: Callable[..., Any]) -> Callable[..., Any]:
    if not inspect.isasyncgenfunction(behavior):
        # A coroutine that streams with context.write() (e.g. grpc's aio Health.Watch).
        return _wrap_unary(behavior)

    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            async for response in behavior(request, context):
                yield response
        except errors.SpecdecError as error:
            await context.abort(status_of(error), str(error))

    return wrapped


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Turns SpecdecError subclasses raised by handlers into their status codes."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(
                _wrap_stream(handler.stream_stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler
