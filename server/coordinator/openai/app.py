"""OpenAI-compatible HTTP on the coordinator: the same request path as pdserve.v1.Generation.

- `POST /v1/completions`, `POST /v1/chat/completions`: with `stream: true` server-sent events ending in
  `data: [DONE]`, else one JSON body. Each request becomes a `GenerateRequest` and runs through
  `GenerationService.stream`; a chat first goes through the model's chat template.
- `GET /v1/models`, `GET /health` (200 while a decode worker takes work, else 503), `GET /metrics`.
- Errors are OpenAI error objects: 400 bad field, 401 bad API key, 404 unknown model, 429 admission
  rejection (with Retry-After), 413 a body or prompt over its byte limit, 503 no worker, 504 deadline;
  any other failure a 500 error object, never a bare one. An error after streaming began arrives
  as an SSE event `{"error": ...}` before `[DONE]`.
- A client that disconnects cancels its request: the stream is closed, which cancels the worker calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import secrets
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from functools import lru_cache
from json.encoder import encode_basestring  # type: ignore[attr-defined]  # json.dumps' own (C) string escaper
from pathlib import Path
from typing import Any, Literal

import grpc
import prometheus_client
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException as StarletteHTTPException
from tokenizers import Tokenizer as HfTokenizer

from pdserve.v1 import generation_pb2
from pdserve.server import metrics, serving
from pdserve.server.coordinator import http_server
from pdserve.server.coordinator.body_limit import BodyLimit, BodyTooLarge, error_body
from pdserve.server.coordinator.chat_template import ChatTemplate, ChatTemplateError
from pdserve.server.coordinator.openai_logprobs import CompletionLogprobs, chat_logprobs
from pdserve.server.coordinator.service import GenerationService, RequestFailed
from pdserve.server.coordinator.shared_prompt import SharedPrompt
from pdserve.server.coordinator.validate import InvalidRequest, TooLarge
from pdserve.server.model.config import served_model_name

log = logging.getLogger("pdserve.coordinator.http")

FinishReason = generation_pb2.FinishReason
FINISH_NAMES = {
    FinishReason.FINISH_REASON_STOP: "stop",
    FinishReason.FINISH_REASON_LENGTH: "length",
    FinishReason.FINISH_REASON_ABORT: "abort",
}
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}
MAX_N = 16
"""Most choices one request may ask for (each is a generation of its own)."""
DEFAULT_COMPLETION_TOKENS = 16
"""OpenAI's default max_tokens for /v1/completions; a chat may use the rest of the context."""


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.counted = False
        """The request path counted it in pdserve_request_failure_total already."""
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": ERROR_TYPES.get(self.status, "server_error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _api_error(e: InvalidRequest | RequestFailed | ChatTemplateError) -> ApiError:
    if isinstance(e, (InvalidRequest, ChatTemplateError)):
        message = str(e)
        error = ApiError(413 if isinstance(e, TooLarge) else 400, message, param=message.split(" ", 1)[0].split(":")[0] or None)
        error.counted = isinstance(e, InvalidRequest)
        return error
    status = HTTP_STATUS.get(e.code, 500)
    headers = {}
    retry_ms = dict(e.metadata).get("retry-after-ms")
    if status == 429 and retry_ms is not None and retry_ms.isdigit():
        headers["Retry-After"] = str(max(1, math.ceil(int(retry_ms) / 1000)))
    error = ApiError(status, e.details, code=e.code.name.lower(), headers=headers)
    error.counted = True
    return error


# --- requests -----------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(BaseModel):
    """What both endpoints share. A field pdserve does not know is refused (400 naming it), never
    dropped silently: `_unsupported` reads them from `model_extra`."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int = 0
    min_p: float | None = None
    best_of: int | None = None
    user: str | None = None
    """OpenAI's end-user id: accepted, not used."""


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


class TokenizeRequest(BaseModel):
    model: str
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model: str
    tokens: list[int]


