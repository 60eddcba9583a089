"""One attempt at a request: reserve -> prefill -> stream.

1. Reserve: a decode worker D with room (the decode queue, by the decode policy); D's `Decode` call opened
   (naming D's Steps stream, when D has one) and its `reserved` read: D holds the prompt's blocks. D may
   refuse for lack of room (RESOURCE_EXHAUSTED: another coordinator replica took the blocks first, or
   its own queue is full): that is never the client's failure: D counts as full in this coordinator's view
   until it next reports its load, and the attempt picks again (until the deadline).
2. Prefill: P answers the first token, yielded at once, and pushes the KV to D itself (only the blocks D lacks).
   No prefill worker alive, or D holds all but a short suffix of the prompt (conditional disaggregation: D
   applies the thresholds this attempt sends, `--conditional-disagg-*`, when it reserves, and `reserved` says
   what it chose): D prefills the prompt past its cached blocks, P is never called, and D's first event carries
   the first token. Until D's first event, D waits on P's KV or computes the prompt: that silence is not D's, so
   no --stall-timeout runs; the wait ends when P or D goes down (the pool's health checks), when D reports the KV
   failed, or at the deadline.
3. Stream: D's events (`tokens`..., then `finished`) as the proto's `SequenceEvent` oneof, from D's Steps
   stream (batched with the other requests on it) or from the call itself (one message per token). A
   reader behind the stream (still writing its previous response) gets the tokens that piled up merged
   into one event (at most `max_coalesce` tokens; never reordered, never dropped, never waited for).
4. `_release` (always, and before each pick again): the Decode call cancelled unless it ended (D frees
   the blocks), the counts returned.

A choice of a request with n > 1 (shared_prompt.py): choice 0 says where its prompt KV is once D's first
event shows it arrived; the other choices wait for that before they reserve, then prefer that D (reserving
only the blocks the prompt's cached full blocks do not cover) and that P.

Failures another attempt can recover from raise `Lost` (the request retries or migrates); the others
raise `RequestFailed` (the client's status).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from pdserve.v1 import generation_pb2, worker_pb2, worker_pb2_grpc
from pdserve.server import metrics
from pdserve.server.coordinator.admission import RequestFailed
from pdserve.server.coordinator.prefill_estimate import admit, ttft_budget_of
from pdserve.server.coordinator.request_state import RequestState
from pdserve.server.coordinator.router import Router
from pdserve.server.coordinator.shared_prompt import Placement
from pdserve.server.coordinator.steps_stream import DecodeEvent, Route, StepsClient, StepsClients, StreamBroken
from pdserve.server.coordinator.worker_pool import Worker
from pdserve.server.serving import RETRY_HINT

log = logging.getLogger("pdserve.coordinator")

FinishReason = generation_pb2.FinishReason
TRANSFER_TOKEN_BYTES = 16
_WORKER_GONE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED)
_FORWARDED_METADATA = (RETRY_HINT,)
"""A refusing worker's hints that reach the client (as trailing metadata)."""


class Lost(Exception):
    """A worker died or failed this attempt in a way another attempt can recover from."""

    def __init__(self, worker: Worker, message: str):
        super().__init__(message)
        self.worker = worker
        self.message = message


class _Full(Exception):
    """The decode worker refused the request for lack of room: pick again."""


class _EndedEarly(Exception):
    """A per-request Decode call ended without `finished`."""


@dataclass(frozen=True)
class AttemptConfig:
    """The coordinator's settings an attempt runs under."""

    lease_seconds: float
    """How long a decode worker holds the request's blocks waiting for its KV."""
    vocab_size: int
    """Token ids a worker answers must lie in [0, vocab_size)."""
    stall_timeout: float | None = None
    """A decode stream silent this long after its first event is lost (then migrated) as if its worker
    had died; None: never."""
    ttft_budget: float = 0.0
    """A new request whose expected prefill wait exceeds this is refused (prefill_estimate.py); 0: the deadline."""
    max_coalesce: int = 64
    """A stream behind its decode worker gets the tokens that piled up, up to this many, in one response."""
    local_prefill_max_uncached: int = 0
    """Conditional disaggregation (--conditional-disagg-max-uncached): a decode worker that lacks fewer than this
    many of the prompt's tokens (and holds at least local_prefill_min_cached) prefills them itself; 0: off."""
    local_prefill_min_cached: int = 1


