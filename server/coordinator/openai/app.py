"""The OpenAI-compatible HTTP app on the coordinator: the same request path as pdserve.v1.Generation.

- `POST /v1/completions`, `POST /v1/chat/completions`: each body becomes a `GenerateRequest`
  (convert.py) and runs through `GenerationService.stream` (handler.py); a chat first goes through
  the model's chat template.
- `POST /tokenize`, `POST /detokenize` (vLLM's extensions), `GET /v1/models`, `GET /health` (200 while
  a decode worker takes work, else 503), `GET /metrics`.
- Every error is an OpenAI error object as vLLM writes it (errors.py), never a bare one.
- Every body is read in one place, `CheckedRoute`: parsed (in a thread when large) and checked by
  json_input.py before pydantic sees it, so a string, integer, float or nesting Python or protobuf could not
  hand on is a 400 naming its field; the endpoints read the rest inside `client_input()`. Work that can
  take more than a millisecond (tokenizing, rendering a chat template, a large body's JSON) runs in a thread.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import prometheus_client
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from tokenizers import Tokenizer as HfTokenizer

from pdserve.server import cluster_metrics, metrics, serving
from pdserve.server.coordinator import http_server
from pdserve.server.coordinator.body_limit import BodyLimit, BodyTooLarge, error_body
from pdserve.server.coordinator.chat_template import ChatTemplate, ChatTemplateError
from pdserve.server.coordinator.openai.structured import check_structured, structured_where
from pdserve.server.coordinator.openai.tools import check_tools_grammar, tool_plan
from pdserve.server.coordinator.openai.convert import (check_messages_size, check_prompt_size, chat_request,
                                                       completion_request, refuse_unsupported)
from pdserve.server.coordinator.json_input import parse_checked
from pdserve.server.coordinator.openai.errors import ApiError, client_input, internal_error, validation_message
from pdserve.server.coordinator.openai.front import Front
from pdserve.server.coordinator.openai.handler import Handler
from pdserve.server.coordinator.openai.lora_routes import add_lora_routes, lora_card, runtime_lora_updating
from pdserve.server.coordinator.openai.protocol import (ChatRequest, CompletionRequest, DetokenizeRequest,
                                                        TokenizeRequest)
from pdserve.server.coordinator.service import GenerationService
from pdserve.server.model.config import served_model_name

log = logging.getLogger("pdserve.coordinator.http")

LONG_DETOKENIZE = 4096
"""/detokenize with more ids than this decodes them in a thread."""
LONG_PROMPT_CHARS = 16_384
"""Longer completion prompts (and any echo) are converted, with their tokenizing, in a thread."""


class CheckedRoute(APIRoute):
    """A route whose JSON body is parsed and checked (json_input.py) before FastAPI and pydantic read it:
    the one place the OpenAI front reads what a client sent. A body over the size limit raises BodyTooLarge
    here (413), not inside FastAPI's parser (which would answer 400)."""

    def get_route_handler(self):
        handler = super().get_route_handler()
        if self.body_field is None:
            return handler

        async def checked(request: Request) -> Response:
            raw = await request.body()
            if raw:
                with client_input():
                    request._json = await parse_checked(raw)  # FastAPI's request.json() returns it
            return await handler(request)

        return checked


