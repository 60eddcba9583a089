"""pdserve.v1.Generation: one request's life in the coordinator.

1. Validate and tokenize (`validate.py`); the workers get every sampling default explicitly.
2. Pick a decode worker D (most free KV blocks) and a prefill worker P (least queued) (`router.py`).
3. Open `D.Decode`, a stream: its first message, `reserved`, means D holds blocks for the request
   under a lease. A refusal before it (RESOURCE_EXHAUSTED, ...) goes to the client as it is.
4. Call `P.Prefill` with D as the KV target and the request's transfer token. P returns the first
   token at once; it goes to the client before the KV reaches D (P pushes it to D itself).
5. Read D's stream: `tokens` are the ids after the first; `finished` ends it. The ids are
   detokenized incrementally and cut at the first stop string (then D's call is cancelled, which
   frees its blocks). The last message carries finish_reason and usage.
6. Client cancel, deadline or error: both worker calls are cancelled, so both workers free everything.
   A worker failing mid-stream ends the call with UNAVAILABLE naming it (retries: a later seam).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator

import grpc

from pdserve.v1 import generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from server.coordinator.detokenizer import Completion
from server.coordinator.router import Worker, WorkerPool
from server.coordinator.validate import InvalidRequest, Limits, ValidRequest, validate
from server.model.tokenizer import Tokenizer

log = logging.getLogger("pdserve.coordinator")

FinishReason = generation_pb2.FinishReason
TRANSFER_TOKEN_BYTES = 16
LONG_TEXT_CHARS = 16_384
"""Text prompts longer than this are tokenized off the event loop."""

_WORKER_GONE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED)
_FORWARDED_METADATA = ("retry-after-ms",)
"""A refusing worker's hints that reach the client (as trailing metadata)."""


class RequestFailed(Exception):
    """Ends the client's call with this status."""

    def __init__(self, code: grpc.StatusCode, details: str, metadata: tuple[tuple[str, str], ...] = ()):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.metadata = metadata


