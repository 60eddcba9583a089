"""Workloads: bench's flags give bench's requests at bench's times; traces are checked field by field."""

from __future__ import annotations

import math

import pytest

from pdserve.server.plan import datasets
from pdserve.server.plan.arrivals import LoadSpec, arrival_offsets
from pdserve.server.plan.simulate_cli import build_parser
from pdserve.server.plan.workload import WorkloadError, from_args, parse_trace


def test_bench_flags_give_the_requests_bench_sends():
    args = build_parser().parse_args(["--profile", "p.json", "--input-len", "64", "--output-len", "8",
                                      "--length-dist", "lognormal", "--sigma", "0.3", "--request-rate", "5",
                                      "--duration", "4", "--seed", "7"])
    work = from_args(args)
    sent = datasets.synthetic(1000, input_len=64, output_len=8, vocab_size=500, dist="lognormal", sigma=0.3,
                              range_ratio=0.5, seed=7)
    offsets = []
    for t in arrival_offsets(LoadSpec(rate=5, seed=7)):
        if t >= 4:
            break
        offsets.append(t)
    assert [r.arrival for r in work] == offsets
    assert [r.prompt_ids for r in work] == [s.prompt_ids for s in sent[: len(work)]]
    assert [r.output_len for r in work] == [s.output_len for s in sent[: len(work)]]


def test_a_closed_loop_is_refused():
    args = build_parser().parse_args(["--profile", "p", "--num-prompts", "3"])
    args.request_rate = math.inf
    with pytest.raises(WorkloadError, match="--request-rate must be finite"):
        from_args(args)


def test_jsonl_trace_with_shared_prefixes():
    text = "\n".join([
        '{"arrival_s": 0, "prompt_len": 20, "output_len": 4, "prefix_group": "sys", "prefix_len": 16}',
        '{"arrival_s": 0.5, "prompt_len": 18, "output_len": 2, "prefix_group": "sys", "prefix_len": 16}',
        '{"arrival_s": 1.0, "prompt_len": 5, "output_len": 1}',
    ])
    a, b, c = parse_trace(text)
    assert (a.arrival, a.prompt_len, a.output_len) == (0.0, 20, 4)
    assert a.prompt_ids[:16] == b.prompt_ids[:16] and a.prompt_ids[16:] != b.prompt_ids[16:18]
    assert (c.arrival, c.prompt_len) == (1.0, 5)


def test_csv_trace():
    (r,) = parse_trace("arrival_s,prompt_len,output_len\n0.25,7,3\n")
    assert (r.arrival, r.prompt_len, r.output_len) == (0.25, 7, 3)


@pytest.mark.parametrize("line, message", [
    ('{"arrival_s": 0, "prompt_len": -3, "output_len": 4}', "line 1: field 'prompt_len' must be >= 1, got -3"),
    ('{"arrival_s": 0, "prompt_len": 3, "output_len": 0}', "line 1: field 'output_len' must be >= 1, got 0"),
    ('{"arrival_s": -1, "prompt_len": 3, "output_len": 1}', "field 'arrival_s' must be a finite number >= 0"),
    ('{"prompt_len": 3, "output_len": 1}', "line 1: field 'arrival_s' is missing"),
    ('{"arrival_s": 0, "prompt_len": "many", "output_len": 1}', "field 'prompt_len' must be an integer, got 'many'"),
    ('{"arrival_s": 0, "prompt_len": 2.5, "output_len": 1}', "field 'prompt_len' must be an integer"),
    ('{"arrival_s": 0, "prompt_len": 3, "output_len": 1, "prefix_len": 4, "prefix_group": "g"}',
     "field 'prefix_len' must be in [0, prompt_len=3]"),
    ('{"arrival_s": 0, "prompt_len": 3, "output_len": 1, "prefix_len": 2}', "'prefix_len' needs a 'prefix_group'"),
    ('{"arrival_s": 0, ', "line 1: not JSON"),
])
def test_bad_trace_lines_are_refused_naming_the_field(line, message):
    with pytest.raises(WorkloadError) as e:
        parse_trace(line, "t.jsonl")
    assert message in str(e.value) and str(e.value).startswith("t.jsonl")


def test_unsorted_and_empty_traces_are_refused():
    with pytest.raises(WorkloadError, match="line 2: field 'arrival_s' .* is before the line above's"):
        parse_trace('{"arrival_s": 1, "prompt_len": 3, "output_len": 1}\n'
                    '{"arrival_s": 0.5, "prompt_len": 3, "output_len": 1}')
    with pytest.raises(WorkloadError, match="holds no requests"):
        parse_trace("  \n")
    with pytest.raises(WorkloadError, match="line 2: field 'prompt_len' must be >= 1, got 0"):
        parse_trace("arrival_s,prompt_len,output_len\n0,0,1\n")
