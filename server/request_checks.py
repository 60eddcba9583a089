"""What a worker checks in a request, whoever sent it: ids, lengths, sampling values, sizes.

The coordinator validates clients' requests (coordinator/validate.py) and fills every default; a worker
still checks what reaches it, so a direct or buggy caller gets INVALID_ARGUMENT naming the field and
can never put a value into a batch that would fail the step for every request in it. Each function
returns the problem as a sentence starting with the field's name, or None.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.server import sampling_rules

MAX_REQUEST_ID_CHARS = 512
MAX_TRANSFER_TOKEN_BYTES = 64
MAX_LEASE_SECONDS = 120.0
"""The longest a decode worker holds a request's blocks waiting for its KV."""


def ids_problem(field: str, ids: Sequence[int], vocab_size: int) -> str | None:
    if not ids:
        return f"{field} must not be empty"
    low, high = min(ids), max(ids)
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        return f"{field}: id {bad} lies outside the vocabulary [0, {vocab_size})"
    return None


def sampling_problem(p: gen_pb.SamplingParams, vocab_size: int) -> str | None:
    """The sampling values a step can use: the coordinator's rule (server/sampling_rules.py)."""
    return sampling_rules.sampling_problem(p, vocab_size, prefix="sampling.")


def identity_problem(request_id: str, transfer_token: bytes) -> str | None:
    if not request_id:
        return "request_id must be set"
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        return f"request_id has {len(request_id)} characters; at most {MAX_REQUEST_ID_CHARS}"
    if len(transfer_token) > MAX_TRANSFER_TOKEN_BYTES:
        return f"transfer_token has {len(transfer_token)} bytes; at most {MAX_TRANSFER_TOKEN_BYTES}"
    return None


def length_problem(field: str, num_tokens: int, max_new: int, max_model_len: int) -> str | None:
    if num_tokens + max_new > max_model_len:
        return (f"{field}: {num_tokens} tokens + {max_new} to generate = {num_tokens + max_new} exceeds the "
                f"model's max_model_len {max_model_len}")
    return None


def lease_problem(seconds: float) -> str | None:
    if not (math.isfinite(seconds) and 0 <= seconds <= MAX_LEASE_SECONDS):
        return f"lease_seconds must lie in [0, {MAX_LEASE_SECONDS:g}] (0: the default), got {seconds}"
    return None