class Attempt:
    def __init__(self, r: RequestState, router: Router, config: AttemptConfig, steps: StepsClients):
        self.r = r
        self.router = router
        self.config = config
        self.steps_clients = steps
        """Each decode worker's Steps stream (batched: one message per step for all requests on it)."""
        self.prompt = [*r.req.prompt_ids, *r.outputs]
        self.decode: Worker | None = None
        self.prefill: Worker | None = None
        self.call: grpc.aio.UnaryStreamCall | None = None
        self.steps: StepsClient | None = None
        self.route = Route()
        self._reserved_blocks = 0
        self._watcher: asyncio.Task[None] | None = None
        self.local_prefill = False
        """D computes the prompt itself (no prefill worker alive, or D chose to: conditional disaggregation)."""

    async def events(self) -> AsyncIterator[worker_pb2.SequenceEvent | DecodeEvent]:
        """`tokens` events, then `finished`; raises Lost or RequestFailed. Close it (aclosing) to end it."""
        try:
            cached_blocks = await self._reserve()
            offered = self.prefill is not None and self.config.local_prefill_max_uncached > 0
            if self.prefill is None:
                metrics.local_prefill_fallbacks.inc()
                log.info("request %s: no prefill worker alive; decode worker %s prefills it", self.r.req.request_id,
                         self.decode.address)
            elif self.local_prefill:  # D holds all but a short suffix: it computes that, P is never called
                self.prefill = None
            else:
                yield await self._run_prefill(cached_blocks)
            events = await self._first_events()
            self._count_prefill(cached_blocks, offered)
            if self.r.leads:  # D's first event: the prompt's KV is there, its full blocks in D's prefix cache
                self.r.shared.place(self.decode, self.prefill, len(self.r.req.prompt_ids))
            while True:
                for event in events:
                    yield event
                    if event.WhichOneof("event") == "finished":
                        # The worker ends its call right after `finished`: wait briefly for that, so
                        # the call completes rather than being cancelled.
                        if self._watcher is not None:
                            with contextlib.suppress(TimeoutError):
                                await asyncio.wait_for(asyncio.shield(self._watcher), 1.0)
                        return
                events = await self._next()
        finally:
            self._release()

    # ---- 1. reserve -------------------------------------------------------------------

    async def _reserve(self) -> int:
        """Holds blocks on a decode worker (picking again while workers refuse for room); returns the
        prompt blocks it had cached."""
        router, r = self.router, self.r
        queued_at = time.monotonic()
        placement = await self._placement()
        while True:
            if not await router.has_ready("decode", r.deadline):  # one marked dead by a call may be back
                raise r.no_worker_left("decode")
            decode = await router.decode(len(self.prompt), self.prompt, r.deadline, placement, r.req.lora)
            self._hold(decode, placement)
            if self.prefill is None:
                self.prefill = await router.prefill(r.deadline, placement, self.prompt)
                if self.prefill is not None and r.attempt == 0:  # a retry or migration is never refused
                    admit(self.prefill, len(self.prompt), r.deadline, self.config.ttft_budget)
            try:
                cached = await self._open_decode()
            except _Full as full:
                metrics.decode_refusals.inc()
                log.info("request %s: %s; picking again", r.req.request_id, full)
                router.refused(decode)
                self._release()
                continue
            if r.attempt == 0:
                r.scheduled_at = time.monotonic()
                metrics.request_queue_time.observe(r.scheduled_at - queued_at)
                if r.shared is not None and not r.leads:
                    shared = placement is not None and decode is placement.decode
                    metrics.shared_prompt_choices.labels("shared" if shared else "own").inc()
            return cached

    async def _placement(self) -> Placement | None:
        """A following choice's: where the leader's prompt KV is (on its first attempt, once it is there)."""
        r = self.r
        if r.shared is None or r.leads:
            return None
        return await r.shared.placement(r.deadline) if r.attempt == 0 else r.shared.placed()

    def _hold(self, decode: Worker, placement: Placement | None = None) -> None:
        """The decode worker holds the prompt's blocks but the leader's shared ones, counted from the pick."""
        self.decode = decode
        shared = placement.shared_blocks if placement is not None and decode is placement.decode else 0
        self._reserved_blocks = decode.blocks_for(len(self.prompt), shared)
        self.router.hold_decode(decode, self._reserved_blocks)

    def _release(self) -> None:
        """Gives the decode worker back: its counts, the route, the call (cancelled: D frees the blocks)."""
        decode, self.decode = self.decode, None
        if decode is None:
            return
        self.router.release_decode(decode, self._reserved_blocks)
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None
        if self.steps is not None:
            self.steps.unroute(self.r.worker_id)
            self.steps = None
        if self.call is not None and not self.call.done():
            self.call.cancel()  # frees the decode worker's blocks now
        self.call = None
        self.route.close()
        self.route = Route()

    async def _open_decode(self) -> int:
        r, decode = self.r, self.decode
        assert decode is not None and decode.channel is not None
        self.transfer_token = secrets.token_bytes(TRANSFER_TOKEN_BYTES)
        self.steps = await self.steps_clients.for_worker(decode)
        if self.steps is not None:
            self.route = self.steps.route(r.worker_id)  # before the call: no event can come first
        self.call = worker_pb2_grpc.DecodeStub(decode.channel).Decode(
            worker_pb2.DecodeRequest(
                request_id=r.worker_id,
                attempt=r.attempt,
                prompt_token_ids=self.prompt,
                sampling=r.sampling,
                transfer_token=self.transfer_token,
                lease_seconds=self.config.lease_seconds,  # the call's deadline also frees the blocks
                num_output_tokens=len(r.outputs),
                local_prefill=self.prefill is None,
                steps_stream_id=self.steps.stream_id if self.steps is not None else "",
                local_prefill_max_uncached=self.config.local_prefill_max_uncached if self.prefill is not None else 0,
                local_prefill_min_cached=self.config.local_prefill_min_cached,
                lora=None if r.req.lora is None else r.req.lora.proto(),
            ),
            timeout=r.deadline.check(),
        )
        cached_blocks = await self._read_reserved()
        self._watcher = asyncio.create_task(self._watch(self.call, self.route, batched=self.steps is not None))
        return cached_blocks

    async def _read_reserved(self) -> int:
        """Waits for D to hold the request's blocks (it may queue it); the prompt blocks it had cached."""
        decode = self.decode
        try:
            message = await self._read_call()
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and not self.r.deadline.expired:
                raise _Full(f"decode worker {decode.address} refused it: {e.details()}") from e
            raise await self._refused(decode, e) from e
        if message is grpc.aio.EOF:
            raise Lost(decode, f"decode worker {decode.address} ended the stream before reserving")
        event = message.WhichOneof("event")
        if event == "reserved":
            self.local_prefill = self.prefill is None or message.reserved.local_prefill
            return message.reserved.cached_blocks
        if event == "finished" and message.finished.reason == FinishReason.FINISH_REASON_ERROR:
            raise finish_failed(decode.address, message.finished)
        raise RequestFailed(grpc.StatusCode.INTERNAL, f"decode worker {decode.address} sent {event!r} before 'reserved'")

    async def _read_call(self):
        """The call's next message but `queued` ones (D keeps a waiting request's call alive with them)."""
        while True:
            read = self.call.read()
            message = await (read if self._stall_after() is None else self._stalling(read))
            if message is grpc.aio.EOF or message.WhichOneof("event") != "queued":
                return message

    @staticmethod
    async def _watch(call: grpc.aio.UnaryStreamCall, route: Route, batched: bool) -> None:
        """After `reserved`, the call's messages (per request) and its end go to the route. Riding a Steps
        stream the call stays silent; ending OK then means `finished` is on the stream."""
        try:
            while True:
                message = await call.read()
                if message is grpc.aio.EOF:
                    if not batched:
                        route.put(_EndedEarly())
                    return
                route.put(message)
        except grpc.aio.AioRpcError as e:
            route.put(e)
        except asyncio.CancelledError:
            pass

    # ---- 2. prefill -------------------------------------------------------------------

    def _count_prefill(self, cached_blocks: int, offered: bool) -> None:
        """The prompt's KV is on D: where the part past D's cached blocks was prefilled, counted (`offered`: D was
        let choose, conditional disaggregation)."""
        uncached = max(len(self.prompt) - cached_blocks * self.decode.block_size(), 0)
        if offered:
            metrics.conditional_disagg.labels("local" if self.local_prefill else "remote").inc()
        metrics.uncached_prompt_tokens.labels("decode" if self.local_prefill else "prefill").inc(uncached)

    async def _run_prefill(self, cached_blocks: int) -> worker_pb2.SequenceEvent:
        """The first token; the prefill worker then pushes the KV to the decode worker itself."""
        r, prefill, decode = self.r, self.prefill, self.decode
        assert prefill is not None and prefill.channel is not None and decode is not None and decode.info is not None
        call = worker_pb2_grpc.PrefillStub(prefill.channel).Prefill(
            worker_pb2.PrefillRequest(
                request_id=r.worker_id,
                attempt=r.attempt,
                token_ids=self.prompt,
                sampling=r.sampling,
                target=worker_pb2.KvTarget(address=decode.kv_address, layout=decode.info.kv_layout,
                                           cached_blocks=cached_blocks),
                transfer_token=self.transfer_token,
                sample_index=len(r.outputs),
                ttft_budget_seconds=ttft_budget_of(r.deadline, self.config.ttft_budget),
                arrived_seconds_ago=r.deadline.seconds - r.deadline.remaining(),
                lora=None if r.req.lora is None else r.req.lora.proto(),
            ),
            timeout=r.deadline.check(),
        )
        sent = time.monotonic()
        with self.router.prefilling(prefill, len(self.prompt)):
            try:
                reply = await call
                metrics.prefill_wait.observe(time.monotonic() - sent)
            except grpc.aio.AioRpcError as e:
                raise await self._refused(prefill, e) from e
            finally:
                if not call.done():
                    call.cancel()
        vocab = self.config.vocab_size
        if not 0 <= reply.first_token_id < vocab:
            raise Lost(prefill, f"prefill worker {prefill.address} answered token id {reply.first_token_id}, "
                                f"outside the vocabulary [0, {vocab})")
        if r.sampling.HasField("prompt_logprobs"):
            r.prompt_logprobs = list(reply.prompt_logprobs)
        first = worker_pb2.SequenceEvent(request_id=r.worker_id, tokens=worker_pb2.TokenEvent(
            token_ids=[reply.first_token_id]))
        if reply.HasField("first_token_logprob"):
            first.tokens.logprobs.append(reply.first_token_logprob)
        return first

    async def _first_events(self) -> list[DecodeEvent]:
        """D's first events: the KV arrived from P (after P answered), or D prefilled the prompt itself
        (no P). Until then D waits on P or computes the prompt, silent: no --stall-timeout runs against it. The wait
        ends when P or D goes down (its health check failed, or a call found it gone: the attempt is lost at
        once, rather than D waiting out its lease), when D reports the KV failed (P's failure), or at the
        deadline."""
        prefill, decode, r = self.prefill, self.decode, self.r
        read = asyncio.ensure_future(self._next(kv_from=prefill, stall=False))
        lost = {worker: worker.lost for worker in (prefill, decode) if worker is not None}
        down = [asyncio.ensure_future(event.wait()) for event in lost.values()]
        try:
            await asyncio.wait({read, *down}, timeout=r.deadline.check(), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiting in down:
                waiting.cancel()
            if not read.done():
                read.cancel()
                with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError, Lost, RequestFailed):
                    await read
        if read.done() and not read.cancelled():
            return read.result()
        if prefill is not None and lost[prefill].is_set():
            raise Lost(prefill, f"prefill worker {prefill.address} died before its KV reached decode worker "
                                f"{decode.address}")
        if lost[decode].is_set():
            raise Lost(decode, f"decode worker {decode.address} went down before its first token "
                               f"({'waiting for the KV' if prefill else 'prefilling the prompt'})")
        r.deadline.check()
        raise RequestFailed(grpc.StatusCode.DEADLINE_EXCEEDED,
                            "deadline exceeded waiting for the KV" if prefill else
                            f"deadline exceeded while decode worker {decode.address} prefilled the prompt")

    # ---- 3. stream --------------------------------------------------------------------

    async def _next(self, kv_from: Worker | None = None, stall: bool = True) -> list[DecodeEvent]:
        """The next `tokens`/`finished` events, merged where they pile up. `kv_from`: the KV has not
        arrived yet, so a failed transfer is the prefill worker's failure. `stall`: D's silence is its own
        (it has sent its first event), so --stall-timeout limits the wait."""
        while True:
            items = await self._take(stall)
            events: list[DecodeEvent] = []
            for i, item in enumerate(items):
                if isinstance(item, Exception):
                    if events:  # what came before the failure goes out first (a migration continues after it)
                        self.route.items.extendleft(reversed(items[i:]))
                        break
                    raise await self._failure(item, kv_from)
                kind = item.WhichOneof("event")
                if kind == "queued":
                    continue
                self._check(item, kind)
                events.append(item)
            if events:
                return _merged(events, self.config.max_coalesce)

    async def _take(self, stall: bool = True) -> list[DecodeEvent | Exception]:
        """The route's next items. `stall`: a worker silent for --stall-timeout is lost (marked failed)."""
        limit = self._stall_after() if stall else None
        if limit is None:
            return await self.route.take(None)  # the call's own deadline ends it first
        try:
            return await self.route.take(limit)
        except TimeoutError:
            raise await self._stalled() from None

    def _stall_after(self) -> float | None:
        stall = self.config.stall_timeout
        return None if stall is None or self.r.deadline.check() <= stall else stall

    async def _stalling(self, read):
        try:
            return await asyncio.wait_for(read, self._stall_after())
        except TimeoutError:
            raise await self._stalled() from None

    async def _stalled(self) -> Lost:
        decode = self.decode
        metrics.stalled_streams.inc()
        message = f"decode worker {decode.address} sent nothing for {self.config.stall_timeout:g} s (--stall-timeout)"
        await self.router.mark_failed(decode, message)
        return Lost(decode, message)

    def _check(self, event: DecodeEvent, kind: str | None) -> None:
        decode = self.decode
        if kind == "tokens":
            vocab, ids = self.config.vocab_size, event.tokens.token_ids
            if ids and (min(ids) < 0 or max(ids) >= vocab):
                raise Lost(decode, f"decode worker {decode.address} sent a token id outside the vocabulary [0, {vocab})")
        elif kind == "finished":
            finished = event.finished
            if finished.reason == FinishReason.FINISH_REASON_ERROR:
                raise finish_failed(decode.address, finished)
            if finished.reason == FinishReason.FINISH_REASON_UNSPECIFIED:
                raise RequestFailed(grpc.StatusCode.INTERNAL, f"decode worker {decode.address} finished without a reason")
        else:
            raise RequestFailed(grpc.StatusCode.INTERNAL, f"decode worker {decode.address} sent {kind!r} mid-stream")

    async def _failure(self, e: Exception, kv_from: Worker | None) -> Exception:
        decode, r = self.decode, self.r
        if isinstance(e, _EndedEarly):
            return Lost(decode, f"decode worker {decode.address} ended the stream without finishing the request")
        if isinstance(e, StreamBroken):
            if e.code == grpc.StatusCode.UNAVAILABLE:  # the worker is gone: route around it at once
                await self.router.mark_failed(decode, str(e))
            return Lost(decode, str(e))
        assert isinstance(e, grpc.aio.AioRpcError)
        if kv_from is not None and e.code() in (grpc.StatusCode.ABORTED, grpc.StatusCode.DEADLINE_EXCEEDED):
            if e.code() == grpc.StatusCode.ABORTED or not r.deadline.expired:
                return Lost(kv_from, f"the KV from prefill worker {kv_from.address} never reached decode "
                                     f"worker {decode.address}: {e.details()}")
        if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return RequestFailed(e.code(), e.details() or "deadline exceeded")
        if e.code() not in _WORKER_GONE:
            return RequestFailed(e.code(), f"decode worker {decode.address}: {e.details()}")
        return await self._gone(decode, e)

    async def _refused(self, worker: Worker, e: grpc.aio.AioRpcError) -> Exception:
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

    async def _gone(self, worker: Worker, e: grpc.aio.AioRpcError) -> Lost:
        if e.code() == grpc.StatusCode.UNAVAILABLE:
            await self.router.mark_failed(worker, e.details() or "")
        return Lost(worker, f"{worker.role} worker {worker.address} failed: {e.code().name}: {e.details()}")


