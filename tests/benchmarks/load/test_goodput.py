"""The goodput sweep (benchmarks/load/goodput.py) on a fake target whose latencies are scripted per request:
exact counts of the requests meeting both SLOs, a row per rate, the table and the plot."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from pdserve.benchmarks.load import goodput
from pdserve.benchmarks.clients import Target


class ScriptedTarget(Target):
    """Answers at once, stamping latencies from the prompt's first id: ids ending in 0 get a 5 s TTFT (they
    miss a 1 s SLO), ids ending in 1 a 1 s TPOT (they miss a 100 ms one), ids ending in 2 a last gap of 300 ms
    (3 tokens out: gaps of 10 and 300 ms, TPOT 155 ms: within a 200 ms TPOT SLO, past a 250 ms ITL one), the
    rest 10 ms TTFT and 10 ms TPOT."""

    def __init__(self) -> None:
        self.sent = 0

    async def send(self, request, out) -> None:
        self.sent += 1
        await asyncio.sleep(0)
        out.sent = time.perf_counter()
        first = request.prompt_ids[0] % 10
        ttft, tpot = (5.0, 0.01) if first == 0 else (0.01, 1.0) if first == 1 else (0.01, 0.01)
        n = request.output_len
        out.chunk_times = [out.sent + ttft + i * tpot + (0.29 if first == 2 and i == n - 1 else 0.0)
                           for i in range(n)]
        out.chunk_tokens = [1] * n
        out.done = out.chunk_times[-1]
        out.output_len = n
        out.success = True


def test_the_sweep_counts_the_requests_meeting_both_slos():
    sweep = goodput.Sweep(rates=(200.0, 100.0), duration=0.2, slo_ttft_ms=1000, slo_tpot_ms=100, input_len=4,
                          output_len=3)
    target = ScriptedTarget()
    rows = asyncio.run(goodput.sweep_rates(target, sweep, 512))
    assert [r["rate"] for r in rows] == [100.0, 200.0]  # lowest first
    firsts = []
    for r in rows:
        s = r["summary"]
        sent = s["requests"]
        reqs = goodput.requests(sweep, 512, r["rate"])
        assert sent <= len(reqs)  # no prompt sent twice
        firsts += [q.prompt_ids[0] % 10 for q in reqs[:sent]]
        good = sum(1 for q in reqs[:sent] if q.prompt_ids[0] % 10 not in (0, 1, 2))  # 2: TPOT 155 ms
        assert s["good_requests"] == good and r["completed"] == sent and r["failed"] == 0
        assert r["slo_attainment"] == pytest.approx(good / sent)
        assert r["goodput"] == pytest.approx(good / s["duration_s"])
        assert r["goodput"] <= r["request_throughput"]
    assert target.sent == sum(r["requests"] for r in rows)
    assert {0, 1} & set(firsts)  # the script has requests that miss each SLO


def test_the_itl_slo_fails_a_request_that_stalls_once():
    """Ids ending in 2 have gaps of 10 and 300 ms (TPOT 155 ms): they meet a 200 ms TPOT SLO, and fail a
    250 ms ITL SLO on their one stall; those ending in 0 (5 s TTFT) and 1 (1 s TPOT) fail as before."""
    sweep = goodput.Sweep(rates=(100.0,), duration=0.2, slo_ttft_ms=1000, slo_tpot_ms=200, input_len=4,
                          output_len=3, slo_itl_ms=250)
    rows = asyncio.run(goodput.sweep_rates(ScriptedTarget(), sweep, 512))
    sent = rows[0]["requests"]
    firsts = [q.prompt_ids[0] % 10 for q in goodput.requests(sweep, 512, 100.0)[:sent]]
    assert 2 in firsts
    s = rows[0]["summary"]
    assert s["good_requests"] == sum(1 for f in firsts if f not in (0, 1, 2))
    assert s["slo"]["itl_ms"] == 250
    assert s["max_itl_ms"]["n"] == sent and s["max_itl_ms"]["median"] == pytest.approx(10.0)
    no_itl = asyncio.run(goodput.sweep_rates(ScriptedTarget(), dataclasses.replace(sweep, slo_itl_ms=None), 512))
    sent = no_itl[0]["requests"]  # arrivals in 0.2 s of wall time: the count may differ by one
    firsts = [q.prompt_ids[0] % 10 for q in goodput.requests(sweep, 512, 100.0)[:sent]]
    assert no_itl[0]["summary"]["good_requests"] == sum(1 for f in firsts if f not in (0, 1))


def test_find_miss_stops_the_ladder_at_the_first_rate_below_the_attainment():
    """The ladder climbs x step; the sweep stops after the first rate under --attainment; every other system's
    goodput there is a ratio of the reference's."""
    assert goodput.ladder(0.1, 2, 3.2) == (0.1, 0.2, 0.4, 0.8, 1.6, 3.2)
    assert goodput.ladder(0.1, 1.5, 0.5) == (0.1, 0.15, 0.225, 0.338)
    with pytest.raises(ValueError, match="--step"):
        goodput.ladder(1, 1, 4)
    with pytest.raises(ValueError, match="--max-rate"):
        goodput.ladder(4, 2, 1)
    sweep = goodput.Sweep(rates=(100.0, 200.0, 400.0), duration=0.2, slo_ttft_ms=1000, slo_tpot_ms=100,
                          input_len=4, output_len=3)
    target = ScriptedTarget()
    rows = asyncio.run(goodput.sweep_rates(target, sweep, 512, stop_below=0.99))  # ids ending in 0/1 miss
    assert [r["rate"] for r in rows] == [100.0]
    assert target.sent == rows[0]["requests"]
    vllm = [_row(1.0, 1.0, 1.0), _row(2.0, 1.5, 0.75), _row(4.0, 0.5, 0.1)]
    pd = [_row(1.0, 1.0, 1.0), _row(2.0, 1.95, 0.97)]
    assert goodput.first_miss(vllm, 0.9)["rate"] == 2.0 and goodput.first_miss(vllm, 0.05) is None
    rate, ratios = goodput.at_miss({"vllm": vllm, "pdserve": pd, "vllm-pd": pd[:1]}, "vllm", 0.9)
    assert rate == 2.0 and ratios == {"pdserve": pytest.approx(1.3), "vllm-pd": None}
    note = goodput.miss_note({"vllm": vllm, "pdserve": pd}, "vllm", 0.9)
    assert "`vllm` first misses at 2 req/s (75% < 90%; goodput 1.50 req/s)" in note
    assert "`pdserve` there: 1.30x `vllm`'s goodput" in note
    assert "met the SLOs" in goodput.miss_note({"vllm": vllm[:1]}, "vllm", 0.9)


