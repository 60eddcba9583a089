"""The sampling parameters' defaults and bounds: one rule for the coordinator and the workers.

The coordinator fills every default the workers get explicitly (`with_defaults`) and refuses a value
out of bounds, naming the field (coordinator/validate.py); each worker checks what reaches it by the
same rule (request_checks.py), whoever sent it, so no value that would fail a step for every request
in its batch gets in. The bounds are vLLM's (`SamplingParams`), which its OpenAI server enforces:
- max_tokens >= 1; temperature 0 (greedy) or finite and >= MIN_TEMPERATURE; top_p in (0, 1] (0
  would keep no token); top_k >= 0 (0: off); min_p in [0, 1] (0: off);
- presence and frequency penalties in [-2, 2]; repetition_penalty finite and > 0 (1: off);
- min_tokens <= max_tokens; logprobs and prompt_logprobs <= MAX_LOGPROBS; stop token ids in the vocabulary.
An unset optional field reads as its default (top_p and repetition_penalty 1, the rest 0), but
max_tokens: a worker needs it set (the coordinator always sets it).
"""

from __future__ import annotations

import math

from pdserve.server.logprobs import MAX_LOGPROBS
from pdserve.v1 import generation_pb2 as gen_pb

DEFAULT_MAX_TOKENS = 16
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0
DEFAULT_TOP_K = 0
DEFAULT_REPETITION_PENALTY = 1.0
MIN_TEMPERATURE = 1e-5
"""Below this (and above 0) logits / temperature overflows float32; 0 means greedy."""


def with_defaults(given: gen_pb.SamplingParams) -> gen_pb.SamplingParams:
    """What the workers get: max_tokens, temperature, top_p and top_k always set; a penalty, min_p or
    min_tokens only when it is on; seed and the logprobs fields only when the client set them; the
    structured output as given (checked by structured/output_spec.py); skip_special_tokens only when off (the
    coordinator's, for the text)."""
    sampling = gen_pb.SamplingParams(
        max_tokens=given.max_tokens if given.HasField("max_tokens") else DEFAULT_MAX_TOKENS,
        temperature=given.temperature if given.HasField("temperature") else DEFAULT_TEMPERATURE,
        top_p=given.top_p if given.HasField("top_p") else DEFAULT_TOP_P,
        top_k=given.top_k if given.HasField("top_k") else DEFAULT_TOP_K,
        stop=given.stop,
        stop_token_ids=given.stop_token_ids,
        ignore_eos=given.ignore_eos,
    )
    if given.HasField("structured"):
        sampling.structured.CopyFrom(given.structured)
    for name in ("seed", "logprobs", "prompt_logprobs"):
        if given.HasField(name):
            setattr(sampling, name, getattr(given, name))
    for name in ("presence_penalty", "frequency_penalty", "min_p", "min_tokens"):
        if getattr(given, name):
            setattr(sampling, name, getattr(given, name))
    if given.HasField("repetition_penalty") and given.repetition_penalty != DEFAULT_REPETITION_PENALTY:
        sampling.repetition_penalty = given.repetition_penalty
    if given.HasField("skip_special_tokens") and not given.skip_special_tokens:
        sampling.skip_special_tokens = False
    return sampling


def top_p_of(p: gen_pb.SamplingParams) -> float:
    return p.top_p if p.HasField("top_p") else DEFAULT_TOP_P


def repetition_penalty_of(p: gen_pb.SamplingParams) -> float:
    return p.repetition_penalty if p.HasField("repetition_penalty") else DEFAULT_REPETITION_PENALTY


def sampling_problem(p: gen_pb.SamplingParams, vocab_size: int, prefix: str = "") -> str | None:
    """The first value out of bounds, as a sentence starting with the field's name (after `prefix`:
    "sampling." on the workers), or None."""
    top_p, repetition = top_p_of(p), repetition_penalty_of(p)
    if p.max_tokens <= 0:
        return f"{prefix}max_tokens must be >= 1, got {p.max_tokens}"
    if not (p.temperature >= 0 and math.isfinite(p.temperature)):
        return f"{prefix}temperature must be >= 0 (0 means greedy), got {p.temperature}"
    if 0 < p.temperature < MIN_TEMPERATURE:  # logits / temperature would overflow
        return f"{prefix}temperature must be 0 (greedy) or >= {MIN_TEMPERATURE}, got {p.temperature}"
    if not 0 < top_p <= 1:
        return f"{prefix}top_p must lie in (0, 1], got {top_p}"
    if p.top_k < 0:
        return f"{prefix}top_k must be >= 0 (0 turns it off), got {p.top_k}"
    for i in p.stop_token_ids:
        if not 0 <= i < vocab_size:
            return f"{prefix}stop_token_ids: id {i} lies outside [0, {vocab_size})"
    for name in ("presence_penalty", "frequency_penalty"):
        if not -2 <= getattr(p, name) <= 2:
            return f"{prefix}{name} must lie in [-2, 2], got {getattr(p, name)}"
    if not (repetition > 0 and math.isfinite(repetition)):
        return f"{prefix}repetition_penalty must be > 0 (1 is off), got {repetition}"
    if not 0 <= p.min_p <= 1:
        return f"{prefix}min_p must lie in [0, 1] (0 is off), got {p.min_p}"
    if p.min_tokens > p.max_tokens:
        return f"{prefix}min_tokens {p.min_tokens} exceeds {prefix}max_tokens {p.max_tokens}"
    for name in ("logprobs", "prompt_logprobs"):
        if getattr(p, name) > MAX_LOGPROBS:
            return f"{prefix}{name} must lie in [0, {MAX_LOGPROBS}], got {getattr(p, name)}"
    return None
