"""Malformed request bytes on any gRPC port: INVALID_ARGUMENT naming the message type, never UNKNOWN.

gRPC answers a request whose bytes its deserializer cannot parse (corrupt wire format, a string that is not
UTF-8, a message nested past protobuf's limit) with UNKNOWN ("Unexpected DecodeError"), before any
interceptor's check runs. `MalformedInterceptor`, the innermost interceptor of every server
(serving.new_server), gives each method a deserializer that returns a `Malformed` marker instead of
raising, and a behavior that answers the marker with INVALID_ARGUMENT; the outer interceptors (the cluster
credential, the API key) still check the call first.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc


@dataclass(frozen=True)
class Malformed:
    """Request bytes the method's deserializer refused."""

    problem: str


def _lenient(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def deserialize(raw: bytes) -> Any:
        try:
            return deserializer(raw)
        except Exception as e:  # DecodeError, RecursionError: whatever the bytes made the parser raise
            return Malformed(f"{type(e).__name__}: {e}")

    return deserialize


async def _refuse(context: grpc.aio.ServicerContext, method: str, bad: Malformed) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                        f"the request is not a valid message for {method} ({bad.problem[:300]})")


class MalformedInterceptor(grpc.aio.ServerInterceptor):
    """See the module docstring; put it last in a server's interceptors."""

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method = details.method
        behavior = (handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream)
        if not (inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior)):
            return handler  # a sync handler (an unimplemented method's UNIMPLEMENTED): left as it is

        async def checked_iterator(requests: AsyncIterator[Any], context) -> AsyncIterator[Any]:
            async for request in requests:
                if isinstance(request, Malformed):
                    await _refuse(context, method, request)
                yield request

        def arguments(request_or_iterator, context):
            if handler.request_streaming:
                return checked_iterator(request_or_iterator, context)
            return request_or_iterator

        async def unary(request_or_iterator, context):
            if isinstance(request_or_iterator, Malformed):
                await _refuse(context, method, request_or_iterator)
            return await behavior(arguments(request_or_iterator, context), context)

        async def streaming(request_or_iterator, context):  # an async generator's
            if isinstance(request_or_iterator, Malformed):
                await _refuse(context, method, request_or_iterator)
            async for response in behavior(arguments(request_or_iterator, context), context):
                yield response

        async def writing(request_or_iterator, context):  # a coroutine that writes with context.write
            if isinstance(request_or_iterator, Malformed):
                await _refuse(context, method, request_or_iterator)
            await behavior(arguments(request_or_iterator, context), context)

        kind = {(False, False): grpc.unary_unary_rpc_method_handler,
                (False, True): grpc.unary_stream_rpc_method_handler,
                (True, False): grpc.stream_unary_rpc_method_handler,
                (True, True): grpc.stream_stream_rpc_method_handler}[
            (handler.request_streaming, handler.response_streaming)]
        if not handler.response_streaming:
            run = unary
        else:
            run = streaming if inspect.isasyncgenfunction(behavior) else writing
        return kind(run,
                    request_deserializer=_lenient(handler.request_deserializer),
                    response_serializer=handler.response_serializer)
