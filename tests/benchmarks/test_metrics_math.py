"""The harness's arithmetic on hand-computed traces: every expected value below is worked out by hand."""

from __future__ import annotations

import asyncio
import json
import math

import pytest

from pdserve.server.plan import datasets
from pdserve.benchmarks.bench import Group, run_groups
from pdserve.benchmarks.clients import Target
from pdserve.server.plan.run_summary import RequestOutput
from pdserve.server.plan.arrivals import LoadSpec, arrival_offsets
from pdserve.benchmarks.metrics import prometheus_value, throughput_timeline
from pdserve.server.plan.run_summary import max_itl, stats, summarize, tpot

approx = lambda x: pytest.approx(x, rel=1e-9, abs=1e-9)


def trace(sent, chunks, done, output_len, prompt_len, success=True):
    return RequestOutput(
        group="g",
        prompt_len=prompt_len,
        sent=sent,
        chunk_times=[t for t, _ in chunks],
        chunk_tokens=[k for _, k in chunks],
        done=done,
        output_len=output_len,
        success=success,
        finish_reason="length" if success else "",
        error="" if success else "UNAVAILABLE: x",
    )


@pytest.fixture
def traces():
    a = trace(0.0, [(0.1, 1), (0.3, 1), (0.6, 1)], 0.6, 3, 10)  # TTFT 100, ITL 200/300, TPOT 250, E2E 600
    b = trace(0.2, [(0.7, 1)], 0.7, 1, 20)  # TTFT 500, no ITL, no TPOT, E2E 500
    c = trace(0.5, [(0.9, 2), (1.0, 2)], 1.0, 4, 5)  # TTFT 400, ITL 100, TPOT 100/3, E2E 500
    d = trace(0.1, [], 0.3, 0, 7, success=False)
    return [a, b, c, d]


def test_per_request_definitions(traces):
    a, b, c, _ = traces
    assert a.ttft == approx(0.1) and a.itl == [approx(0.2), approx(0.3)] and a.latency == approx(0.6)
    assert tpot(a) == approx(0.25)
    assert tpot(b) is None and b.itl == []
    assert tpot(c) == approx(0.1 / 3)


def test_summary_throughputs_and_percentiles(traces):
    s = summarize(traces)
    assert (s["requests"], s["completed"], s["failed"]) == (4, 3, 1)
    assert s["duration_s"] == approx(1.0)
    assert (s["prompt_tokens"], s["output_tokens"]) == (35, 8)  # the failed request's 7 are not counted
    assert s["request_throughput"] == approx(3.0)
    assert s["output_throughput"] == approx(8.0)
    assert s["total_token_throughput"] == approx(43.0)
    # TTFT [100, 500, 400] ms; np.percentile linear: p90 at rank 1.8 of [100, 400, 500]
    assert s["ttft_ms"] == {
        "n": 3,
        "mean": approx(1000 / 3),
        "median": approx(400),
        "std": approx(s["ttft_ms"]["std"]),
        "p50": approx(400),
        "p90": approx(480),
        "p99": approx(498),
    }
    assert s["ttft_ms"]["std"] == approx(
        math.sqrt(((100 - 1000 / 3) ** 2 + (500 - 1000 / 3) ** 2 + (400 - 1000 / 3) ** 2) / 3)
    )
    # ITL pooled over requests: [200, 300, 100]
    assert (s["itl_ms"]["n"], s["itl_ms"]["mean"], s["itl_ms"]["p90"], s["itl_ms"]["p99"]) == (
        3,
        approx(200),
        approx(280),
        approx(298),
    )
    # TPOT only for output_len > 1: [250, 33.33..]
    assert s["tpot_ms"]["n"] == 2
    assert s["tpot_ms"]["mean"] == approx((250 + 100 / 3) / 2)
    assert s["tpot_ms"]["p90"] == approx(100 / 3 + 0.9 * (250 - 100 / 3))
    assert s["tpot_ms"]["p99"] == approx(100 / 3 + 0.99 * (250 - 100 / 3))
    # E2E [600, 500, 500]
    assert (s["e2el_ms"]["mean"], s["e2el_ms"]["median"], s["e2el_ms"]["p90"]) == (
        approx(1600 / 3),
        approx(500),
        approx(580),
    )
    assert s["errors"] == {"UNAVAILABLE: x": 1}


