"""pdserve.v1.Generation: one request's life in the coordinator.

1. Validate and tokenize (`validate.py`); the workers get every sampling default explicitly. One
   deadline (the client's, or `default_timeout`) bounds everything after this.
2. Admission (`admission.py`): a decode worker D with room (by the decode policy), else wait in the
   decode queue; a prefill worker P (least queued), else wait in the prefill queue. No prefill worker
   alive: D prefills the prompt itself (a fallback, counted).
3. Open `D.Decode`, a stream: its first message, `reserved`, means D holds blocks for the request
   under a lease. A refusal before it (RESOURCE_EXHAUSTED, ...) goes to the client as it is.
4. Call `P.Prefill` with D's KV endpoint as the target and the attempt's transfer token. P returns the
   first token at once; it goes to the client before the KV reaches D (P pushes it to D itself).
5. Read D's stream: `tokens` are the ids after the first; `finished` ends it. The ids are
   detokenized incrementally and cut at the first stop string (then D's call is cancelled, which
   frees its blocks). The last message carries finish_reason and usage.
6. Failures. P dies or fails before the KV arrives: the attempt is retried (attempt + 1, a fresh
   transfer token, so the dead attempt's chunks are refused) on another P. D dies mid-stream: the
   request migrates: prompt + the tokens already sent are prefilled again on a live pair, whose
   first token is the next one, so nothing is lost or repeated (at most `max_migrations` times).
7. Client cancel, deadline or error: both worker calls are cancelled, so both workers free everything.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from pdserve.v1 import generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from pdserve.server import logs, metrics
from pdserve.server.coordinator.admission import Deadline, RequestFailed, TierQueue
from pdserve.server.coordinator.detokenizer import Completion
from pdserve.server.coordinator.prefill_estimate import admit
from pdserve.server.coordinator.router import Worker, WorkerPool
from pdserve.server.coordinator.validate import InvalidRequest, Limits, ValidRequest, validate
from pdserve.server.model.tokenizer import Tokenizer

log = logging.getLogger("pdserve.coordinator")

__all__ = ["GenerationService", "InvalidRequest", "RequestFailed"]

FinishReason = generation_pb2.FinishReason
FINISH_NAMES = {
    FinishReason.FINISH_REASON_STOP: "stop",
    FinishReason.FINISH_REASON_LENGTH: "length",
    FinishReason.FINISH_REASON_ABORT: "abort",
}
TRANSFER_TOKEN_BYTES = 16
LONG_TEXT_CHARS = 16_384
"""Text prompts longer than this are tokenized off the event loop."""

_WORKER_GONE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED)
_FORWARDED_METADATA = ("retry-after-ms",)
"""A refusing worker's hints that reach the client (as trailing metadata)."""


class _Lost(Exception):
    """A worker died or failed this attempt in a way another attempt can recover from."""

    def __init__(self, worker: Worker, message: str):
        super().__init__(message)
        self.worker = worker
        self.message = message


@dataclass
class _Request:
    """One client request across its attempts."""

    req: ValidRequest
    deadline: Deadline
    worker_request_id: str
    outputs: list[int] = field(default_factory=list)
    """Every token id sent on to the client so far (a migration continues after them)."""
    attempt: int = 0
    retries: int = 0
    migrations: int = 0
    last_failure: str = ""
    """Why the previous attempt was lost."""
    prompt_logprobs: list[generation_pb2.TokenLogprob] | None = None
    """From the prefill (when asked for); None until it answered, [] once sent on."""

    @property
    def sampling(self) -> generation_pb2.SamplingParams:
        """What the workers get: the prompt's logprobs only until they have arrived."""
        s = self.req.sampling
        if self.prompt_logprobs is None or not s.HasField("prompt_logprobs"):
            return s
        without = generation_pb2.SamplingParams()
        without.CopyFrom(s)
        without.ClearField("prompt_logprobs")
        return without

    def take_prompt_logprobs(self) -> list[generation_pb2.TokenLogprob]:
        """The prompt's logprobs for the next message to the client: once."""
        out = self.prompt_logprobs or []
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = []
        return out

    @property
    def worker_id(self) -> str:
        return self.worker_request_id if self.attempt == 0 else f"{self.worker_request_id}.a{self.attempt}"