def _merged(events: list[DecodeEvent], max_tokens: int) -> list[DecodeEvent]:
    """Runs of `tokens` events joined, each up to max_tokens ids, in order; `finished` stays last. An event
    is never split (one the worker joined from several steps may hold more); one with prompt logprobs
    starts anew."""
    if len(events) == 1 or max_tokens <= 1:
        return events
    out: list[DecodeEvent] = []
    for event in events:
        last = out[-1] if out else None
        if (last is not None and event.WhichOneof("event") == "tokens" and last.WhichOneof("event") == "tokens"
                and not event.tokens.prompt_logprobs
                and len(last.tokens.token_ids) + len(event.tokens.token_ids) <= max_tokens):
            last.tokens.token_ids.extend(event.tokens.token_ids)
            last.tokens.logprobs.extend(event.tokens.logprobs)
        else:
            out.append(event)
    return out


_CODES = {code.value[0]: code for code in grpc.StatusCode}


def finish_failed(address: str, finished: worker_pb2.Finished) -> RequestFailed:
    """A decode worker's error finish as the client's status: the request's own fault (INVALID_ARGUMENT: its
    grammar outgrew a parser limit) as the worker named it, anything else INTERNAL."""
    code = _CODES.get(finished.status, grpc.StatusCode.INTERNAL)
    if code in (grpc.StatusCode.OK, grpc.StatusCode.UNKNOWN):
        code = grpc.StatusCode.INTERNAL
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return RequestFailed(code, finished.message)
    return RequestFailed(code, f"decode worker {address}: {finished.message}")
