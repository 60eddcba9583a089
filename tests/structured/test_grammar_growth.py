"""A grammar that compiles but outgrows llguidance's parser limits once output starts (thousands of
alternatives behind one shared prefix): refused at the front by the check's trial draws, and, should one get
past them, its request ends with INVALID_ARGUMENT naming the field, never INTERNAL ("decode step failed")."""

from __future__ import annotations

import asyncio
import itertools

import grpc
import pytest

from pdserve.server.coordinator.attempt import finish_failed
from pdserve.server.decode.sequence import Sequence
from pdserve.server.structured.output_spec import SpecError
from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.v1 import worker_pb2 as pb
from tests.structured.vocab import EOS, grammars

SO = gen_pb.StructuredOutput


def shared_prefix_alternatives(length: int = 12) -> str:
    """2**length alternatives, each "x" then `length` of a/b: after the "x" the parser's row holds them all
    (llguidance's limit is 2,000 items a row)."""
    words = ("x" + "".join(w) for w in itertools.product("ab", repeat=length))
    return "start: " + " | ".join(f'"{w}"' for w in words) + "\n"


async def test_the_check_refuses_a_grammar_that_outgrows_the_parser_after_its_first_token():
    g = grammars()
    with pytest.raises(SpecError, match=r"^sampling\.structured\.grammar: grammar too complex: a trial output "
                                        r"exceeds a parser limit \(.*max is 2000"):
        await g.prepare(SO(grammar=shared_prefix_alternatives()))
    small = SO(grammar=shared_prefix_alternatives(4))  # 16 alternatives: served
    await g.prepare(small)
    assert g.is_cached(small)


async def test_a_grammar_failing_mid_output_ends_its_request_as_the_clients_fault():
    g = grammars(isolated=False)  # no check: as if the grammar got past it
    seq = Sequence("r", [1, 2], gen_pb.SamplingParams(max_tokens=8), frozenset({EOS}), 64,
                   constraint=g.constraint(SO(grammar=shared_prefix_alternatives())))
    seq.append(9)  # "x"
    event = seq.finished_event()
    assert event.reason == gen_pb.FINISH_REASON_ERROR
    assert event.status == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert event.message.startswith("sampling.structured: grammar too complex: at output token 0 it exceeds a "
                                    "parser limit (Parser Error: Current row has 4097 items; max is 2000")
    failed = finish_failed("127.0.0.1:1", event)
    assert failed.code == grpc.StatusCode.INVALID_ARGUMENT and failed.details == event.message
    await asyncio.sleep(0)


@pytest.mark.parametrize("status", [0, grpc.StatusCode.OK.value[0], grpc.StatusCode.UNKNOWN.value[0], 99])
def test_any_other_error_finish_is_the_servers_fault(status):
    failed = finish_failed("127.0.0.1:1", pb.Finished(reason=gen_pb.FINISH_REASON_ERROR, message="decode step "
                                                      "failed", status=status))
    assert failed.code == grpc.StatusCode.INTERNAL
    assert failed.details == "decode worker 127.0.0.1:1: decode step failed"