class ChatRequest(SamplingFields):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra variables for the chat template (vLLM's extension), e.g. {"enable_thinking": false}."""


def _unsupported(req: SamplingFields) -> None:
    """Fields the engine cannot honour get a 400 rather than being silently ignored."""
    for name in req.model_extra or {}:
        raise ApiError(400, f"{name}: unknown field; pdserve does not support it", param=name)
    checks = [
        ("n", not 1 <= req.n <= MAX_N, f"n must lie in [1, {MAX_N}]"),
        ("best_of", req.best_of not in (None, 1), "only best_of=1 is supported"),
        ("logit_bias", bool(req.logit_bias), "logit_bias is not supported"),
        ("min_tokens", req.min_tokens < 0, "min_tokens must be >= 0"),
        ("seed", req.seed is not None and not 0 <= req.seed < 2**64, "seed must lie in [0, 2**64)"),
    ]
    if isinstance(req, CompletionRequest):
        checks += [
            ("suffix", bool(req.suffix), "suffix is not supported"),
        ]
    if isinstance(req, ChatRequest):
        checks += [
            ("top_logprobs", req.top_logprobs is not None and not req.logprobs, "top_logprobs needs logprobs: true"),
            ("tools", bool(req.tools), "tools are not supported"),
            (
                "response_format",
                (req.response_format or {"type": "text"}).get("type") != "text",
                'only response_format {"type": "text"} is supported',
            ),
        ]
    for param, bad, message in checks:
        if bad:
            raise ApiError(400, f"{param}: {message}", param=param)


def _sampling(req: SamplingFields, max_tokens: int | None) -> generation_pb2.SamplingParams:
    sampling = generation_pb2.SamplingParams(
        stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
    )
    for name, value in (
        ("max_tokens", max_tokens),
        ("temperature", req.temperature),
        ("top_p", req.top_p),
        ("top_k", req.top_k),
        ("seed", req.seed),
        ("presence_penalty", req.presence_penalty),
        ("frequency_penalty", req.frequency_penalty),
        ("repetition_penalty", req.repetition_penalty),
        ("min_p", req.min_p),
        ("min_tokens", req.min_tokens or None),
        *_logprob_fields(req),
    ):
        if value is not None:
            try:
                setattr(sampling, name, value)
            except (ValueError, TypeError) as e:
                raise ApiError(400, f"{name}: {value!r} is out of range", param=name) from e
    return sampling


def _logprob_fields(req: SamplingFields) -> list[tuple[str, int | None]]:
    """The workers' logprobs and prompt_logprobs for the request's OpenAI fields."""
    if isinstance(req, CompletionRequest):
        return [("logprobs", req.logprobs), ("prompt_logprobs", req.logprobs if req.echo else None)]
    if isinstance(req, ChatRequest) and req.logprobs:
        return [("logprobs", req.top_logprobs or 0)]
    return []


# --- responses ----------------------------------------------------------------------------------


@dataclass
class Outcome:
    pieces: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    stop_reason: str | int | None = None
    """vLLM's: the stop string or stop token id that ended the output (None for EOS or length)."""
    logprobs: list[generation_pb2.TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[generation_pb2.TokenLogprob] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def add(self, response: generation_pb2.GenerateResponse) -> None:
        if response.text:
            self.pieces.append(response.text)
        self.logprobs.extend(response.logprobs)
        self.prompt_logprobs.extend(response.prompt_logprobs)
        if response.finish_reason:
            self.finish_reason = FINISH_NAMES.get(response.finish_reason, "stop")
            self.prompt_tokens = response.usage.prompt_tokens
            self.completion_tokens = response.usage.completion_tokens
            self.stop_reason = _stop_reason(response)

    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


def _stop_reason(response: generation_pb2.GenerateResponse) -> str | int | None:
    kind = response.WhichOneof("stop_reason")
    return None if kind is None else getattr(response, kind)


def _sse(data: dict[str, Any] | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n".encode()


_TEXT_MARK = "\x00pdserve:text\x00"
"""Stands for the text while a choice's TextChunk is rendered (once); it must not occur elsewhere in a chunk."""


@dataclass(frozen=True)
class TextChunk:
    """An SSE chunk that only adds text, as the bytes around the text's JSON string: rendered once per
    choice, then filled per response without a dict or json.dumps (the same bytes as `_sse(body)`)."""

    head: bytes
    tail: bytes

    @classmethod
    def of(cls, body: dict[str, Any]) -> TextChunk:
        """From a chunk `body` whose text is `_TEXT_MARK`."""
        head, mark, tail = _sse(body).partition(json.dumps(_TEXT_MARK, ensure_ascii=False).encode())
        assert mark and mark not in tail, "the text mark must appear once in the chunk"
        return cls(head, tail)

    def render(self, text: str) -> bytes:
        return b"".join((self.head, encode_basestring(text).encode(), self.tail))


@dataclass
class Front:
    """What the endpoints need from the coordinator."""

    generation: GenerationService
    model_name: str
    aliases: tuple[str, ...]
    """Other names a request may give `model` (the checkpoint path, as vLLM names it)."""
    max_model_len: int
    chat: ChatTemplate | None
    ready: Callable[[], bool]
    api_key: str | None = None
    timeout: float | None = None
    created: int = 0
    encoder: HfTokenizer | None = None
    """For /tokenize without special tokens (vLLM's extension); None: the endpoint answers 501."""
    max_body_bytes: int = 16 * 2**20
    """Larger request bodies get 413 before they are read."""
    max_prompt_bytes: int = 4 * 2**20
    """Larger prompts (and chat messages together) get 413 before they are tokenized or rendered."""

    def token_text(self, token_id: int) -> str:
        """One token's text, as logprobs name it."""
        return _token_text(self.generation.tokenizer, token_id)

    def check_model(self, model: str) -> None:
        if model != self.model_name and model not in self.aliases:
            raise ApiError(
                404,
                f"The model `{model}` does not exist; this server serves `{self.model_name}`",
                param="model",
                code="model_not_found",
            )


Kind = Literal["completion", "chat"]


@lru_cache(maxsize=65536)
def _token_text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _cancel_on_disconnect(request: Request, work: asyncio.Future) -> Any:
    """Awaits `work`; a client that disconnects first cancels it (a non-streaming request)."""
    watcher = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait([work, watcher], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not work.done():
        work.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await work
        log.info("client disconnected; request cancelled")
        return Response(status_code=499)
    return work.result()


class Handler:
    """One endpoint's request: build the GenerateRequest(s), run them, shape the answer.

    `n` > 1 runs n generations of the prompt side by side (seed + i for choice i when seeded) that
    share the prompt's KV, as vLLM V1 does: n child requests through the tiers, choice 0 first; once
    its prompt KV is on its decode worker (full blocks in that worker's prefix cache), the other
    choices go to the same decode and prefill workers, so the decode worker reuses the prompt's full
    blocks (only the last, partial block is each choice's own), the prefill worker's prefix KV spares
    computing them and only the partial block crosses the wire (shared_prompt.py). A choice whose
    decode worker has no room goes elsewhere, the normal way.

    Why child requests and not a fork on the decode worker (one prefill, n sequences copy-on-write of
    the last block): the fork needs a new decode API, a first token per choice sampled from one set
    of logits on the prefill worker, and its own path through migration (a forked choice that moves
    must re-prefill anyway). Child requests keep every tier's API, reuse the prefix caches both tiers
    already have (and the vLLM decode engine's), and leave failover, migration and cancellation per
    choice as they are; the cost is one partial block computed and sent per extra choice, and the
    other choices' first tokens wait for choice 0's KV to land.
    """

    def __init__(self, front: Front, kind: Kind, req: SamplingFields, request_id: str,
                 echo: tuple[str, list[int]] | None = None):
        self.front = front
        self.kind = kind
        self.req = req
        self.id = request_id
        self.created = int(time.time())
        self.object = "text_completion" if kind == "completion" else "chat.completion"
        self.echo = echo
        """Completions with `echo`: the prompt's text and ids, put in front of the output."""
        self.completion_logprobs = [CompletionLogprobs(front.token_text) for _ in range(req.n)] \
            if kind == "completion" and req.logprobs is not None else None

    def _logprobs(self, response: generation_pb2.GenerateResponse | Outcome, first: bool,
                  index: int = 0) -> dict[str, Any] | None:
        """The logprobs of what `response` adds (a chunk, or the whole outcome), in the endpoint's shape."""
        if self.kind == "chat":
            return chat_logprobs(response.logprobs, self.front.token_text) if self.req.logprobs else None
        if self.completion_logprobs is None:
            return None
        lp = self.completion_logprobs[index]
        if first and self.echo is not None and self.echo[1]:
            lp.add_first_prompt_token(self.echo[1][0])
            lp.add(response.prompt_logprobs)
        lp.add(response.logprobs)
        return lp.take()

    def choice(self, text: str | None, finish_reason: str | None, first: bool = False,
               logprobs: dict[str, Any] | None = None, stop_reason: str | int | None = None,
               index: int = 0) -> dict[str, Any]:
        if self.kind == "completion":
            if first and self.echo is not None:
                text = self.echo[0] + (text or "")
            return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason,
                    "stop_reason": stop_reason}
        if self.req.stream:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            if text:
                delta["content"] = text
            return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
                    "stop_reason": stop_reason}
        return {
            "index": index,
            "message": {"role": "assistant", "content": text or ""},
            "logprobs": logprobs,
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
        }

    def body(
        self, choices: list[dict[str, Any]], usage: dict[str, int] | None, chunk: bool
    ) -> dict[str, Any]:
        obj = self.object + (".chunk" if chunk and self.kind == "chat" else "")
        out = {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.front.model_name,
            "choices": choices,
        }
        if not chunk or self.include_usage:
            out["usage"] = usage
        return out

    @property
    def include_usage(self) -> bool:
        return bool(self.req.stream_options and self.req.stream_options.include_usage)

    def _requests(self, generate: generation_pb2.GenerateRequest) -> list[generation_pb2.GenerateRequest]:
        """One request per choice; seeded ones draw with seed + index."""
        out = []
        for i in range(self.req.n):
            one = generation_pb2.GenerateRequest()
            one.CopyFrom(generate)
            if i and one.sampling.HasField("seed"):
                one.sampling.seed = (one.sampling.seed + i) % 2**64
            out.append(one)
        return out

    async def run(self, http: Request, generate: generation_pb2.GenerateRequest) -> Response:
        shared = SharedPrompt() if self.req.n > 1 else None
        choices = _Choices([self.front.generation.stream(g, self.front.timeout, shared=shared, choice=i)
                            for i, g in enumerate(self._requests(generate))])
        if not self.req.stream:
            return await _cancel_on_disconnect(http, asyncio.ensure_future(self.collect(choices)))
        try:
            early = await choices.until_each_answered()
        except BaseException:
            await choices.close()
            raise
        return StreamingResponse(
            self.events(choices, early),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def collect(self, choices: _Choices) -> Response:
        """One JSON body once every choice finished; the first failure fails them all."""
        outcomes = [Outcome() for _ in choices.streams]
        try:
            running = len(outcomes)
            while running:
                i, response = await choices.next()
                if response is None:
                    running -= 1
                elif isinstance(response, Exception):
                    return _error_of(response).response()
                else:
                    outcomes[i].add(response)
        finally:
            await choices.close()
        body = [self.choice(o.text, o.finish_reason, first=True, logprobs=self._logprobs(o, True, i),
                            stop_reason=o.stop_reason, index=i) for i, o in enumerate(outcomes)]
        return JSONResponse(self.body(body, _usage(outcomes), False))

    def text_chunk(self, index: int) -> TextChunk:
        """The template of choice `index`'s chunks that only add text (not its first, no finish reason)."""
        return TextChunk.of(self.body([self.choice(_TEXT_MARK, None, index=index)], None, True))

    @property
    def plain(self) -> bool:
        """No logprobs asked for: a chunk that only adds text can be rendered from its TextChunk."""
        return self.completion_logprobs is None and not (self.kind == "chat" and self.req.logprobs)

    async def events(self, choices: _Choices, early: list[_Item]) -> AsyncIterator[bytes]:
        """SSE chunks, the choices' interleaved; cancelled (client gone) or not, closing the choices
        cancels the worker calls."""
        n = len(choices.streams)
        outcomes = [Outcome() for _ in range(n)]
        pending = deque(early)
        try:
            if self.kind == "chat":
                for i in range(n):
                    yield _sse(self.body([self.choice(None, None, first=True, index=i)], None, True))
            is_first = [self.kind == "completion"] * n  # a chat's first chunk (the role) went above
            templates = [self.text_chunk(i) for i in range(n)] if self.plain else None
            running = n
            while running:
                i, response = pending.popleft() if pending else await choices.next()
                if response is None:
                    running -= 1
                    continue
                if isinstance(response, Exception):
                    log.warning("request %s failed mid-stream: %s", self.id, response)
                    yield _sse(_error_of(response).body())
                    yield _sse("[DONE]")
                    return
                outcome = outcomes[i]
                outcome.add(response)
                if templates is not None and response.text and not response.finish_reason and not is_first[i]:
                    yield templates[i].render(response.text)
                elif response.text or response.finish_reason or response.logprobs or is_first[i]:
                    choice = self.choice(response.text, outcome.finish_reason, first=is_first[i],
                                         logprobs=self._logprobs(response, is_first[i], i),
                                         stop_reason=outcome.stop_reason, index=i)
                    yield _sse(self.body([choice], None, True))
                    is_first[i] = False
        finally:
            await choices.close()
        if self.include_usage:
            yield _sse(self.body([], _usage(outcomes), True))
        yield _sse("[DONE]")


_Item = tuple[int, generation_pb2.GenerateResponse | Exception | None]
"""(choice, its next response, the failure that ended it, or None when it finished)."""


class _Choices:
    """Every choice's stream driven by a task of its own from the start, into one queue in arrival
    order: a following choice waits for choice 0's prompt KV to reach its decode worker, so choice 0
    must go on whether or not its output has been read yet."""

    def __init__(self, streams: list[AsyncIterator[generation_pb2.GenerateResponse]]):
        self.streams = streams
        self._items: asyncio.Queue[_Item] = asyncio.Queue()
        self._pumps = [asyncio.create_task(self._pump(i)) for i in range(len(streams))]

    async def _pump(self, i: int) -> None:
        try:
            async for response in self.streams[i]:
                self._items.put_nowait((i, response))
        except Exception as e:  # InvalidRequest or RequestFailed: the client's status; else a bug (500)
            self._items.put_nowait((i, e))
            return
        self._items.put_nowait((i, None))

    async def next(self) -> _Item:
        return await self._items.get()

    async def until_each_answered(self) -> list[_Item]:
        """What arrives until every choice has answered once; a failure before then raises ApiError
        (the HTTP status: no output has gone out)."""
        early: list[_Item] = []
        answered: set[int] = set()
        while len(answered) < len(self.streams):
            i, item = await self.next()
            if isinstance(item, Exception):
                raise _error_of(item) from item
            early.append((i, item))
            answered.add(i)
        return early

    async def close(self) -> None:
        """Stops every choice still running: closing its stream cancels its worker calls."""
        for pump in self._pumps:
            pump.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)
        for stream in self.streams:
            await stream.aclose()


def _error_of(e: Exception) -> ApiError:
    """The OpenAI error for a choice's failure."""
    if isinstance(e, (InvalidRequest, RequestFailed)):
        return _api_error(e)
    log.error("request failed: %r", e, exc_info=e)
    return ApiError(500, f"internal error: {type(e).__name__}", code="internal_error")


def _usage(outcomes: list[Outcome]) -> dict[str, int]:
    """The prompt counted once, every choice's tokens."""
    prompt = outcomes[0].prompt_tokens
    completion = sum(o.completion_tokens for o in outcomes)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


# --- the app ------------------------------------------------------------------------------------


def _validation_message(e: RequestValidationError) -> tuple[str, str | None]:
    errors = e.errors()
    if not errors:
        return "invalid request body", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    return f"{param or 'body'}: {first.get('msg', 'invalid')}", param


def _check_prompt_size(text: str, limit: int) -> None:
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > limit:
        raise ApiError(413, f"prompt: a prompt of {size} bytes; the limit is {limit} bytes", param="prompt")


def _check_messages_size(messages: list[dict[str, Any]], limit: int) -> None:
    """The messages' JSON size bounds what the chat template renders from them (before rendering)."""
    size = len(json.dumps(messages, ensure_ascii=False, default=str).encode("utf-8", "surrogatepass"))
    if size > limit:
        raise ApiError(413, f"messages: {size} bytes of messages; the limit is {limit} bytes", param="messages")


def create_app(front: Front) -> FastAPI:
    async def authenticate(request: Request) -> None:
        if not front.api_key:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(
            token.strip().encode(), front.api_key.encode()
        ):
            raise ApiError(
                401, "Incorrect API key provided: send 'Authorization: Bearer <key>'", code="invalid_api_key"
            )

    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None, openapi_url=None)
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authenticate)])

    @app.exception_handler(ApiError)
    async def api_error(_: Request, e: ApiError) -> JSONResponse:
        if e.status == 400 and not e.counted:  # refused here, before the shared request path
            metrics.request_failure.labels(grpc.StatusCode.INVALID_ARGUMENT.name).inc()
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, e: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(e)
        return await api_error(request, ApiError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return ApiError(e.status_code, str(e.detail)).response()

    @app.exception_handler(BodyTooLarge)
    async def body_too_large(_: Request, e: BodyTooLarge) -> JSONResponse:
        return JSONResponse(json.loads(error_body(front.max_body_bytes)), status_code=413)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, e: Exception) -> JSONResponse:
        log.exception("HTTP request failed: %r", e)
        return ApiError(500, f"internal error: {type(e).__name__}", code="internal_error").response()

    @app.get("/health")
    async def health() -> Response:
        if front.ready():
            return Response(status_code=200)
        return ApiError(503, "no ready decode worker").response()

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(prometheus_client.generate_latest(), media_type=prometheus_client.CONTENT_TYPE_LATEST)

    @app.post("/tokenize", dependencies=[Depends(authenticate)])
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        """vLLM's extension (what `vllm bench serve` aligns its prompts with)."""
        front.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "prompt or messages: give exactly one", param="prompt")
        if body.messages is not None:
            if front.chat is None:
                raise ApiError(400, "messages: the model has no chat template", param="messages")
            _check_messages_size(body.messages, front.max_prompt_bytes)
            try:
                _, ids = await asyncio.to_thread(front.chat.encode, body.messages)
            except ChatTemplateError as e:
                raise ApiError(400, f"messages: {e}", param="messages") from e
        else:
            _check_prompt_size(body.prompt or "", front.max_prompt_bytes)
            if body.add_special_tokens:
                ids = await asyncio.to_thread(front.generation.tokenizer.encode, body.prompt or "")
            elif front.encoder is not None:
                ids = (await asyncio.to_thread(front.encoder.encode, body.prompt or "", add_special_tokens=False)).ids
            else:
                raise ApiError(501, "add_special_tokens=false is not available here")
        return {"count": len(ids), "max_model_len": front.max_model_len, "tokens": ids, "token_strs": None}

    @app.post("/detokenize", dependencies=[Depends(authenticate)])
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        front.check_model(body.model)
        vocab = front.generation.limits.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"tokens: id {bad[0]} lies outside [0, {vocab})", param="tokens")
        return {"prompt": front.generation.tokenizer.decode(body.tokens)}

    @v1.get("/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": front.model_name,
            "object": "model",
            "created": front.created,
            "owned_by": "pdserve",
            "root": front.model_name,
            "parent": None,
            "max_model_len": front.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        front.check_model(body.model)
        _unsupported(body)
        generate = generation_pb2.GenerateRequest(
            sampling=_sampling(
                body, DEFAULT_COMPLETION_TOKENS if body.max_tokens is None else body.max_tokens
            )
        )
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ApiError(
                    400,
                    f"prompt: batches of {len(prompt)} prompts are not supported; send one per request",
                    param="prompt",
                )
            prompt = prompt[0]
        echo = None
        if body.echo:  # the prompt's ids here, to name its tokens
            ids = front.generation.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            text = prompt if isinstance(prompt, str) else front.generation.tokenizer.decode(ids)
            echo = (text, ids)
            prompt = ids
        if isinstance(prompt, str):
            generate.text = prompt
        else:
            generate.token_ids.ids.extend(prompt)
        handler = Handler(front, "completion", body, f"cmpl-{secrets.token_hex(12)}", echo)
        generate.request_id = handler.id
        return await handler.run(request, generate)

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request) -> Response:
        front.check_model(body.model)
        _unsupported(body)
        if front.chat is None:
            raise ApiError(
                400,
                f"the model `{front.model_name}` has no chat template (tokenizer_config.json has "
                "no chat_template): use /v1/completions",
                param="messages",
                code="no_chat_template",
            )
        _check_messages_size(body.messages, front.max_prompt_bytes)
        try:
            _, ids = await asyncio.to_thread(front.chat.encode, body.messages, body.chat_template_kwargs)
        except ChatTemplateError as e:
            raise ApiError(
                400, str(e) if str(e).startswith("messages") else f"messages: {e}", param="messages"
            ) from e
        max_tokens = body.max_tokens if body.max_completion_tokens is None else body.max_completion_tokens
        if max_tokens is None:
            max_tokens = max(1, front.max_model_len - len(ids))
        generate = generation_pb2.GenerateRequest(sampling=_sampling(body, max_tokens))
        generate.token_ids.ids.extend(ids)
        handler = Handler(front, "chat", body, f"chatcmpl-{secrets.token_hex(12)}")
        generate.request_id = handler.id
        return await handler.run(request, generate)

    app.include_router(v1)
    return app


