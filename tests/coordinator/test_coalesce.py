"""Coalescing a stream's decode events (attempt._merged): what piled up goes out in fewer events, the
ids and logprobs exactly as they came, no merged event over --max-coalesce ids (a worker's event stays whole)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pdserve.v1 import generation_pb2, worker_pb2
from pdserve.server.coordinator.attempt import _merged

FinishReason = generation_pb2.FinishReason


def tokens(*ids: int, logprobs: bool = True, prompt_logprobs: int = 0) -> worker_pb2.SequenceEvent:
    return worker_pb2.SequenceEvent(request_id="r", tokens=worker_pb2.TokenEvent(
        token_ids=ids, logprobs=[generation_pb2.TokenLogprob(token_id=i, logprob=-i) for i in ids] if logprobs else [],
        prompt_logprobs=[generation_pb2.TokenLogprob(token_id=i) for i in range(prompt_logprobs)]))


FINISHED = worker_pb2.SequenceEvent(request_id="r", finished=worker_pb2.Finished(
    reason=FinishReason.FINISH_REASON_LENGTH))


def shape(events: list) -> list:
    return [list(e.tokens.token_ids) if e.WhichOneof("event") == "tokens" else e.WhichOneof("event")
            for e in events]


def test_runs_of_tokens_join_up_to_the_cap_and_finished_stays_last():
    events = [tokens(1), tokens(2), tokens(3, 4), tokens(5), FINISHED]
    assert shape(_merged([*events], 64)) == [[1, 2, 3, 4, 5], "finished"]
    events = [tokens(1), tokens(2), tokens(3, 4), tokens(5), FINISHED]
    assert shape(_merged(events, 3)) == [[1, 2], [3, 4, 5], "finished"]


def test_an_event_is_never_split_and_max_coalesce_1_merges_nothing():
    """An event the worker joined from several steps goes out as it came (--max-coalesce 1: one response
    per decode event)."""
    assert shape(_merged([tokens(1, 2, 3), tokens(4)], 2)) == [[1, 2, 3], [4]]
    assert shape(_merged([tokens(1), tokens(2, 3), tokens(4)], 1)) == [[1], [2, 3], [4]]


def test_prompt_logprobs_start_a_new_event():
    merged = _merged([tokens(1), tokens(2, 3, prompt_logprobs=2), tokens(4)], 8)
    assert shape(merged) == [[1], [2, 3, 4]]
    assert [len(e.tokens.prompt_logprobs) for e in merged] == [0, 2]


def test_one_event_is_returned_as_it_is():
    event = tokens(1, 2, 3)
    assert _merged([event], 2)[0] is event
    assert _merged([FINISHED], 1)[0] is FINISHED


@given(st.lists(st.lists(st.integers(0, 1000), min_size=1, max_size=5), min_size=1, max_size=12),
       st.integers(1, 8), st.booleans(), st.booleans())
def test_the_ids_and_logprobs_are_exactly_those_that_came(chunks, cap, logprobs, finished):
    events = [tokens(*ids, logprobs=logprobs) for ids in chunks] + ([FINISHED] if finished else [])
    merged = _merged(events, cap)
    ids = [i for c in chunks for i in c]
    assert [i for e in merged for i in e.tokens.token_ids] == ids
    assert [lp.token_id for e in merged for lp in e.tokens.logprobs] == (ids if logprobs else [])
    longest = max(cap, *(len(c) for c in chunks))  # an event over the cap stays whole
    assert all(1 <= len(e.tokens.token_ids) <= longest for e in merged if e.WhichOneof("event") == "tokens")
    assert (merged[-1].WhichOneof("event") == "finished") == finished
    assert len(merged) <= len(events)
