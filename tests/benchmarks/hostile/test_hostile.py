"""The hostile harness, bounded: every family's worst cases against one small `pdserve up`, and the
acceptance asserted as the full run asserts it (no process death, no 5xx / UNKNOWN / reset / hang for
bad input, the greedy stream's worst gap under 2 s). Plus the harness's own pieces, checked exactly.
"""

from __future__ import annotations

import json

import grpc
import pytest
from google.protobuf.message import DecodeError
from pdserve.benchmarks.hostile import payloads as hp
from pdserve.benchmarks.hostile.run import run_hostile, schedule, table
from pdserve.benchmarks.hostile.families import FAMILIES, Case, Targets, families
from pdserve.benchmarks.hostile.send import Outcome, _grpc_outcome, _http_outcome
from pdserve.benchmarks.servers import pdserve_up
from pdserve.v1 import generation_pb2 as gen_pb

TARGETS = Targets("127.0.0.1:1", "http://127.0.0.1:2", "m", ("127.0.0.1:3",), ("127.0.0.1:4",))


def test_payloads_are_what_they_say():
    defs = json.loads(hp.chained_defs())
    assert len(defs["$defs"]) == 701 and defs["$defs"]["d0"]["properties"]["next"] == {"$ref": "#/$defs/d1"}
    assert len(json.loads(hp.wide_schema())["properties"]) == 10_000
    assert hp.deep_schema(3) == ('{"type":"object","properties":{"a":' * 3 + '{"type":"string"}' + "}}" * 3)
    assert hp.lark_chain(2) == 'start: r0\nr0: "a" r1 | "b"\nr1: "a" r2 | "b"\nr2: "c"\n'
    assert len(hp.tool_list()) == 1_000
    body = hp.embed({"a": hp.RAW}, "[[1]]")
    assert body == '{"a": [[1]]}'
    raw = gen_pb.GenerateRequest(text=hp.BAD).SerializeToString()
    assert hp.bad_bytes(raw) == b"\x12\x07" + hp.INVALID_UTF8
    with pytest.raises(DecodeError):
        gen_pb.GenerateRequest.FromString(hp.bad_bytes(raw))  # protobuf itself refuses the string


def test_outcomes_classify_by_status():
    assert _http_outcome(400, b"") == Outcome("client_error", "400", "")
    assert _http_outcome(413, b"x").kind == "client_error"
    assert _http_outcome(200, b"").kind == "served"
    assert _http_outcome(500, b"boom").kind == "failure"
    assert _http_outcome(200, b'data: {"error": {"code": 500}}').kind == "failure"
    assert _http_outcome(200, b'data: {"error": {"code": 400}}').kind == "client_error"

    class Err(grpc.RpcError):
        def __init__(self, code):
            self._code = code

        def code(self):
            return self._code

        def details(self):
            return "d"

    assert _grpc_outcome(Err(grpc.StatusCode.INVALID_ARGUMENT)).kind == "client_error"
    assert _grpc_outcome(Err(grpc.StatusCode.UNAUTHENTICATED)).kind == "client_error"
    for code in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE):
        assert _grpc_outcome(Err(code)).kind == "failure"
    assert _grpc_outcome(Err(grpc.StatusCode.DEADLINE_EXCEEDED)).code == "hang"


def test_schedule_takes_families_in_turn_and_every_port():
    cases = families(TARGETS)
    assert list(cases) == list(FAMILIES)
    plan = schedule(cases, 2 * len(cases))
    assert [c.family for c in plan[: len(cases)]] == list(FAMILIES)
    assert [c.name for c in plan[len(cases):]] == [cases[f][1].name for f in FAMILIES]
    ports = {c.port for cs in cases.values() for c in cs}
    assert ports == {"openai", "grpc", "kserve", "internal"}
    assert all(isinstance(c, Case) for c in plan)


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    with pdserve_up(tiny_model("llama"), tmp_path_factory.mktemp("hostile"), timeout=300) as up:
        yield up


def test_hostile_run_meets_the_acceptance(cluster):
    """About 14 requests of each family (its worst first): a bounded copy of the 10,000-request run."""
    report = run_hostile(cluster, requests=14 * len(FAMILIES), concurrency=8, deadline=30.0, progress=False)
    assert report.requests == 14 * len(FAMILIES)
    assert report.problems == [], table(report)