async def serve_http(
    config: Any, generation: GenerationService, ready: Callable[[], bool], max_model_len: int
) -> http_server.HttpServer:
    """Starts the OpenAI HTTP front for a CoordinatorConfig (`http_port`, `host`, `api_key`, `model_dir`,
    `model_name`, `served_model_name`, `chat_template`)."""
    model_dir = Path(config.model_dir)
    encoder = HfTokenizer.from_file(str(model_dir / "tokenizer.json"))
    names = tuple(getattr(config, "served_model_name", ()) or ())
    front = Front(
        generation=generation,
        model_name=getattr(config, "model_name", None) or served_model_name(model_dir),
        aliases=(*names[1:], str(model_dir), str(model_dir.resolve())),
        max_model_len=max_model_len,
        chat=ChatTemplate.from_dir(model_dir, encoder, getattr(config, "chat_template", None)),
        ready=ready,
        api_key=getattr(config, "api_key", None),
        created=int(time.time()),
        encoder=encoder,
        max_body_bytes=2 * getattr(config, "max_prompt_bytes", 4 * 2**20) + 2**20,
        max_prompt_bytes=getattr(config, "max_prompt_bytes", 4 * 2**20),
    )
    app = BodyLimit(create_app(front), front.max_body_bytes)
    server = await http_server.start(app, config.host, config.http_port, tls=serving.tls_config(),
                                     reuse_port=config.reuse_port)
    log.info("OpenAI-compatible HTTP on http://%s:%d/v1", config.host, server.port)
    return server
