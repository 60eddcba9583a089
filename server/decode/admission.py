"""A Decode call's admission: its checks, its place in the engine's queue, its wait for blocks.

Life cycle of a call here (`service.py` `DecodeService.Decode` runs it):
1. `admit`: a draining worker refuses it (UNAVAILABLE), a request id already decoding here too (ALREADY_EXISTS),
   a bad request or an unknown Steps stream (INVALID_ARGUMENT, `request_problem`, `stream_problem`); a structured
   request's grammar is compiled (INVALID_ARGUMENT when it cannot be); the engine queues it (RESOURCE_EXHAUSTED
   with a retry hint when its queue is full, INVALID_ARGUMENT when it refuses it).
2. `until_admitted`: a `queued` response every QUEUED_EVERY_S while it waits for blocks (the call's deadline
   bounds the wait); then `reserved` says what it holds.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Container

import grpc
from pdserve.server import request_checks, serving
from pdserve.server.decode.engine_api import Engine
from pdserve.server.decode.scheduler import QueueFull
from pdserve.server.decode.sequence import Sequence, TokenSink
from pdserve.server.structured.output_spec import SpecError
from pdserve.v1 import worker_pb2 as pb

QUEUED_EVERY_S = 1.0
"""While a request waits for blocks (queued, or preempted), a `queued` event this often: the worker is alive."""


def request_problem(request: pb.DecodeRequest, vocab_size: int, max_model_len: int) -> str | None:
    """What is wrong with a DecodeRequest, whoever sent it (INVALID_ARGUMENT), or None."""
    remaining = request.sampling.max_tokens - request.num_output_tokens
    return (request_checks.identity_problem(request.request_id, request.transfer_token)
            or request_checks.ids_problem("prompt_token_ids", request.prompt_token_ids, vocab_size)
            or request_checks.sampling_problem(request.sampling, vocab_size)
            or (f"num_output_tokens {request.num_output_tokens} must be below sampling.max_tokens "
                f"{request.sampling.max_tokens}" if remaining <= 0 else None)
            # max_tokens is a limit, not a reservation: the prompt must leave room for one token
            or request_checks.length_problem("prompt_token_ids", len(request.prompt_token_ids), 1, max_model_len)
            or request_checks.lease_problem(request.lease_seconds))


def stream_problem(stream_id: str, open_streams: Container[str]) -> str | None:
    """A Steps stream the request names that is not open here (INVALID_ARGUMENT), or None."""
    if stream_id and stream_id not in open_streams:
        return f"no Steps stream {stream_id!r} is open here: open it (Steps) before naming it"
    return None


async def admit(engine: Engine, request: pb.DecodeRequest, sink: TokenSink, context: grpc.aio.ServicerContext, *,
                draining: bool, open_streams: Container[str]) -> Sequence:
    """The request's sequence in the engine's queue, its output going to `sink`; or the call aborted with the
    status that says why not (the module's step 1)."""
    rid = request.request_id
    if draining:
        await context.abort(grpc.StatusCode.UNAVAILABLE, "decode worker is draining; pick another")
    if rid in engine.sequences:
        await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request {rid} is already decoding here")
    problem = (request_problem(request, engine.vocab_size, engine.max_model_len)
               or stream_problem(request.steps_stream_id, open_streams))
    if problem:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
    if request.sampling.structured.WhichOneof("kind") and engine.grammars is not None:
        try:  # compiled off the loop, in bounded time; `add` takes it from the cache
            await engine.grammars.prepare(request.sampling.structured)
        except SpecError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
    try:
        return engine.add(request, sink)
    except QueueFull as e:
        await context.send_initial_metadata(serving.retry_hint())
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{e}; you may retry")
    except ValueError as e:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))


async def until_admitted(engine: Engine, seq: Sequence) -> AsyncIterator[pb.DecodeResponse]:
    """`queued` responses, its place in the engine's queue, until the sequence holds its blocks (or ended)."""
    while not seq.admitted.done():
        yield pb.DecodeResponse(queued=pb.Queued(position=engine.position(seq)))
        await asyncio.wait([seq.admitted], timeout=QUEUED_EVERY_S)


def reserved(seq: Sequence, local_prefill: bool = False) -> pb.DecodeResponse:
    """What the admitted sequence holds: its blocks, those of them hit in the prefix cache; whether this worker
    computes the rest of its prompt."""
    return pb.DecodeResponse(reserved=pb.Reserved(num_blocks=len(seq.block_table), cached_blocks=seq.num_hit_blocks,
                                                  local_prefill=local_prefill))
