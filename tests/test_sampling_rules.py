"""One rule for sampling values on both tiers: the coordinator's defaults and the workers' checks agree."""

from __future__ import annotations

import pytest

from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.server import request_checks
from pdserve.server.sampling_rules import sampling_problem, with_defaults


def test_defaults_set_what_the_workers_read_and_leave_what_is_off():
    s = with_defaults(gen_pb.SamplingParams(repetition_penalty=1.0, presence_penalty=0.0, seed=0))
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed) == (16, 1.0, 1.0, 0, 0)
    assert [f.name for f, _ in s.ListFields()] == ["max_tokens", "temperature", "top_p", "top_k", "seed"]


@pytest.mark.parametrize("top_p, problem", [
    (0.0, "top_p must lie in (0, 1], got 0.0"),
    (1.5, "top_p must lie in (0, 1], got 1.5"),
    (float("nan"), "top_p must lie in (0, 1], got nan"),
    (1e-6, None),
    (1.0, None),
])
def test_top_p_lies_in_0_1_on_both_tiers(top_p, problem):
    """vLLM's bound: top_p 0 keeps no token (the coordinator refused it; a worker used to take it)."""
    given = gen_pb.SamplingParams(max_tokens=4, top_p=top_p)
    assert sampling_problem(given, 10) == problem
    assert request_checks.sampling_problem(given, 10) == (problem and f"sampling.{problem}")


def test_a_worker_reads_an_unset_top_p_and_repetition_penalty_as_off_but_needs_max_tokens():
    assert request_checks.sampling_problem(gen_pb.SamplingParams(max_tokens=4), 10) is None
    assert request_checks.sampling_problem(gen_pb.SamplingParams(), 10) == "sampling.max_tokens must be >= 1, got 0"
    assert (request_checks.sampling_problem(gen_pb.SamplingParams(max_tokens=2, min_tokens=3), 10)
            == "sampling.min_tokens 3 exceeds sampling.max_tokens 2")


def test_the_structured_output_goes_to_the_workers_as_given():
    spec = gen_pb.StructuredOutput(regex="[ab]+")
    assert with_defaults(gen_pb.SamplingParams(structured=spec)).structured == spec
    assert not with_defaults(gen_pb.SamplingParams()).HasField("structured")