def test_goodput_and_slo_attainment(traces):
    both = summarize(traces, slo_ttft_ms=450, slo_tpot_ms=100)
    assert both["good_requests"] == 1  # only c: a's TPOT 250 > 100, b's TTFT 500 > 450, d failed
    assert both["goodput"] == approx(1.0)
    assert both["slo_attainment"] == approx(0.25)
    ttft_only = summarize(traces, slo_ttft_ms=450)
    assert (ttft_only["good_requests"], ttft_only["slo_attainment"]) == (2, approx(0.5))
    none = summarize(traces)
    assert none["good_requests"] == 3  # no SLO: every completed request counts
    one_token = summarize(traces[1:2], slo_ttft_ms=600, slo_tpot_ms=1)  # TPOT of a 1-token request is 0
    assert one_token["good_requests"] == 1


def test_the_itl_slo_judges_each_requests_longest_gap(traces):
    """a's gaps are 200 and 300 ms (TPOT 250), c's 100 ms, b has none (one chunk): a meets a 250 ms TPOT SLO
    but not a 250 ms ITL one, its one 300 ms stall counting whatever its mean."""
    a, b, c, d = traces
    assert (max_itl(a), max_itl(b), max_itl(c)) == (approx(0.3), 0.0, approx(0.1))
    assert summarize(traces, slo_tpot_ms=250)["good_requests"] == 3
    itl = summarize(traces, slo_itl_ms=250)
    assert itl["good_requests"] == 2 and itl["slo"] == {"ttft_ms": None, "tpot_ms": None, "itl_ms": 250}
    assert summarize(traces, slo_itl_ms=300.001)["good_requests"] == 3
    assert summarize(traces, slo_ttft_ms=450, slo_itl_ms=250)["good_requests"] == 1  # c: b's TTFT is 500
    assert summarize(traces, slo_itl_ms=1e9)["good_requests"] == 3  # d failed: never good
    s = summarize(traces)
    assert (s["max_itl_ms"]["n"], s["max_itl_ms"]["median"]) == (2, approx(200.0))  # a and c; b has one chunk


def test_stats_empty_and_explicit_duration(traces):
    assert stats([]) == {"n": 0}
    s = summarize(traces, duration=2.0)
    assert s["output_throughput"] == approx(4.0) and s["request_throughput"] == approx(1.5)


def test_throughput_timeline(traces):
    tl = throughput_timeline(traces, start=0.0, bin_s=0.5)
    assert tl["t_s"] == [0.0, 0.5]
    assert tl["output_tokens_per_s"] == [approx(4.0), approx(12.0)]  # 2 tokens in [0, .5), 6 in [.5, 1]
    assert tl["completed_per_s"] == [approx(0.0), approx(6.0)]
    assert tl["in_flight"] == [3.0, 3.0]


def test_arrivals():
    const = arrival_offsets(LoadSpec(rate=4.0, arrival="constant", start_after=1.0))
    assert [next(const) for _ in range(4)] == [1.0, 1.25, 1.5, 1.75]
    closed = arrival_offsets(LoadSpec())
    assert [next(closed) for _ in range(3)] == [0.0, 0.0, 0.0]
    p1 = arrival_offsets(LoadSpec(rate=10.0, seed=3))
    p2 = arrival_offsets(LoadSpec(rate=10.0, seed=3))
    xs = [next(p1) for _ in range(20001)]
    assert xs[:50] == [next(p2) for _ in range(50)]  # seeded
    assert all(b >= a for a, b in zip(xs, xs[1:]))
    assert xs[-1] / 20000 == pytest.approx(0.1, rel=0.02)  # mean gap 1/rate


