"""The goodput sweep (benchmarks/load/goodput.py) on a fake target whose latencies are scripted per request:
exact counts of the requests meeting both SLOs, a row per rate, the table and the plot."""

from __future__ import annotations

import asyncio
import time

import pytest

from pdserve.benchmarks.load import goodput
from pdserve.benchmarks.clients import Target


class ScriptedTarget(Target):
    """Answers at once, stamping latencies from the prompt's first id: ids ending in 0 get a 5 s TTFT (they
    miss a 1 s SLO), ids ending in 1 a 1 s TPOT (they miss a 100 ms one), the rest 10 ms TTFT and 10 ms TPOT."""

    def __init__(self) -> None:
        self.sent = 0

    async def send(self, request, out) -> None:
        self.sent += 1
        await asyncio.sleep(0)
        out.sent = time.perf_counter()
        first = request.prompt_ids[0] % 10
        ttft, tpot = (5.0, 0.01) if first == 0 else (0.01, 1.0) if first == 1 else (0.01, 0.01)
        n = request.output_len
        out.chunk_times = [out.sent + ttft + i * tpot for i in range(n)]
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
        good = sum(1 for q in reqs[:sent] if q.prompt_ids[0] % 10 not in (0, 1))
        assert s["good_requests"] == good and r["completed"] == sent and r["failed"] == 0
        assert r["slo_attainment"] == pytest.approx(good / sent)
        assert r["goodput"] == pytest.approx(good / s["duration_s"])
        assert r["goodput"] <= r["request_throughput"]
    assert target.sent == sum(r["requests"] for r in rows)
    assert {0, 1} & set(firsts)  # the script has requests that miss each SLO


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
             "tpot_p99_ms": 30.0, "load_avg": 3.2},
            {"rate": 2.0, "goodput": 0.5, "request_throughput": 1.8, "slo_attainment": 0.25, "completed": 18,
             "failed": 2, "requests": 20, "ttft_p50_ms": 900.0, "ttft_p99_ms": None, "tpot_p50_ms": 90.0,
             "tpot_p99_ms": 150.0, "load_avg": 3.4}]
    text = goodput.table({"pdserve": rows}, sweep)
    assert "| pdserve | 1 | 0.90 | 1.00 | 90% | 50.0 / 120.0 | 20.0 / 30.0 | 0 | 3.2 |" in text
    assert "| pdserve | 2 | 0.50 | 1.80 | 25% | 900.0 / - | 90.0 / 150.0 | 2 | 3.4 |" in text
    assert goodput.best(rows)["rate"] == 1.0 and goodput.best([]) is None
    why = goodput.plot({"pdserve": rows}, sweep, tmp_path / "g.png")
    assert why is None and (tmp_path / "g.png").stat().st_size > 0 or "matplotlib" in why


@pytest.mark.parametrize("kwargs, message", [
    ({"rates": ()}, "--rates"), ({"rates": (0.0,)}, "--rates"), ({"duration": 0.0}, "--duration"),
    ({"slo_ttft_ms": 0.0}, "--slo-ttft-ms"), ({"slo_tpot_ms": -1.0}, "--slo-tpot-ms"),
    ({"output_len": 1}, "--output-len"),
])
def test_bad_sweeps_are_refused_by_name(kwargs, message):
    base = {"rates": (1.0,), "duration": 1.0, "slo_ttft_ms": 1.0, "slo_tpot_ms": 1.0}
    with pytest.raises(ValueError, match=message):
        goodput.Sweep(**{**base, **kwargs})