class GenerationService(generation_pb2_grpc.GenerationServicer):
    def __init__(
        self,
        tokenizer: Tokenizer,
        limits: Limits,
        pool: WorkerPool,
        lease_seconds: float,
        *,
        default_timeout: float = 600.0,
        max_queue: int = 256,
        max_migrations: int = 2,
        max_retries: int = 3,
        prefill_inflight_per_worker: int = 64,
        stall_timeout: float | None = None,
        ttft_budget: float = 0.0,
    ):
        self.tokenizer = tokenizer
        self.limits = limits
        self.pool = pool
        self.lease_seconds = lease_seconds
        self.default_timeout = default_timeout
        self.max_migrations = max_migrations
        self.max_retries = max_retries
        self.prefill_inflight_per_worker = prefill_inflight_per_worker
        self.stall_timeout = stall_timeout
        """A decode stream silent this long is lost (then migrated) as if its worker had died; None: never."""
        self.ttft_budget = ttft_budget
        self.decode_queue = TierQueue("decode", max_queue)
        self.prefill_queue = TierQueue("prefill", max_queue)
        self.eos_ids = frozenset(getattr(tokenizer, "eos_token_ids", ()) or ())

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
        try:
            if len(request.text) > LONG_TEXT_CHARS:
                return await asyncio.to_thread(validate, request, self.tokenizer, self.limits)
            return validate(request, self.tokenizer, self.limits)
        except InvalidRequest:
            metrics.request_failure.labels(grpc.StatusCode.INVALID_ARGUMENT.name).inc()
            raise

    # ---- one request, across attempts ---------------------------------------------------

    async def _generate(
        self, req: ValidRequest, timeout: float | None
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        logs.request_id.set(req.request_id)
        arrived = time.monotonic()
        # Workers key requests by this id; clients may reuse theirs, so make it unique here.
        r = _Request(req, Deadline.after(timeout if timeout is not None else self.default_timeout),
                     f"{req.request_id}.{secrets.token_hex(4)}")
        completion = Completion(self.tokenizer, req.prompt_ids, list(req.sampling.stop), req.sampling.min_tokens)
        metrics.prompt_tokens.inc(len(req.prompt_ids))
        last_token_at: float | None = None
        outcome = "abort"  # a client cancel ends the generator without either of the others
        try:
            while True:
                reason = self._already_finished(r)
                if reason is not None:
                    outcome = FINISH_NAMES[reason]
                    yield self._with_stop_reason(
                        _response(req, completion, [], completion.finish(), reason, r.take_prompt_logprobs()),
                        r, completion)
                    return
                try:
                    async with contextlib.aclosing(self._attempt(r)) as events:
                        async for value in events:
                            if isinstance(value, worker_pb2.Finished):
                                text = completion.finish()
                                reason = FinishReason.FINISH_REASON_STOP if completion.stopped else value.reason
                                outcome = FINISH_NAMES.get(reason, "stop")
                                yield self._with_stop_reason(
                                    _response(req, completion, [], text, reason, r.take_prompt_logprobs()), r, completion)
                                return
                            now = time.monotonic()
                            new = list(value.token_ids)
                            if last_token_at is None:
                                metrics.time_to_first_token.observe(now - arrived)
                            else:
                                for _ in new:
                                    metrics.inter_token_latency.observe((now - last_token_at) / len(new))
                            last_token_at = now
                            r.outputs.extend(new)
                            if value.prompt_logprobs:
                                r.prompt_logprobs = list(value.prompt_logprobs)
                            metrics.generation_tokens.inc(len(new))
                            ids, text = completion.add(new)
                            token_lps = list(value.logprobs)[: len(ids)]
                            if completion.stopped:
                                outcome = "stop"
                                yield self._with_stop_reason(
                                    _response(req, completion, ids, text, FinishReason.FINISH_REASON_STOP,
                                              r.take_prompt_logprobs(), token_lps), r, completion)
                                return
                            if ids or text:
                                yield _response(req, completion, ids, text, prompt_logprobs=r.take_prompt_logprobs(),
                                                logprobs=token_lps)
                except _Lost as lost:
                    self._count_recovery(r, lost)
                    r.attempt += 1
                    r.last_failure = lost.message
                    log.warning("request %s attempt %d: %s; retrying as attempt %d with %d tokens already sent",
                                req.request_id, r.attempt - 1, lost.message, r.attempt, len(r.outputs))
        except RequestFailed as e:
            outcome = e.code.name
            log.warning("request %s failed: %s", req.request_id, e)
            raise
        except Exception:
            outcome = grpc.StatusCode.INTERNAL.name  # a bug: the client sees UNKNOWN, the metrics a failure
            log.exception("request %s failed", req.request_id)
            raise
        finally:
            if outcome.isupper():
                metrics.request_failure.labels(outcome).inc()
            else:
                metrics.request_success.labels(outcome).inc()
                metrics.e2e_request_latency.observe(time.monotonic() - arrived)
                metrics.request_prompt_tokens.observe(len(req.prompt_ids))
                metrics.request_generation_tokens.observe(completion.num_tokens)
                metrics.request_params_max_tokens.observe(req.sampling.max_tokens)

    def _with_stop_reason(self, out: generation_pb2.GenerateResponse, r: _Request, completion: Completion
                          ) -> generation_pb2.GenerateResponse:
        """vLLM's stop_reason on a stopped request: the stop string, or the stop token id (not for EOS)."""
        if out.finish_reason != FinishReason.FINISH_REASON_STOP:
            return out
        s = r.req.sampling
        if completion.matcher.matched is not None:
            out.stop_string = completion.matcher.matched
        elif r.outputs and r.outputs[-1] in s.stop_token_ids and (s.ignore_eos or r.outputs[-1] not in self.eos_ids):
            out.stop_token_id = r.outputs[-1]
        return out

    def _already_finished(self, r: _Request) -> int | None:
        """After a migration: the outputs already sent may have ended the request."""
        if not r.outputs:
            return None
        s = r.req.sampling
        last = r.outputs[-1]
        if (last in self.eos_ids and not s.ignore_eos) or last in s.stop_token_ids:
            return FinishReason.FINISH_REASON_STOP
        if len(r.outputs) >= s.max_tokens or len(r.req.prompt_ids) + len(r.outputs) >= self.limits.max_model_len:
            return FinishReason.FINISH_REASON_LENGTH
        return None

    def _count_recovery(self, r: _Request, lost: _Lost) -> None:
        """Raises RequestFailed once the request has used up its retries or migrations."""
        r.deadline.check()  # an expired deadline is never retried
        migrating = lost.worker.role == "decode" and bool(r.outputs)
        if migrating:
            r.migrations += 1
            if r.migrations > self.max_migrations:
                raise RequestFailed(
                    grpc.StatusCode.UNAVAILABLE,
                    f"{lost.message}; the request already migrated {self.max_migrations} times (--max-migrations)",
                )
            metrics.migrations.inc()
        else:
            r.retries += 1
            if r.retries > self.max_retries:
                raise RequestFailed(grpc.StatusCode.UNAVAILABLE, f"{lost.message}; gave up after {self.max_retries} retries")
            if lost.worker.role == "prefill":
                metrics.prefill_retries.inc()

    # ---- one attempt: a decode worker, a prefill worker (or none), one stream ------------

    async def _attempt(self, r: _Request) -> AsyncIterator[worker_pb2.TokenEvent | worker_pb2.Finished]:
        """Yields TokenEvents, then the Finished event; raises _Lost or RequestFailed."""
        req, deadline = r.req, r.deadline
        prompt = [*req.prompt_ids, *r.outputs]
        if not self.pool.ready("decode"):
            raise self._no_worker_left(r, "decode")
        queued_at = time.monotonic()
        # Blocks are taken on demand: admission asks room for the prompt, max_tokens is only a limit.
        decode = await self.decode_queue.acquire(self.pool, lambda: self.pool.pick_decode(len(prompt), prompt),
                                                 deadline)
        # Counted at pick time, so requests routed before the next GetInfo (or while this one waits for a
        # prefill slot) see the worker taken.
        decode.inflight += 1
        reserved = decode.blocks_for(len(prompt))
        decode.reserved_blocks += reserved
        metrics.num_requests_running.inc()
        call = None
        try:
            prefill = None
            if self.pool.ready("prefill"):
                prefill = await self.prefill_queue.acquire(self.pool, self._pick_prefill, deadline)
                if r.attempt == 0:  # a retry or migration is never refused: it already holds the client
                    admit(prefill, len(prompt), deadline.remaining(), self.ttft_budget)
            if r.attempt == 0:
                metrics.request_queue_time.observe(time.monotonic() - queued_at)
            transfer_token = secrets.token_bytes(TRANSFER_TOKEN_BYTES)
            assert decode.channel is not None
            call = worker_pb2_grpc.DecodeStub(decode.channel).Decode(
                worker_pb2.DecodeRequest(
                    request_id=r.worker_id,
                    attempt=r.attempt,
                    prompt_token_ids=prompt,
                    sampling=r.sampling,
                    transfer_token=transfer_token,
                    lease_seconds=self.lease_seconds,  # the call's deadline also frees the blocks
                    num_output_tokens=len(r.outputs),
                    local_prefill=prefill is None,
                ),
                timeout=deadline.check(),
            )
            cached_blocks = await self._read_reserved(decode, call, r)
            if prefill is None:
                metrics.local_prefill_fallbacks.inc()
                log.info("request %s: no prefill worker alive; decode worker %s prefills it", req.request_id,
                         decode.address)
            else:
                first = await self._prefill(prefill, decode, r, prompt, transfer_token, cached_blocks)
                yield first
                message = await self._first_decode_event(decode, call, prefill, r)
                yield _event(message)
            while True:
                message = await self._read_decode(decode, call, r)
                yield _event(message)
                if message.WhichOneof("event") == "finished":
                    # The worker ends its stream right after `finished`: wait briefly for that, so
                    # the call completes rather than being cancelled.
                    with contextlib.suppress(TimeoutError, grpc.aio.AioRpcError):
                        await asyncio.wait_for(call.read(), 1.0)
                    return
        finally:
            metrics.num_requests_running.dec()
            decode.inflight -= 1
            decode.reserved_blocks -= reserved
            if call is not None and not call.done():
                call.cancel()  # frees the decode worker's blocks now
            self.pool.poke()

    def _pick_prefill(self) -> Worker | None:
        room = [w for w in self.pool.ready("prefill") if w.inflight < self.prefill_inflight_per_worker]
        return self.pool.prefill_policy(room)

    def _no_worker_left(self, r: _Request, role: str) -> RequestFailed:
        if r.last_failure:
            return RequestFailed(grpc.StatusCode.UNAVAILABLE, f"{r.last_failure}; no ready {role} worker to continue on")
        return RequestFailed(grpc.StatusCode.UNAVAILABLE, f"no ready {role} worker")

    async def _prefill(
        self, prefill: Worker, decode: Worker, r: _Request, prompt: list[int], transfer_token: bytes,
        cached_blocks: int = 0,
    ) -> worker_pb2.TokenEvent:
        """The first token; the prefill worker then pushes the KV to the decode worker itself."""
        assert prefill.channel is not None and decode.info is not None
        call = worker_pb2_grpc.PrefillStub(prefill.channel).Prefill(
            worker_pb2.PrefillRequest(
                request_id=r.worker_id,
                attempt=r.attempt,
                token_ids=prompt,
                sampling=r.sampling,
                target=worker_pb2.KvTarget(address=decode.kv_address, layout=decode.info.kv_layout,
                                           cached_blocks=cached_blocks),
                transfer_token=transfer_token,
                sample_index=len(r.outputs),
            ),
            timeout=r.deadline.check(),
        )
        prefill.inflight += 1
        prefill.pending_tokens += len(prompt)
        prefill.pending_lengths.append(len(prompt))
        sent = time.monotonic()
        try:
            reply = await call
            metrics.prefill_wait.observe(time.monotonic() - sent)
        except grpc.aio.AioRpcError as e:
            raise await self._refused(prefill, e, r) from e
        finally:
            prefill.inflight -= 1
            prefill.pending_tokens -= len(prompt)
            prefill.pending_lengths.remove(len(prompt))
            if not call.done():
                call.cancel()
        if not 0 <= reply.first_token_id < self.limits.vocab_size:
            raise _Lost(prefill, f"prefill worker {prefill.address} answered token id {reply.first_token_id}, "
                                 f"outside the vocabulary [0, {self.limits.vocab_size})")
        if r.sampling.HasField("prompt_logprobs"):
            r.prompt_logprobs = list(reply.prompt_logprobs)
        first = worker_pb2.TokenEvent(token_ids=[reply.first_token_id])
        if reply.HasField("first_token_logprob"):
            first.logprobs.append(reply.first_token_logprob)
        return first

    async def _first_decode_event(
        self, decode: Worker, call: grpc.aio.UnaryStreamCall, prefill: Worker, r: _Request
    ) -> worker_pb2.DecodeResponse:
        """D's first event after the prefill answered: it means the KV arrived. Should P die before
        that, the attempt is lost at once (D would otherwise wait out its lease)."""
        read = asyncio.ensure_future(self._read_decode(decode, call, r, kv_from=prefill))
        lost = asyncio.ensure_future(prefill.lost.wait())
        try:
            await asyncio.wait({read, lost}, timeout=r.deadline.check(), return_when=asyncio.FIRST_COMPLETED)
        finally:
            lost.cancel()
            if not read.done():
                read.cancel()
                with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError, _Lost, RequestFailed):
                    await read
        if read.done() and not read.cancelled():
            return read.result()
        if lost.done() and not lost.cancelled():
            raise _Lost(prefill, f"prefill worker {prefill.address} died before its KV reached decode worker "
                                 f"{decode.address}")
        r.deadline.check()
        raise RequestFailed(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded waiting for the KV")

    async def _read_decode(
        self, decode: Worker, call: grpc.aio.UnaryStreamCall, r: _Request, kv_from: Worker | None = None
    ) -> worker_pb2.DecodeResponse:
        """The next `tokens` or `finished` event after `reserved`. `kv_from`: the KV has not arrived
        yet, so a failed transfer is the prefill worker's failure."""
        try:
            message = await self._read_skipping_queued(decode, call, r)
        except grpc.aio.AioRpcError as e:
            if kv_from is not None and e.code() in (grpc.StatusCode.ABORTED, grpc.StatusCode.DEADLINE_EXCEEDED):
                if e.code() == grpc.StatusCode.ABORTED or not r.deadline.expired:
                    raise _Lost(kv_from, f"the KV from prefill worker {kv_from.address} never reached decode "
                                         f"worker {decode.address}: {e.details()}") from e
            raise await self._failed_mid_stream(decode, e, r) from e
        if message is grpc.aio.EOF:
            raise _Lost(decode, f"decode worker {decode.address} ended the stream without finishing the request")
        if message.WhichOneof("event") not in ("tokens", "finished"):
            raise RequestFailed(
                grpc.StatusCode.INTERNAL,
                f"decode worker {decode.address} sent {message.WhichOneof('event')!r} mid-stream",
            )
        if message.WhichOneof("event") == "finished":
            self._check_finished(decode, message.finished)
        elif any(not 0 <= i < self.limits.vocab_size for i in message.tokens.token_ids):
            raise _Lost(decode, f"decode worker {decode.address} sent a token id outside the vocabulary "
                                f"[0, {self.limits.vocab_size})")
        return message

    async def _read_skipping_queued(self, decode: Worker, call: grpc.aio.UnaryStreamCall, r: _Request):
        """The next message but `queued` ones (D keeps a waiting request's stream alive with them)."""
        while True:
            message = await self._read_or_stall(decode, call, r)
            if message is grpc.aio.EOF or message.WhichOneof("event") != "queued":
                return message

    async def _read_or_stall(self, decode: Worker, call: grpc.aio.UnaryStreamCall, r: _Request):
        """The stream's next message; a worker silent for `stall_timeout` is lost (and marked failed)."""
        if self.stall_timeout is None or r.deadline.check() <= self.stall_timeout:
            return await call.read()  # the call's own deadline ends it first
        try:
            return await asyncio.wait_for(call.read(), self.stall_timeout)
        except TimeoutError:
            metrics.stalled_streams.inc()
            message = f"decode worker {decode.address} sent nothing for {self.stall_timeout:g} s (--stall-timeout)"
            await self.pool.mark_failed(decode, message)
            raise _Lost(decode, message) from None

    @staticmethod
    def _check_finished(decode: Worker, finished: worker_pb2.Finished) -> None:
        if finished.reason == FinishReason.FINISH_REASON_ERROR:
            raise RequestFailed(grpc.StatusCode.INTERNAL, f"decode worker {decode.address}: {finished.message}")
        if finished.reason == FinishReason.FINISH_REASON_UNSPECIFIED:
            raise RequestFailed(grpc.StatusCode.INTERNAL, f"decode worker {decode.address} finished without a reason")

    async def _read_reserved(self, decode: Worker, call: grpc.aio.UnaryStreamCall, r: _Request) -> int:
        """Waits for D to hold the request's blocks (it may queue it); the prompt blocks it had cached."""
        try:
            message = await self._read_skipping_queued(decode, call, r)
        except grpc.aio.AioRpcError as e:
            raise await self._refused(decode, e, r) from e
        if message is grpc.aio.EOF:
            raise _Lost(decode, f"decode worker {decode.address} ended the stream before reserving")
        event = message.WhichOneof("event")
        if event == "reserved":
            return message.reserved.cached_blocks
        if event == "finished" and message.finished.reason == FinishReason.FINISH_REASON_ERROR:
            raise RequestFailed(grpc.StatusCode.INTERNAL, f"decode worker {decode.address}: {message.finished.message}")
        raise RequestFailed(grpc.StatusCode.INTERNAL, f"decode worker {decode.address} sent {event!r} before 'reserved'")

    async def _refused(self, worker: Worker, e: grpc.aio.AioRpcError, r: _Request) -> Exception:
        """A worker call failed before any output: the client gets its status, unless the worker is gone."""
        if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return RequestFailed(e.code(), e.details() or "deadline exceeded")
        if e.code() not in _WORKER_GONE:
            hints = [*(e.initial_metadata() or ()), *(e.trailing_metadata() or ())]
            return RequestFailed(
                e.code(),
                e.details() or f"{worker.role} worker {worker.address}: {e.code().name}",
                tuple((k, v) for k, v in hints if k in _FORWARDED_METADATA),
            )
        return await self._gone(worker, e)

    async def _failed_mid_stream(self, worker: Worker, e: grpc.aio.AioRpcError, r: _Request) -> Exception:
        if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return RequestFailed(e.code(), e.details() or "deadline exceeded")
        if e.code() not in _WORKER_GONE:
            return RequestFailed(e.code(), f"decode worker {worker.address}: {e.details()}")
        return await self._gone(worker, e)

    async def _gone(self, worker: Worker, e: grpc.aio.AioRpcError) -> _Lost:
        if e.code() == grpc.StatusCode.UNAVAILABLE:
            await self.pool.mark_failed(worker, e.details() or "")
        return _Lost(worker, f"{worker.role} worker {worker.address} failed: {e.code().name}: {e.details()}")


def _event(message: worker_pb2.DecodeResponse) -> worker_pb2.TokenEvent | worker_pb2.Finished:
    """The `tokens` or `finished` event a decode worker sent."""
    return message.tokens if message.WhichOneof("event") == "tokens" else message.finished


def _response(
    req: ValidRequest,
    completion: Completion,
    ids: list[int],
    text: str,
    reason: int = FinishReason.FINISH_REASON_UNSPECIFIED,
    prompt_logprobs: list[generation_pb2.TokenLogprob] = (),
    logprobs: list[generation_pb2.TokenLogprob] = (),
) -> generation_pb2.GenerateResponse:
    """One message to the client; the last one (with a finish reason) carries the usage."""
    out = generation_pb2.GenerateResponse(request_id=req.request_id, token_ids=ids, text=text, logprobs=logprobs,
                                          prompt_logprobs=prompt_logprobs)
    if reason != FinishReason.FINISH_REASON_UNSPECIFIED:
        out.finish_reason = reason  # type: ignore[assignment]
        out.usage.prompt_tokens = len(req.prompt_ids)
        out.usage.completion_tokens = completion.num_tokens
    return out
