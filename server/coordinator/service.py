"""pdserve.v1.Generation: one request's life in the coordinator.

1. Validate and tokenize (`validate.py`); the workers get every sampling default explicitly. One
   deadline (the client's, or `default_timeout`) bounds everything after this.
2. Routing (`router.py`): a decode worker D with room (by the decode policy), else wait in the
   decode queue (`admission.py`); a prefill worker P (least queued), else wait in the prefill queue.
   No prefill worker alive: D prefills the prompt itself (a fallback, counted).
3-5. One `Attempt` (attempt.py) does reserve -> prefill -> stream: `D.Decode`'s `reserved` means D
   holds blocks under a lease (D refusing for room is picked again, never the client's failure; another
   refusal goes to the client as it is); `P.Prefill` returns the first token at once, before the KV
   reaches D; then D's events: `tokens` (the ids after the first), `finished`. D sends them on its
   Steps stream, one message per decode step for every request of this coordinator (steps_stream.py), or
   per request. Here the ids are detokenized incrementally and cut at the first stop string (then the
   attempt is closed, which cancels D's call and frees its blocks). The last message carries
   finish_reason and usage.
6. Failures. P dies or fails before the KV arrives: the attempt is retried (attempt + 1, a fresh
   transfer token, so the dead attempt's chunks are refused) on another P. D dies mid-stream: the
   request migrates: prompt + the tokens already sent are prefilled again on a live pair, whose
   first token is the next one, so nothing is lost or repeated (at most `max_migrations` times).
7. Client cancel, deadline or error: both worker calls are cancelled, so both workers free everything.
8. n > 1 (the OpenAI front): n requests, one per choice; choice 0 leads and the others follow its prompt
   KV to its workers (shared_prompt.py), so the prompt is prefilled and sent once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import time
from collections.abc import AsyncIterator

import grpc

from pdserve.v1 import generation_pb2, generation_pb2_grpc
from pdserve.server import logs, metrics
from pdserve.server.coordinator.adapters import Adapter, Adapters
from pdserve.server.coordinator.admission import Deadline, RequestFailed
from pdserve.server.coordinator.json_input import printable
from pdserve.server.coordinator.attempt import Attempt, AttemptConfig, Lost
from pdserve.server.coordinator.detokenizer import Completion
from pdserve.server.coordinator.request_state import RequestState
from pdserve.server.coordinator.router import Router
from pdserve.server.coordinator.shared_prompt import SharedPrompt
from pdserve.server.coordinator.steps_stream import StepsClients
from pdserve.server.coordinator.validate import InvalidRequest, Limits, ValidRequest, check_spec, validate
from pdserve.server.finish import finish_name, finish_reason, stop_token_id
from pdserve.server.model.tokenizer import Tokenizer
from pdserve.server.structured.checker import SpecChecker

log = logging.getLogger("pdserve.coordinator")

__all__ = ["GenerationService", "InvalidRequest", "RequestFailed"]

FinishReason = generation_pb2.FinishReason
LONG_TEXT_CHARS = 16_384
"""Text prompts longer than this are tokenized off the event loop."""
CLIENT_INPUT_ERRORS = (RecursionError, UnicodeError, OverflowError)
"""What validating a client's request may raise past the field checks (a schema nested past the parser's
depth): INVALID_ARGUMENT, never UNKNOWN. Anything else stays a server error."""

class GenerationService(generation_pb2_grpc.GenerationServicer):
    def __init__(
        self,
        tokenizer: Tokenizer,
        limits: Limits,
        router: Router,
        lease_seconds: float,
        *,
        default_timeout: float = 600.0,
        max_migrations: int = 2,
        max_retries: int = 3,
        stall_timeout: float | None = None,
        ttft_budget: float = 0.0,
        decode_streams: str = "batched",
        max_coalesce: int = 64,
        checker: SpecChecker | None = None,
        conditional_disagg_max_uncached: int = 0,
        conditional_disagg_min_cached: int = 1,
        adapters: Adapters | None = None,
    ):
        self.tokenizer = tokenizer
        self.checker = checker or SpecChecker(field="structured")
        """Structured-output specs are checked by its grammar child processes (never in this process)."""
        self.limits = limits
        self.router = router
        self.default_timeout = default_timeout
        self.max_migrations = max_migrations
        self.max_retries = max_retries
        self.attempt_config = AttemptConfig(lease_seconds, limits.vocab_size, stall_timeout=stall_timeout,
                                            ttft_budget=ttft_budget, max_coalesce=max_coalesce,
                                            local_prefill_max_uncached=conditional_disagg_max_uncached,
                                            local_prefill_min_cached=conditional_disagg_min_cached)
        self.steps = StepsClients(enabled=decode_streams == "batched")
        """Each decode worker's Steps stream (batched: one message per step for all requests on it)."""
        self.eos_ids = frozenset(getattr(tokenizer, "eos_token_ids", ()) or ())
        self.adapters = adapters
        """The LoRA adapters served (--enable-lora); None: a request naming one is NOT_FOUND."""

    async def Generate(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        try:
            valid = await self._validate(request)
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except RequestFailed as e:  # the grammar processes are overloaded
            await context.abort(e.code, e.details, e.metadata)
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
        self, request: generation_pb2.GenerateRequest, timeout: float | None = None, *,
        shared: SharedPrompt | None = None, choice: int = 0,
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """The request path every front shares (gRPC, HTTP, KServe): validate, route, stream.

        Raises InvalidRequest (bad input) or RequestFailed (a status for the client). Closing the
        iterator (`contextlib.aclosing`) cancels both worker calls. `shared`: this is choice `choice`
        of a request with n > 1, whose choices share the prompt's KV (shared_prompt.py).
        """
        try:
            valid = await self._validate(request)
            async with contextlib.aclosing(self._generate(valid, timeout, shared, choice)) as responses:
                async for response in responses:
                    yield response
        finally:
            if shared is not None and choice == 0:  # a no-op once it placed the prompt's KV
                shared.abandon()  # else the other choices go their own way

    async def _validate(self, request: generation_pb2.GenerateRequest) -> ValidRequest:
        try:
            try:
                if len(request.text) > LONG_TEXT_CHARS:
                    valid = await asyncio.to_thread(validate, request, self.tokenizer, self.limits)
                else:
                    valid = validate(request, self.tokenizer, self.limits)
            except CLIENT_INPUT_ERRORS as e:  # reading the client's input failed past the field checks
                log.warning("validating a request raised %r past the field checks", e)
                raise InvalidRequest(f"request: cannot be read ({type(e).__name__}: {str(e)[:200]})") from e
            valid = dataclasses.replace(valid, lora=self.adapter(request.lora_name))
            await self.check_spec(valid.sampling.structured)
            return valid
        except InvalidRequest:
            metrics.request_failure.labels(grpc.StatusCode.INVALID_ARGUMENT.name).inc()
            raise

    def adapter(self, name: str) -> Adapter | None:
        """The LoRA adapter a request names (None for ""); NOT_FOUND, vLLM's words, for one not served."""
        if not name:
            return None
        adapter = None if self.adapters is None else self.adapters.get(name)
        if adapter is None:
            metrics.request_failure.labels(grpc.StatusCode.NOT_FOUND.name).inc()
            raise RequestFailed(grpc.StatusCode.NOT_FOUND, f"The model `{printable(name)}` does not exist.")
        return adapter

    async def check_spec(self, spec: generation_pb2.StructuredOutput, where: str | None = None) -> None:
        """A structured-output spec checked in a grammar child, off the event loop (a front names its own
        field as `where`; a spec passed once is not checked again); InvalidRequest naming the field."""
        await check_spec(spec, self.checker, where)

    # ---- one request, across attempts ---------------------------------------------------

    async def _generate(
        self, req: ValidRequest, timeout: float | None, shared: SharedPrompt | None = None, choice: int = 0
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        logs.request_id.set(req.request_id)
        arrived = time.monotonic()
        # Workers key requests by this id; clients may reuse theirs, so make it unique here.
        r = RequestState(req, Deadline.after(timeout if timeout is not None else self.default_timeout),
                         f"{req.request_id}.{secrets.token_hex(4)}", shared=shared, choice=choice)
        completion = Completion(self.tokenizer, req.prompt_ids, list(req.sampling.stop), req.sampling.min_tokens,
                                skip_special_tokens=not req.sampling.HasField("skip_special_tokens")
                                or req.sampling.skip_special_tokens)
        metrics.prompt_tokens.inc(len(req.prompt_ids))
        first_token_at: float | None = None
        last_token_at: float | None = None
        outcome = "abort"  # a client cancel ends the generator without either of the others
        try:
            while True:
                reason = self._already_finished(r)
                if reason is not None:
                    outcome = finish_name(reason)
                    yield self._with_stop_reason(
                        _response(req, completion, [], completion.finish(), reason, r.take_prompt_logprobs()),
                        r, completion)
                    return
                try:
                    async with contextlib.aclosing(self._attempt(r).events()) as events:
                        async for event in events:
                            if event.WhichOneof("event") == "finished":
                                text = completion.finish()
                                reason = FinishReason.FINISH_REASON_STOP if completion.stopped else event.finished.reason
                                outcome = finish_name(reason)
                                yield self._with_stop_reason(
                                    _response(req, completion, [], text, reason, r.take_prompt_logprobs()), r, completion)
                                return
                            value = event.tokens
                            now = time.monotonic()
                            new = list(value.token_ids)
                            if last_token_at is None:
                                first_token_at = now
                                metrics.time_to_first_token.observe(now - arrived)
                            elif new:  # merged tokens: each the gap's share after the one before
                                metrics.inter_token_latency.observe_each((now - last_token_at) / len(new), len(new))
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
                except Lost as lost:
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
                if first_token_at is not None and last_token_at is not None:
                    _observe_phases(arrived if r.scheduled_at is None else r.scheduled_at, first_token_at, last_token_at, completion.num_tokens)

    def _with_stop_reason(self, out: generation_pb2.GenerateResponse, r: RequestState, completion: Completion
                          ) -> generation_pb2.GenerateResponse:
        """vLLM's stop_reason on a stopped request: the stop string, or the stop token id (not for EOS)."""
        if out.finish_reason != FinishReason.FINISH_REASON_STOP:
            return out
        if completion.matcher.matched is not None:
            out.stop_string = completion.matcher.matched
        elif r.outputs and (token := stop_token_id(r.outputs[-1], r.req.sampling, self.eos_ids)) is not None:
            out.stop_token_id = token
        return out

    def _already_finished(self, r: RequestState) -> int | None:
        """After a migration: the outputs already sent may have ended the request."""
        if not r.outputs:
            return None
        reason = finish_reason(r.outputs[-1], len(r.outputs), len(r.req.prompt_ids) + len(r.outputs),
                               r.req.sampling, self.eos_ids, self.limits.max_model_len)
        return None if reason == FinishReason.FINISH_REASON_UNSPECIFIED else reason

    def _attempt(self, r: RequestState) -> Attempt:
        return Attempt(r, self.router, self.attempt_config, self.steps)

    def _count_recovery(self, r: RequestState, lost: Lost) -> None:
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
    out = generation_pb2.GenerateResponse(request_id=req.request_id, token_ids=ids, text=text)
    if logprobs:
        out.logprobs.extend(logprobs)
    if prompt_logprobs:
        out.prompt_logprobs.extend(prompt_logprobs)
    if reason != FinishReason.FINISH_REASON_UNSPECIFIED:
        out.finish_reason = reason  # type: ignore[assignment]
        out.usage.prompt_tokens = len(req.prompt_ids)
        out.usage.completion_tokens = completion.num_tokens
    return out


def _observe_phases(scheduled: float, first_token: float, last_token: float, num_tokens: int) -> None:
    """A finished request's phases (vLLM's prefill, decode and inference times, and its time per output token)."""
    decode = last_token - first_token
    metrics.request_prefill_time.observe(first_token - scheduled)
    metrics.request_decode_time.observe(decode)
    metrics.request_inference_time.observe(last_token - scheduled)
    if num_tokens > 1:
        metrics.request_time_per_output_token.observe(decode / (num_tokens - 1))