def create_app(front: Front) -> FastAPI:
    async def authenticate(request: Request) -> None:
        if not front.api_key:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(
            token.strip().encode(), front.api_key.encode()
        ):
            raise ApiError(
                401, "Incorrect API key provided: send 'Authorization: Bearer <key>'"
            )

    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None, openapi_url=None)
    app.router.route_class = CheckedRoute
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authenticate)], route_class=CheckedRoute)

    @app.exception_handler(ApiError)
    async def api_error(_: Request, e: ApiError) -> JSONResponse:
        if e.status == 400 and not e.counted:  # refused here, before the shared request path
            metrics.request_failure.labels(grpc.StatusCode.INVALID_ARGUMENT.name).inc()
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, e: RequestValidationError) -> JSONResponse:
        message, param = validation_message(e)
        return await api_error(request, ApiError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return ApiError(e.status_code, str(e.detail)).response()

    @app.exception_handler(BodyTooLarge)
    async def body_too_large(_: Request, e: BodyTooLarge) -> JSONResponse:
        return Response(error_body(front.max_body_bytes), status_code=413, media_type="application/json")

    @app.exception_handler(Exception)
    async def unhandled(_: Request, e: Exception) -> JSONResponse:
        log.exception("HTTP request failed: %r", e)
        return internal_error(e).response()

    @app.get("/health")
    async def health() -> Response:
        if front.ready():
            return Response(status_code=200)
        return ApiError(503, "no ready decode worker").response()

    @app.get("/metrics")
    async def prometheus() -> Response:
        if not front.worker_metrics:
            return Response(prometheus_client.generate_latest(), media_type=prometheus_client.CONTENT_TYPE_LATEST)
        # every worker's series too, each labelled by its worker (scraped concurrently, off the event loop)
        text = await asyncio.to_thread(cluster_metrics.cluster_text, list(front.worker_metrics), front.model_name)
        return Response(text, media_type=prometheus_client.CONTENT_TYPE_LATEST)

    @app.post("/tokenize", dependencies=[Depends(authenticate)])
    async def tokenize(body: TokenizeRequest) -> Response:
        """vLLM's extension (what `vllm bench serve` aligns its prompts with). Tokenized and its answer
        written in a thread: a long prompt's ids are a long list to build and to write as JSON."""
        front.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "prompt or messages: give exactly one", param="prompt")
        if body.messages is not None and front.chat is None:
            raise ApiError(400, "messages: the model has no chat template", param="messages")
        if body.prompt is not None and not body.add_special_tokens and front.encoder is None:
            raise ApiError(501, "add_special_tokens=false is not available here")
        try:
            with client_input("messages" if body.messages is not None else "prompt"):
                answer = await asyncio.to_thread(_tokenize, front, body)
        except ChatTemplateError as e:
            raise ApiError(400, f"messages: {e}", param="messages") from e
        return Response(answer, media_type="application/json")

    @app.post("/detokenize", dependencies=[Depends(authenticate)])
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        front.check_model(body.model)
        if len(body.tokens) > LONG_DETOKENIZE:
            return {"prompt": await asyncio.to_thread(_detokenize, front, body.tokens)}
        return {"prompt": _detokenize(front, body.tokens)}

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
        adapters = front.adapters or ()
        return {"object": "list", "data": [card, *(lora_card(front, a) for a in adapters)]}

    if front.adapters is not None and runtime_lora_updating():
        add_lora_routes(app, front, authenticate)

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        lora = front.check_model(body.model)
        with client_input():
            refuse_unsupported(body)
            args = (body, front.generation.tokenizer, front.generation.limits.vocab_size, front.max_model_len)
            if body.echo or _prompt_chars(body.prompt) > LONG_PROMPT_CHARS:
                generate, echo = await asyncio.to_thread(completion_request, *args)
            else:
                generate, echo = completion_request(*args)
        await check_structured(front.generation, generate.sampling.structured,
                               structured_where(body.response_format, body.structured_outputs))
        handler = Handler(front, "completion", body, f"cmpl-{secrets.token_hex(12)}", echo, lora=lora)
        generate.request_id = handler.id
        generate.lora_name = lora or ""
        return await handler.run(request, generate)

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request) -> Response:
        lora = front.check_model(body.model)
        with client_input():
            refuse_unsupported(body)
        if front.chat is None:
            raise ApiError(
                400,
                f"the model `{front.model_name}` has no chat template (tokenizer_config.json has "
                "no chat_template): use /v1/completions",
                param="messages",
            )
        plan = tool_plan(body.tools, body.tool_choice, body.parallel_tool_calls, front.enable_auto_tool_choice,
                         front.tool_call_parser, front.generation.checker.limits)
        await check_tools_grammar(plan, front.generation)
        try:
            with client_input("messages"):
                _, ids = await asyncio.to_thread(_render, front, body.messages, body.chat_template_kwargs,
                                                 plan.tools if plan else None)
        except ChatTemplateError as e:
            raise ApiError(
                400, str(e) if str(e).startswith("messages") else f"messages: {e}", param="messages"
            ) from e
        with client_input():
            generate = chat_request(body, ids, front.max_model_len, plan)
        await check_structured(front.generation, generate.sampling.structured,
                               structured_where(body.response_format, body.structured_outputs) or "tool_choice")
        handler = Handler(front, "chat", body, f"chatcmpl-{secrets.token_hex(12)}",
                          tools=plan if plan and plan.mode != "none" else None, lora=lora)
        generate.request_id = handler.id
        generate.lora_name = lora or ""
        return await handler.run(request, generate)

    app.include_router(v1)
    return app


def _tokenize(front: Front, body: TokenizeRequest) -> bytes:
    """/tokenize's answer as JSON (in a thread)."""
    if body.messages is not None:
        _, ids = _render(front, body.messages)
    else:
        check_prompt_size(body.prompt or "", front.max_prompt_bytes)
        if body.add_special_tokens:
            ids = front.generation.tokenizer.encode(body.prompt or "")
        else:  # encode_batch releases the GIL
            ids = front.encoder.encode_batch([body.prompt or ""], add_special_tokens=False)[0].ids
    # written in slices: one json.dumps of a million ids holds the GIL (the loop) for tens of milliseconds
    tokens = ",".join(",".join(map(str, ids[i:i + 16384])) for i in range(0, len(ids), 16384))
    return (f'{{"count":{len(ids)},"max_model_len":{front.max_model_len},"tokens":[{tokens}],'
            f'"token_strs":null}}').encode()


def _detokenize(front: Front, tokens: list[int]) -> str:
    """/detokenize's text (in a thread for many ids): each id in the vocabulary, then decoded."""
    vocab = front.generation.limits.vocab_size
    if tokens and not (0 <= min(tokens) and max(tokens) < vocab):
        bad = next(t for t in tokens if not 0 <= t < vocab)
        raise ApiError(400, f"tokens: id {bad} lies outside [0, {vocab})", param="tokens")
    if len(tokens) > LONG_DETOKENIZE and front.encoder is not None:  # decode_batch releases the GIL
        return front.encoder.decode_batch([tokens], skip_special_tokens=True)[0]
    return front.generation.tokenizer.decode(tokens)


def _render(front: Front, messages: list[dict[str, Any]], *args: Any) -> tuple[str, list[int]]:
    """The messages' size checked, then rendered by the chat template and tokenized (in a thread)."""
    check_messages_size(messages, front.max_prompt_bytes)
    return front.chat.encode(messages, *args)


def _prompt_chars(prompt: Any) -> int:
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        return sum(len(p) for p in prompt)
    return 0


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
        enable_auto_tool_choice=getattr(config, "enable_auto_tool_choice", False),
        tool_call_parser=getattr(config, "tool_call_parser", None),
        worker_metrics=tuple(cluster_metrics.targets_of(getattr(config, "worker_metrics", []))),
    )
    app = BodyLimit(create_app(front), front.max_body_bytes)
    server = await http_server.start(app, config.host, config.http_port, tls=serving.tls_config(),
                                     reuse_port=config.reuse_port)
    log.info("OpenAI-compatible HTTP on http://%s:%d/v1", config.host, server.port)
    return server
