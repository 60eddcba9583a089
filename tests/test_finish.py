"""The stop rule and the finish names both tiers share."""

from __future__ import annotations

from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.server.finish import blocked_ids, finish_name, finish_reason, stop_token_id

EOS = frozenset({2})


def test_eos_or_a_stop_id_stops_then_max_tokens_or_the_model_length():
    s = gen_pb.SamplingParams(max_tokens=4, stop_token_ids=[7])
    assert finish_reason(2, 1, 10, s, EOS, 64) == gen_pb.FINISH_REASON_STOP
    assert finish_reason(7, 1, 10, s, EOS, 64) == gen_pb.FINISH_REASON_STOP
    assert finish_reason(5, 4, 10, s, EOS, 64) == gen_pb.FINISH_REASON_LENGTH
    assert finish_reason(5, 1, 64, s, EOS, 64) == gen_pb.FINISH_REASON_LENGTH
    assert finish_reason(5, 3, 63, s, EOS, 64) == gen_pb.FINISH_REASON_UNSPECIFIED
    ignoring = gen_pb.SamplingParams(max_tokens=4, stop_token_ids=[7], ignore_eos=True)
    assert finish_reason(2, 1, 10, ignoring, EOS, 64) == gen_pb.FINISH_REASON_UNSPECIFIED


def test_stop_token_id_names_the_stop_id_not_eos():
    s = gen_pb.SamplingParams(max_tokens=4, stop_token_ids=[7, 2])
    assert (stop_token_id(7, s, EOS), stop_token_id(2, s, EOS), stop_token_id(5, s, EOS)) == (7, None, None)
    s.ignore_eos = True
    assert stop_token_id(2, s, EOS) == 2


def test_blocked_ids_hold_back_eos_and_stop_ids_until_min_tokens():
    s = gen_pb.SamplingParams(max_tokens=8, min_tokens=2, stop_token_ids=[9, 7])
    assert (blocked_ids(s, EOS, 0), blocked_ids(s, EOS, 1), blocked_ids(s, EOS, 2)) == ([2, 7, 9], [2, 7, 9], [])
    s.ignore_eos = True
    assert blocked_ids(s, EOS, 0) == [7, 9]


def test_finish_names():
    assert [finish_name(r) for r in (gen_pb.FINISH_REASON_STOP, gen_pb.FINISH_REASON_LENGTH,
                                     gen_pb.FINISH_REASON_ABORT, gen_pb.FINISH_REASON_ERROR)] == [
        "stop", "length", "abort", "error"]