def _row(rate: float, good: float, attainment: float) -> dict:
    return {"rate": rate, "goodput": good, "slo_attainment": attainment}


def test_no_prompt_is_sent_twice_in_a_sweep():
    """A repeated prompt would be served from a system's prefix cache: each rate and the warm-up draw their own."""
    sweep = goodput.Sweep(rates=(2.0, 4.0), duration=5, slo_ttft_ms=1000, slo_tpot_ms=100, input_len=16)
    sets = [goodput.requests(sweep, 512, rate) for rate in (None, 2.0, 4.0)]
    prompts = [q.prompt_ids for reqs in sets for q in reqs]
    assert len(set(prompts)) == len(prompts)
    assert [len(reqs) for reqs in sets] == [8, 45, 63]  # ceil(rate x duration + 6 sqrt(rate x duration) + 16)
    assert sets[1] == goodput.requests(sweep, 512, 2.0)  # the same for every system


def test_table_best_and_plot(tmp_path):
    sweep = goodput.Sweep(rates=(1.0, 2.0), duration=10, slo_ttft_ms=1000, slo_tpot_ms=100)
    rows = [{"rate": 1.0, "goodput": 0.9, "request_throughput": 1.0, "slo_attainment": 0.9, "completed": 10,
             "failed": 0, "requests": 10, "ttft_p50_ms": 50.0, "ttft_p99_ms": 120.0, "tpot_p50_ms": 20.0,
             "tpot_p99_ms": 30.0, "max_itl_p50_ms": 40.0, "max_itl_p99_ms": 90.0, "load_avg": 3.2},
            {"rate": 2.0, "goodput": 0.5, "request_throughput": 1.8, "slo_attainment": 0.25, "completed": 18,
             "failed": 2, "requests": 20, "ttft_p50_ms": 900.0, "ttft_p99_ms": None, "tpot_p50_ms": 90.0,
             "tpot_p99_ms": 150.0, "max_itl_p50_ms": None, "max_itl_p99_ms": None, "load_avg": 3.4}]
    text = goodput.table({"pdserve": rows}, sweep)
    assert "| pdserve | 1 | 0.90 | 1.00 | 90% | 50.0 / 120.0 | 20.0 / 30.0 | 40.0 / 90.0 | 0 | 3.2 |" in text
    assert "| pdserve | 2 | 0.50 | 1.80 | 25% | 900.0 / - | 90.0 / 150.0 | - / - | 2 | 3.4 |" in text
    assert text.startswith("SLOs: TTFT <= 1000 ms, TPOT <= 100 ms; 128-token")
    itl = goodput.table({}, dataclasses.replace(sweep, slo_itl_ms=200))
    assert itl.startswith("SLOs: TTFT <= 1000 ms, TPOT <= 100 ms, each request's longest inter-token gap <= 200 ms;")
    assert goodput.best(rows)["rate"] == 1.0 and goodput.best([]) is None
    why = goodput.plot({"pdserve": rows}, sweep, tmp_path / "g.png")
    assert why is None and (tmp_path / "g.png").stat().st_size > 0 or "matplotlib" in why


@pytest.mark.parametrize("kwargs, message", [
    ({"rates": ()}, "--rates"), ({"rates": (0.0,)}, "--rates"), ({"duration": 0.0}, "--duration"),
    ({"slo_ttft_ms": 0.0}, "--slo-ttft-ms"), ({"slo_tpot_ms": -1.0}, "--slo-tpot-ms"),
    ({"output_len": 1}, "--output-len"), ({"slo_itl_ms": 0.0}, "--slo-itl-ms"),
])
def test_bad_sweeps_are_refused_by_name(kwargs, message):
    base = {"rates": (1.0,), "duration": 1.0, "slo_ttft_ms": 1.0, "slo_tpot_ms": 1.0}
    with pytest.raises(ValueError, match=message):
        goodput.Sweep(**{**base, **kwargs})