def test_synthetic_lengths_and_seed():
    fixed = datasets.synthetic(5, input_len=12, output_len=7, vocab_size=100, seed=1)
    assert [(r.prompt_len, r.output_len, len(r.prompt_ids)) for r in fixed] == [(12, 7, 12)] * 5
    assert all(10 <= t < 100 for r in fixed for t in r.prompt_ids)
    assert fixed == datasets.synthetic(5, input_len=12, output_len=7, vocab_size=100, seed=1)
    assert fixed != datasets.synthetic(5, input_len=12, output_len=7, vocab_size=100, seed=2)
    uni = datasets.synthetic(
        400, input_len=100, output_len=10, vocab_size=100, dist="uniform", range_ratio=0.5
    )
    assert min(r.prompt_len for r in uni) >= 50 and max(r.prompt_len for r in uni) <= 150
    assert len({r.prompt_len for r in uni}) > 50
    logn = datasets.synthetic(
        2000, input_len=64, output_len=8, vocab_size=100, dist="lognormal", sigma=0.5, max_input_len=300
    )
    lens = sorted(r.prompt_len for r in logn)
    assert lens[1000] == pytest.approx(64, rel=0.1) and lens[-1] <= 300  # median = exp(mu)


def test_sharegpt(tmp_path):
    convs = [
        {"conversations": [{"from": "human", "value": "x" * 40}, {"from": "gpt", "value": "y" * 80}]},
        {
            "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "y" * 80}]
        },  # < 4 tokens
        {"conversations": [{"from": "human", "value": "z" * 400}]},  # no reply
        {"conversations": [{"from": "human", "value": "w" * 20}, {"from": "gpt", "value": "v" * 16}]},
    ]
    path = tmp_path / "sg.jsonl"
    path.write_text("\n".join(json.dumps(c) for c in convs))
    reqs = datasets.sharegpt(path, 10, seed=0)  # no tokenizer: 4 characters a token
    assert sorted((r.prompt_len, r.output_len) for r in reqs) == [(5, 4), (10, 20)]
    (tmp_path / "sg.json").write_text(json.dumps(convs))
    assert len(datasets.sharegpt(tmp_path / "sg.json", 1, seed=0)) == 1


class FakeTarget(Target):
    """Answers every request with output_len one-token chunks; records the peak concurrency."""

    def __init__(self):
        self.in_flight = self.peak = 0

    async def send(self, request, out):
        import time

        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        out.sent = time.perf_counter()
        for _ in range(request.output_len):
            await asyncio.sleep(0)
            out.chunk_times.append(time.perf_counter())
            out.chunk_tokens.append(1)
        out.output_len, out.success, out.done = request.output_len, True, time.perf_counter()
        self.in_flight -= 1


async def test_run_groups_counts_and_concurrency():
    target = FakeTarget()
    reqs = datasets.synthetic(3, input_len=4, output_len=5, vocab_size=50)
    bursts = datasets.synthetic(2, input_len=9, output_len=1, vocab_size=50, group="burst")
    result = await run_groups(
        target,
        [
            Group("decode", reqs, LoadSpec(concurrency=2), max_requests=7),
            Group("burst", bursts, LoadSpec(rate=1000.0, arrival="constant"), max_requests=3),
        ],
        progress=False,
    )
    assert sorted(o.group for o in result.outputs) == ["burst"] * 3 + ["decode"] * 7
    assert all(o.success for o in result.outputs)
    assert sum(o.output_len for o in result.outputs if o.group == "decode") == 35
    assert [o.prompt_len for o in result.outputs if o.group == "burst"] == [9, 9, 9]
    assert target.peak <= 5  # 2 decode + at most 3 bursts


def test_prometheus_value_sums_label_sets_and_reads_counters_by_either_name():
    text = (
        "# TYPE pdserve_num_preemptions counter\n"
        'pdserve_num_preemptions_total{identity="decode-0"} 5.0\n'
        'pdserve_num_preemptions_total{identity="decode-1"} 2.0\n'
        'pdserve_num_preemptions_created{identity="decode-0"} 1.7e9\n'
        "pdserve_kv_transfer_bytes 10\n"
    )
    assert prometheus_value(text, "pdserve_num_preemptions") == 7.0
    assert prometheus_value(text, "pdserve_num_preemptions_total") == 7.0
    assert prometheus_value(text, "pdserve_kv_transfer_bytes") == 10.0
    assert prometheus_value(text, "pdserve_prefix_cache_hits") == 0.0
