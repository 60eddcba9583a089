"""When a generation ends, and the names its finish reasons go by: one rule for both tiers.

The stop rule, checked by a decode worker after each token and by the coordinator after a migration
(the outputs already sent may have ended the request): the token is EOS (unless `ignore_eos`) or one
of `stop_token_ids` -> stop; else the outputs reached `max_tokens`, or the sequence `max_model_len`
-> length. Until `min_tokens` outputs are out, the ids that would stop it are not sampled
(`blocked_ids`). Stop strings end text, not ids: the coordinator cuts them (coordinator/detokenizer.py).
"""

from __future__ import annotations

from collections.abc import Container, Iterable

from pdserve.v1 import generation_pb2 as gen_pb

FINISH_NAMES: dict[int, str] = {
    gen_pb.FINISH_REASON_STOP: "stop",
    gen_pb.FINISH_REASON_LENGTH: "length",
    gen_pb.FINISH_REASON_ABORT: "abort",
    gen_pb.FINISH_REASON_ERROR: "error",
}
"""What the APIs call each reason (OpenAI's and KServe's finish_reason, `pdserve generate`, the metrics)."""


def finish_name(reason: int) -> str:
    """A finished response's reason by name; one without a name reads as "stop"."""
    return FINISH_NAMES.get(reason, "stop")


def ends_output(token: int, sampling: gen_pb.SamplingParams, eos_ids: Container[int]) -> bool:
    """`token` ends the output: EOS (unless ignore_eos) or a stop token id."""
    return (token in eos_ids and not sampling.ignore_eos) or token in sampling.stop_token_ids


def finish_reason(token: int, num_outputs: int, num_tokens: int, sampling: gen_pb.SamplingParams,
                  eos_ids: Container[int], max_model_len: int) -> int:
    """The reason the request ends with `token`, its output number `num_outputs` (counted from the
    request's start, migrations included) in a sequence now `num_tokens` long; UNSPECIFIED: it goes on."""
    if ends_output(token, sampling, eos_ids):
        return gen_pb.FINISH_REASON_STOP
    if num_outputs >= sampling.max_tokens or num_tokens >= max_model_len:
        return gen_pb.FINISH_REASON_LENGTH
    return gen_pb.FINISH_REASON_UNSPECIFIED


def blocked_ids(sampling: gen_pb.SamplingParams, eos_ids: Iterable[int], num_outputs: int) -> list[int]:
    """The ids the next token may not be while fewer than min_tokens of the request's outputs are out
    (`num_outputs` so far): the stop token ids and, unless ignore_eos, EOS (vLLM's min_tokens)."""
    if num_outputs >= sampling.min_tokens:
        return []
    eos = set() if sampling.ignore_eos else set(eos_ids)
    return sorted(eos | set(sampling.stop_token_ids))


def stop_token_id(token: int, sampling: gen_pb.SamplingParams, eos_ids: Container[int]) -> int | None:
    """vLLM's stop_reason for an output that `token` ended: the stop token id, or None when EOS ended it."""
    if token in sampling.stop_token_ids and (sampling.ignore_eos or token not in eos_ids):
        return token
    return None