class GenerationService(generation_pb2_grpc.GenerationServicer):
    def __init__(self, tokenizer: Tokenizer, limits: Limits, pool: WorkerPool, lease_seconds: float):
        self.tokenizer = tokenizer
        self.limits = limits
        self.pool = pool
        self.lease_seconds = lease_seconds

    async def Generate(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        try:
            valid = await self._validate(request)
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        # context.write (not yield) keeps every await inside this task, and aclosing runs the
        # stream's cleanup (cancelling the worker calls) the moment the client's call ends.
        responses = self._generate(valid, context.time_remaining())
        try:
            async with contextlib.aclosing(responses):
                async for response in responses:
                    await context.write(response)
        except RequestFailed as e:
            log.warning("request %s failed: %s", valid.request_id, e)
            await context.abort(e.code, e.details, e.metadata)

    async def stream(
        self, request: generation_pb2.GenerateRequest, timeout: float | None = None
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """The request path every front shares (gRPC, HTTP, KServe): validate, route, stream.

        Raises InvalidRequest (bad input) or RequestFailed (a status for the client). Closing the
        iterator (`contextlib.aclosing`) cancels both worker calls.
        """
        valid = await self._validate(request)
        async with contextlib.aclosing(self._generate(valid, timeout)) as responses:
            async for response in responses:
                yield response

    async def _validate(self, request: generation_pb2.GenerateRequest) -> ValidRequest:
        if len(request.text) > LONG_TEXT_CHARS:
            return await asyncio.to_thread(validate, request, self.tokenizer, self.limits)
        return validate(request, self.tokenizer, self.limits)

    async def _generate(
        self, req: ValidRequest, timeout: float | None
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        decode, prefill = self.pool.pick_decode(), self.pool.pick_prefill()
        if decode is None or prefill is None:
            missing = "decode" if decode is None else "prefill"
            raise RequestFailed(grpc.StatusCode.UNAVAILABLE, f"no ready {missing} worker")
        attempt = 0  # retries and migration will count attempts up
        # Workers key requests by this id; clients may reuse theirs, so make it unique here.
        worker_request_id = f"{req.request_id}.{secrets.token_hex(4)}"
        transfer_token = secrets.token_bytes(TRANSFER_TOKEN_BYTES)
        completion = Completion(self.tokenizer, req.prompt_ids, list(req.sampling.stop))
        assert decode.channel is not None
        decode_call = worker_pb2_grpc.DecodeStub(decode.channel).Decode(
            worker_pb2.DecodeRequest(
                request_id=worker_request_id,
                attempt=attempt,
                prompt_token_ids=req.prompt_ids,
                sampling=req.sampling,
                transfer_token=transfer_token,
                lease_seconds=self.lease_seconds,
                num_output_tokens=0,
            ),
            timeout=timeout,
        )
        decode.inflight += 1
        # Count the blocks now, so requests routed before the next GetInfo see them taken.
        reserved = decode.blocks_for(len(req.prompt_ids) + req.sampling.max_tokens - 1)
        decode.reserved_blocks += reserved
        try:
            await self._read_reserved(decode, decode_call)
            first = await self._prefill(prefill, decode, req, worker_request_id, attempt, transfer_token, timeout)
            ids, text = completion.add([first])
            if completion.stopped:
                yield _response(req, completion, ids, text, FinishReason.FINISH_REASON_STOP)
                return
            yield _response(req, completion, ids, text)

            while True:
                message = await self._read_decode(decode, decode_call)
                if message.WhichOneof("event") == "tokens":
                    ids, text = completion.add(list(message.tokens.token_ids))
                    if completion.stopped:
                        decode_call.cancel()  # frees the decode worker's blocks now
                        yield _response(req, completion, ids, text, FinishReason.FINISH_REASON_STOP)
                        return
                    if ids or text:
                        yield _response(req, completion, ids, text)
                elif message.WhichOneof("event") == "finished":
                    reason = self._finish_reason(decode, message.finished)
                    text = completion.finish()
                    if completion.stopped:
                        reason = FinishReason.FINISH_REASON_STOP
                    yield _response(req, completion, [], text, reason)
                    # The worker ends its stream right after `finished`: wait briefly for that, so
                    # the call completes rather than being cancelled.
                    with contextlib.suppress(TimeoutError, grpc.aio.AioRpcError):
                        await asyncio.wait_for(decode_call.read(), 1.0)
                    return
        finally:
            decode.inflight -= 1
            decode.reserved_blocks -= reserved
            if not decode_call.done():
                decode_call.cancel()

    async def _prefill(
        self,
        prefill: Worker,
        decode: Worker,
        req: ValidRequest,
        worker_request_id: str,
        attempt: int,
        transfer_token: bytes,
        timeout: float | None,
    ) -> int:
        """The first token; the prefill worker then pushes the KV to the decode worker itself."""
        assert prefill.channel is not None and decode.info is not None
        call = worker_pb2_grpc.PrefillStub(prefill.channel).Prefill(
            worker_pb2.PrefillRequest(
                request_id=worker_request_id,
                attempt=attempt,
                token_ids=req.prompt_ids,
                sampling=req.sampling,
                target=worker_pb2.KvTarget(address=decode.address, layout=decode.info.kv_layout),
                transfer_token=transfer_token,
                sample_index=0,
            ),
            timeout=timeout,
        )
        prefill.inflight += 1
        prefill.pending_tokens += len(req.prompt_ids)
        try:
            return (await call).first_token_id
        except grpc.aio.AioRpcError as e:
            raise await self._refused(prefill, e) from e
        finally:
            prefill.inflight -= 1
            prefill.pending_tokens -= len(req.prompt_ids)
            if not call.done():
                call.cancel()

    async def _read_decode(self, decode: Worker, call: grpc.aio.UnaryStreamCall) -> worker_pb2.DecodeResponse:
        """The next `tokens` or `finished` event after `reserved`."""
        try:
            message = await call.read()
        except grpc.aio.AioRpcError as e:
            raise await self._failed_mid_stream(decode, e) from e
        if message is grpc.aio.EOF:
            raise RequestFailed(
                grpc.StatusCode.UNAVAILABLE,
                f"decode worker {decode.address} ended the stream without finishing the request",
            )
        if message.WhichOneof("event") not in ("tokens", "finished"):
            raise RequestFailed(
                grpc.StatusCode.INTERNAL,
                f"decode worker {decode.address} sent {message.WhichOneof('event')!r} mid-stream",
            )
        return message

    @staticmethod
    def _finish_reason(decode: Worker, finished: worker_pb2.Finished) -> int:
        if finished.reason == FinishReason.FINISH_REASON_ERROR:
            raise RequestFailed(
                grpc.StatusCode.INTERNAL, f"decode worker {decode.address}: {finished.message}"
            )
        if finished.reason == FinishReason.FINISH_REASON_UNSPECIFIED:
            raise RequestFailed(
                grpc.StatusCode.INTERNAL, f"decode worker {decode.address} finished without a reason"
            )
        return finished.reason

    async def _read_reserved(self, decode: Worker, call: grpc.aio.UnaryStreamCall) -> None:
        try:
            message = await call.read()
        except grpc.aio.AioRpcError as e:
            raise await self._refused(decode, e) from e
        if message is grpc.aio.EOF:
            raise RequestFailed(
                grpc.StatusCode.UNAVAILABLE,
                f"decode worker {decode.address} ended the stream before reserving",
            )
        event = message.WhichOneof("event")
        if event == "reserved":
            return
        if event == "finished" and message.finished.reason == FinishReason.FINISH_REASON_ERROR:
            raise RequestFailed(
                grpc.StatusCode.INTERNAL, f"decode worker {decode.address}: {message.finished.message}"
            )
        raise RequestFailed(
            grpc.StatusCode.INTERNAL, f"decode worker {decode.address} sent {event!r} before 'reserved'"
        )

    async def _refused(self, worker: Worker, e: grpc.aio.AioRpcError) -> RequestFailed:
        """A worker call failed before any output: the client gets its status, unless the worker is gone."""
        if e.code() not in _WORKER_GONE:
            hints = [*(e.initial_metadata() or ()), *(e.trailing_metadata() or ())]
            return RequestFailed(
                e.code(),
                e.details() or f"{worker.role} worker {worker.address}: {e.code().name}",
                tuple((k, v) for k, v in hints if k in _FORWARDED_METADATA),
            )
        return await self._gone(worker, e)

    async def _failed_mid_stream(self, worker: Worker, e: grpc.aio.AioRpcError) -> RequestFailed:
        if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return RequestFailed(e.code(), e.details() or "deadline exceeded")
        return await self._gone(worker, e)

    async def _gone(self, worker: Worker, e: grpc.aio.AioRpcError) -> RequestFailed:
        if e.code() == grpc.StatusCode.UNAVAILABLE:
            await self.pool.mark_failed(worker, e.details() or "")
        return RequestFailed(
            grpc.StatusCode.UNAVAILABLE,
            f"{worker.role} worker {worker.address} failed: {e.code().name}: {e.details()}",
        )


def _response(
    req: ValidRequest,
    completion: Completion,
    ids: list[int],
    text: str,
    reason: int = FinishReason.FINISH_REASON_UNSPECIFIED,
) -> generation_pb2.GenerateResponse:
    """One message to the client; the last one (with a finish reason) carries the usage."""
    out = generation_pb2.GenerateResponse(request_id=req.request_id, token_ids=ids, text=text)
    if reason != FinishReason.FINISH_REASON_UNSPECIFIED:
        out.finish_reason = reason  # type: ignore[assignment]
        out.usage.prompt_tokens = len(req.prompt_ids)
        out.usage.completion_tokens = completion.num_tokens
    return out
