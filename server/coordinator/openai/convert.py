"""OpenAI request bodies to the `GenerateRequest` every front shares: fields pdserve cannot honour refused
(400 naming them, never dropped silently), the sampling fields mapped, the prompt's size bounded."""

from __future__ import annotations

import json
from typing import Any

from pdserve.v1 import generation_pb2
from pdserve.server.coordinator.json_input import printable
from pdserve.server.coordinator.openai.errors import ApiError
from pdserve.server.coordinator.openai.protocol import ChatRequest, CompletionRequest, SamplingFields
from pdserve.server.coordinator.openai.structured import structured_output
from pdserve.server.coordinator.openai.tools import ToolPlan
from pdserve.server.model.tokenizer import Tokenizer

MAX_N = 16
"""Most choices one request may ask for (each is a generation of its own)."""
DEFAULT_COMPLETION_TOKENS = 16
"""OpenAI's default max_tokens for /v1/completions; a chat may use the rest of the context."""

Echo = tuple[str, list[int]]
"""Completions with `echo`: the prompt's text and ids, put in front of the output."""


def completion_request(body: CompletionRequest, tokenizer: Tokenizer, vocab_size: int | None = None,
                       max_model_len: int | None = None) -> tuple[generation_pb2.GenerateRequest, Echo | None]:
    """The request for a /v1/completions body (one prompt), and the prompt to echo when asked. Token ids
    outside [0, vocab_size), or more than max_model_len of them, are refused here, before they are decoded
    (echo) or put in the request."""
    generate = generation_pb2.GenerateRequest(
        sampling=sampling_params(body, DEFAULT_COMPLETION_TOKENS if body.max_tokens is None else body.max_tokens)
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
    if not isinstance(prompt, str) and max_model_len is not None and len(prompt) > max_model_len:
        raise ApiError(400, f"prompt: {len(prompt)} tokens exceed the model's max_model_len {max_model_len}",
                       param="prompt")
    if not isinstance(prompt, str) and prompt and vocab_size is not None:
        low, high = min(prompt), max(prompt)
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            raise ApiError(400, f"prompt: token id {bad} lies outside [0, {vocab_size})", param="prompt")
    echo = None
    if body.echo:  # the prompt's ids here, to name its tokens
        ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        text = prompt if isinstance(prompt, str) else tokenizer.decode(ids)
        echo = (text, ids)
        prompt = ids
    if isinstance(prompt, str):
        generate.text = prompt
    else:
        generate.token_ids.ids.extend(prompt)
    return generate, echo


def chat_request(body: ChatRequest, prompt_ids: list[int], max_model_len: int,
                 tools: ToolPlan | None = None) -> generation_pb2.GenerateRequest:
    """The request for a /v1/chat/completions body whose messages rendered to `prompt_ids`; `tools`: its
    tool plan, whose grammar (`required`, a named function) holds the output."""
    max_tokens = body.max_tokens if body.max_completion_tokens is None else body.max_completion_tokens
    if max_tokens is None:
        max_tokens = max(1, max_model_len - len(prompt_ids))
    generate = generation_pb2.GenerateRequest(sampling=sampling_params(body, max_tokens))
    calls = tools.structured() if tools is not None else None
    if calls is not None:
        if generate.sampling.HasField("structured"):
            raise ApiError(400, f"tool_choice: {tools.mode} tool calls have their own grammar; drop response_format "
                                "and structured_outputs", param="tool_choice")
        generate.sampling.structured.CopyFrom(calls)
    generate.token_ids.ids.extend(prompt_ids)
    return generate


def refuse_unsupported(req: SamplingFields) -> None:
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
            ("top_logprobs", req.top_logprobs is not None and req.top_logprobs < 0, "top_logprobs must be >= 0"),
            ("top_logprobs", bool(req.top_logprobs) and not req.logprobs, "top_logprobs > 0 needs logprobs: true"),
        ]
    for param, bad, message in checks:
        if bad:
            raise ApiError(400, f"{param}: {message}", param=param)


def sampling_params(req: SamplingFields, max_tokens: int | None) -> generation_pb2.SamplingParams:
    sampling = generation_pb2.SamplingParams(ignore_eos=req.ignore_eos)
    for name, values in (("stop", [req.stop] if isinstance(req.stop, str) else req.stop),
                         ("stop_token_ids", req.stop_token_ids)):
        try:
            getattr(sampling, name).extend(values or [])
        except (ValueError, TypeError) as e:  # an id outside int64, a string UTF-8 cannot encode
            raise ApiError(400, f"{name}: {printable(str(e))}", param=name) from e
    if not req.skip_special_tokens:
        sampling.skip_special_tokens = False
    structured = structured_output(req.response_format, req.structured_outputs)
    if structured is not None:
        sampling.structured.CopyFrom(structured)
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


def check_prompt_size(text: str, limit: int) -> None:
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > limit:
        raise ApiError(413, f"prompt: a prompt of {size} bytes; the limit is {limit} bytes", param="prompt")


def check_messages_size(messages: list[dict[str, Any]], limit: int) -> None:
    """The messages' JSON size bounds what the chat template renders from them (before rendering)."""
    size = len(json.dumps(messages, ensure_ascii=False, default=str).encode("utf-8", "surrogatepass"))
    if size > limit:
        raise ApiError(413, f"messages: {size} bytes of messages; the limit is {limit} bytes", param="messages")
