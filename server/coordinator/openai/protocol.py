"""The OpenAI request bodies pdserve reads (pydantic): completions, chat, and vLLM's tokenize/detokenize."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(BaseModel):
    """What both endpoints share. A field pdserve does not know is refused (400 naming it), never
    dropped silently: `convert.refuse_unsupported` reads them from `model_extra`."""

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
    return_token_ids: bool | None = None
    """vLLM's: the answer carries each choice's output `token_ids` and the `prompt_token_ids` (in streaming, the
    prompt's in the first chunk, each chunk its new ids)."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int = 0
    skip_special_tokens: bool = True
    """vLLM's: false puts special tokens' text in the output text."""
    min_p: float | None = None
    best_of: int | None = None
    user: str | None = None
    """OpenAI's end-user id: accepted, not used."""
    response_format: dict[str, Any] | None = None
    """OpenAI's: text, json_object or json_schema (vLLM takes it on completions too)."""
    structured_outputs: dict[str, Any] | None = None
    """vLLM's: one of json, json_object, regex, choice, grammar, structural_tag (openai/structured.py)."""


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
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra variables for the chat template (vLLM's extension), e.g. {"enable_thinking": false}."""
