"""One endpoint's request: run its choices through the shared request path, shape OpenAI's answer.

Without `stream` one JSON body once every choice finished; with it server-sent events, the choices'
chunks interleaved as they arrive, ending in `data: [DONE]`. A chat that may answer with tool calls
(tools.py) streams the content before any call can begin ("auto"), then, when the choice finishes, the
rest of its content and its `tool_calls` (with ids, each call whole in one delta), finish_reason `tool_calls`. An error after streaming began arrives as
an SSE event `{"error": ...}` before `[DONE]`. A client that disconnects cancels its request: the
streams are closed, which cancels the worker calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdserve.v1 import generation_pb2
from pdserve.server.coordinator.openai.convert import Echo
from pdserve.server.coordinator.openai.errors import error_of
from pdserve.server.coordinator.openai.fan_in import Choices, Item
from pdserve.server.coordinator.openai.front import Front
from pdserve.server.coordinator.openai.logprobs import CompletionLogprobs, chat_logprobs
from pdserve.server.coordinator.openai.protocol import SamplingFields
from pdserve.server.coordinator.openai.sse import TEXT_MARK, TextChunk, sse_event
from pdserve.server.coordinator.openai.tools import ToolPlan, tool_call
from pdserve.server.coordinator.shared_prompt import SharedPrompt
from pdserve.server.finish import finish_name

log = logging.getLogger("pdserve.coordinator.http")

Kind = Literal["completion", "chat"]


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
    token_ids: list[int] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def add(self, response: generation_pb2.GenerateResponse) -> None:
        if response.text:
            self.pieces.append(response.text)
        self.logprobs.extend(response.logprobs)
        self.prompt_logprobs.extend(response.prompt_logprobs)
        self.token_ids.extend(response.token_ids)
        if response.finish_reason:
            self.finish_reason = finish_name(response.finish_reason)
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
                 echo: Echo | None = None, tools: ToolPlan | None = None, lora: str | None = None):
        self.front = front
        self.model = lora or front.model_name
        """The answer's `model`: the LoRA adapter's name when the request runs one (as vLLM answers)."""
        self.tools = tools
        """A chat whose answer may hold tool calls (not "none"): they are parsed from each choice's whole text."""
        self.kind = kind
        self.req = req
        self.id = request_id
        self.created = int(time.time())
        self.object = "text_completion" if kind == "completion" else "chat.completion"
        self.echo = echo
        """Completions with `echo`: the prompt's text and ids, put in front of the output."""
        self.prompt_ids: list[int] | None = None
        """The prompt's ids, set by `run` when return_token_ids asks for them."""
        self.completion_logprobs = [CompletionLogprobs(front.token_text) for _ in range(req.n)] \
            if kind == "completion" and req.logprobs is not None else None

    def _logprobs(self, response: generation_pb2.GenerateResponse | Outcome, first: bool,
                  index: int = 0) -> dict[str, Any] | None:
        """The logprobs of what `response` adds (a chunk, or the whole outcome), in the endpoint's shape."""
        if self.kind == "chat":
            return chat_logprobs(response.logprobs, self.front.token_text, self.front.token_bytes) \
                if self.req.logprobs else None
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
               index: int = 0, token_ids: Sequence[int] | None = None) -> dict[str, Any]:
        out = self._choice(text, finish_reason, first, logprobs, stop_reason, index)
        if self.prompt_ids is not None:  # return_token_ids, as vLLM places them
            if self.kind == "completion":
                out["prompt_token_ids"] = self.prompt_ids if first else None
            out["token_ids"] = list(token_ids or ())
        return out

    def _choice(self, text: str | None, finish_reason: str | None, first: bool,
                logprobs: dict[str, Any] | None, stop_reason: str | int | None, index: int) -> dict[str, Any]:
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
        message: dict[str, Any] = {"role": "assistant", "content": text or ""}
        if self.tools is not None:
            message, finish_reason = self.tool_message(text or "", finish_reason)
        return {
            "index": index,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
        }

    def tool_message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """A finished chat's message with its tool calls parsed out (finish_reason tool_calls), or its text
        as content when it holds none (or was cut short)."""
        content, calls = self.tools.calls(text) if finish_reason == "stop" else (text, [])
        if not calls:
            return {"role": "assistant", "content": text}, finish_reason
        return {"role": "assistant", "content": content, "tool_calls": [tool_call(c) for c in calls]}, "tool_calls"

    def tool_chunks(self, outcome: Outcome, index: int, sent: int) -> list[dict[str, Any]]:
        """A streamed chat's last chunks when it may call tools: the content not yet sent (`sent` characters
        were), its calls, its finish."""
        message, finish = self.tool_message(outcome.text, outcome.finish_reason)
        rest = (message["content"] or "")[sent:]
        deltas = [{"content": rest}] if rest else []
        if "tool_calls" in message:
            deltas.append({"tool_calls": [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]})
        chunks = [{"index": index, "delta": d, "logprobs": None, "finish_reason": None} for d in deltas]
        chunks.append({"index": index, "delta": {}, "logprobs": None, "finish_reason": finish,
                       "stop_reason": outcome.stop_reason})
        return [self.body([c], None, True) for c in chunks]

    def body(
        self, choices: list[dict[str, Any]], usage: dict[str, int] | None, chunk: bool
    ) -> dict[str, Any]:
        obj = self.object + (".chunk" if chunk and self.kind == "chat" else "")
        out = {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.kind == "chat" and self.prompt_ids is not None and (not chunk or choices and "role" in
                                                                     choices[0].get("delta", {})):
            out["prompt_token_ids"] = self.prompt_ids  # vLLM: the whole answer's, or the first chunk's
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

    def prompt_token_ids(self, generate: generation_pb2.GenerateRequest) -> list[int] | None:
        """The prompt's ids when `return_token_ids` asks for them (a text prompt tokenized as validation does)."""
        if not self.req.return_token_ids:
            return None
        if generate.WhichOneof("prompt") == "token_ids":
            return list(generate.token_ids.ids)
        return self.front.generation.tokenizer.encode(generate.text)

    async def run(self, http: Request, generate: generation_pb2.GenerateRequest) -> Response:
        self.prompt_ids = self.prompt_token_ids(generate)
        shared = SharedPrompt() if self.req.n > 1 else None
        choices = Choices([self.front.generation.stream(g, self.front.timeout, shared=shared, choice=i)
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

    async def collect(self, choices: Choices) -> Response:
        """One JSON body once every choice finished; the first failure fails them all."""
        outcomes = [Outcome() for _ in choices.streams]
        try:
            running = len(outcomes)
            while running:
                i, response = await choices.next()
                if response is None:
                    running -= 1
                elif isinstance(response, Exception):
                    return error_of(response).response()
                else:
                    outcomes[i].add(response)
        finally:
            await choices.close()
        body = [self.choice(o.text, o.finish_reason, first=True, logprobs=self._logprobs(o, True, i),
                            stop_reason=o.stop_reason, index=i, token_ids=o.token_ids) for i, o in enumerate(outcomes)]
        return JSONResponse(self.body(body, usage(outcomes), False))

    def text_chunk(self, index: int) -> TextChunk:
        """The template of choice `index`'s chunks that only add text (not its first, no finish reason)."""
        return TextChunk.of(self.body([self.choice(TEXT_MARK, None, index=index)], None, True))

    @property
    def plain(self) -> bool:
        """No logprobs asked for: a chunk that only adds text can be rendered from its TextChunk."""
        return self.completion_logprobs is None and not (self.kind == "chat" and self.req.logprobs) \
            and not self.req.return_token_ids

    async def events(self, choices: Choices, early: list[Item]) -> AsyncIterator[bytes]:
        """SSE chunks, the choices' interleaved; cancelled (client gone) or not, closing the choices
        cancels the worker calls."""
        n = len(choices.streams)
        outcomes = [Outcome() for _ in range(n)]
        pending = deque(early)
        try:
            if self.kind == "chat":
                for i in range(n):
                    yield sse_event(self.body([self.choice(None, None, first=True, index=i)], None, True))
            is_first = [self.kind == "completion"] * n  # a chat's first chunk (the role) went above
            templates = [self.text_chunk(i) for i in range(n)] if self.plain else None
            sent = [0] * n  # content characters each choice streamed while it may still call tools
            running = n
            while running:
                i, response = pending.popleft() if pending else await choices.next()
                if response is None:
                    running -= 1
                    continue
                if isinstance(response, Exception):
                    log.warning("request %s failed mid-stream: %s", self.id, response)
                    yield sse_event(error_of(response).body())
                    yield sse_event("[DONE]")
                    return
                outcome = outcomes[i]
                outcome.add(response)
                if self.tools is not None:  # the calls are parsed from the whole text
                    if response.finish_reason:
                        for chunk in self.tool_chunks(outcome, i, sent[i]):
                            yield sse_event(chunk)
                        continue
                    text = outcome.text
                    ready = self.tools.streamable(text)
                    if ready > sent[i]:
                        yield sse_event(self.body([{"index": i, "delta": {"content": text[sent[i]:ready]},
                                                    "logprobs": None, "finish_reason": None}], None, True))
                        sent[i] = ready
                    continue
                if templates is not None and response.text and not response.finish_reason and not is_first[i]:
                    yield templates[i].render(response.text)
                elif response.text or response.finish_reason or response.logprobs or is_first[i] or \
                        (self.prompt_ids is not None and response.token_ids):  # return_token_ids: every id
                    choice = self.choice(response.text, outcome.finish_reason, first=is_first[i],
                                         logprobs=self._logprobs(response, is_first[i], i),
                                         stop_reason=outcome.stop_reason, index=i, token_ids=response.token_ids)
                    yield sse_event(self.body([choice], None, True))
                    is_first[i] = False
        finally:
            await choices.close()
        if self.include_usage:
            yield sse_event(self.body([], usage(outcomes), True))
        yield sse_event("[DONE]")


def usage(outcomes: list[Outcome]) -> dict[str, int]:
    """The prompt counted once, every choice's tokens."""
    prompt = outcomes[0].prompt_tokens
    completion = sum(o.completion_tokens for o in outcomes)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
