"""Checks a GenerateRequest and fills in the sampling defaults the workers receive explicitly."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import grpc
from pdserve.server import metrics, serving
from pdserve.server.coordinator.admission import RequestFailed
from pdserve.server.sampling_rules import sampling_problem, with_defaults
from pdserve.server.structured.checker import ChecksBusy, SpecChecker
from pdserve.server.structured.output_spec import SpecError
from pdserve.v1 import generation_pb2

if TYPE_CHECKING:
    from pdserve.server.coordinator.adapters import Adapter

MAX_STOP_STRINGS = 16
MAX_STOP_BYTES = 1024
"""Each stop string's UTF-8 length."""
MAX_REQUEST_ID_CHARS = 256
DEFAULT_MAX_PROMPT_BYTES = 4 * 2**20


class InvalidRequest(ValueError):
    """A request the server refuses with INVALID_ARGUMENT; the message starts with the field's name."""


class TooLarge(InvalidRequest):
    """A field over its size limit (HTTP 413); refused before any work is spent on it."""


class Encoder(Protocol):
    def encode(self, text: str) -> list[int]: ...


@dataclass(frozen=True)
class Limits:
    max_model_len: int
    """Longest prompt + output the model serves."""
    vocab_size: int
    """Token ids must lie in [0, vocab_size)."""
    max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES
    """A text prompt's UTF-8 length."""
    max_token_bytes: int | None = None
    """The most UTF-8 bytes one token stands for (Tokenizer.max_token_bytes): a text of N bytes is at
    least N / max_token_bytes tokens, so an over-long prompt is refused before it is tokenized."""


@dataclass(frozen=True)
class ValidRequest:
    request_id: str
    prompt_ids: list[int]
    sampling: generation_pb2.SamplingParams
    """Every optional field but `seed` set; `seed` only when the client set it."""
    lora: Adapter | None = None
    """The LoRA adapter it names (`GenerateRequest.lora_name`), resolved by the service; None: the base model."""


def validate_sampling(given: generation_pb2.SamplingParams, limits: Limits) -> generation_pb2.SamplingParams:
    """Every default filled in and every value in bounds (server/sampling_rules.py, the workers' rule too);
    the stop strings, which only the coordinator reads, within their count and size. The structured-output
    spec is `check_spec`'s, awaited after this."""
    sampling = with_defaults(given)
    problem = sampling_problem(sampling, limits.vocab_size)
    if problem:
        raise InvalidRequest(problem)
    if len(given.stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"stop holds {len(given.stop)} strings; at most {MAX_STOP_STRINGS} are allowed")
    if any(not s for s in given.stop):
        raise InvalidRequest("stop must not contain an empty string")
    for s in given.stop:
        if len(s) * 4 > MAX_STOP_BYTES and len(s.encode()) > MAX_STOP_BYTES:
            raise TooLarge(f"stop: a stop string of {len(s.encode())} bytes; the limit is {MAX_STOP_BYTES} bytes")
    return sampling


async def check_spec(spec: generation_pb2.StructuredOutput, checker: SpecChecker, where: str | None = None) -> None:
    """The structured-output spec (if set) within its limits and valid, checked by a grammar child process
    (its native work never runs here) while the event loop runs on; InvalidRequest naming `where`, or
    RequestFailed RESOURCE_EXHAUSTED (with a retry hint) when the grammar processes are overloaded."""
    if spec.WhichOneof("kind"):
        try:
            await checker.check(spec, where)
        except SpecError as e:
            raise InvalidRequest(str(e)) from e
        except ChecksBusy as e:
            metrics.request_failure.labels(grpc.StatusCode.RESOURCE_EXHAUSTED.name).inc()
            raise RequestFailed(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{e}; you may retry", serving.retry_hint()) from e


def validate_prompt_ids(ids: list[int], limits: Limits) -> None:
    for i in ids:
        if not 0 <= i < limits.vocab_size:
            raise InvalidRequest(f"token_ids: id {i} lies outside [0, {limits.vocab_size})")


def check_length(num_prompt_tokens: int, max_tokens: int, limits: Limits) -> None:
    total = num_prompt_tokens + max_tokens
    if total > limits.max_model_len:
        raise InvalidRequest(
            f"max_tokens {max_tokens} + a prompt of {num_prompt_tokens} tokens = {total} exceeds "
            f"the model's max_model_len {limits.max_model_len}"
        )


def check_text_size(text: str, max_tokens: int, limits: Limits) -> None:
    """Refuses a text too large to serve from its size alone (before tokenizing it)."""
    if len(text) * 4 <= limits.max_prompt_bytes and limits.max_token_bytes is None:
        return
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > limits.max_prompt_bytes:
        raise TooLarge(f"text: a prompt of {size} bytes; the limit is {limits.max_prompt_bytes} bytes")
    if limits.max_token_bytes:
        at_least = -(-size // limits.max_token_bytes)
        if at_least + max_tokens > limits.max_model_len:
            raise InvalidRequest(
                f"max_tokens {max_tokens} + a prompt of at least {at_least} tokens (text of {size} bytes) = "
                f"{at_least + max_tokens} exceeds the model's max_model_len {limits.max_model_len}")


def validate(request: generation_pb2.GenerateRequest, tokenizer: Encoder, limits: Limits) -> ValidRequest:
    """Raises InvalidRequest naming the field at fault; tokenizes a text prompt."""
    if len(request.request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequest(
            f"request_id has {len(request.request_id)} characters; at most {MAX_REQUEST_ID_CHARS}"
        )
    sampling = validate_sampling(request.sampling, limits)
    kind = request.WhichOneof("prompt")
    if kind == "text" and request.text:
        check_text_size(request.text, sampling.max_tokens, limits)
        prompt_ids = tokenizer.encode(request.text)
        field = "text"
    elif kind == "token_ids" and request.token_ids.ids:
        check_length(len(request.token_ids.ids), sampling.max_tokens, limits)  # before reading the ids
        prompt_ids = list(request.token_ids.ids)
        validate_prompt_ids(prompt_ids, limits)
        field = "token_ids"
    else:
        raise InvalidRequest("prompt must not be empty: set text or token_ids")
    if not prompt_ids:
        raise InvalidRequest(f"{field} encodes to no tokens")
    check_length(len(prompt_ids), sampling.max_tokens, limits)
    return ValidRequest(
        request_id=request.request_id or uuid.uuid4().hex,
        prompt_ids=prompt_ids,
        sampling=sampling,
    )
