"""server/metrics.py: a histogram observed many times at once reads as that many observe() calls."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram

from pdserve.server import metrics

BUCKETS = (0.01, 0.05, 0.25, 1.0)


def _samples(histogram: Histogram) -> dict[tuple[str, str], float]:
    return {(s.name, s.labels.get("le", "")): s.value for family in histogram.collect() for s in family.samples}


@pytest.mark.parametrize("amount, count", [(0.25, 3), (0.0625, 8), (4.0, 2), (0.01, 1), (0.5, 0)])
def test_observe_each_adds_what_count_observe_calls_add(amount, count):
    """Exact binary fractions, so the sums compare exactly. A bound is inclusive; above the last: +Inf."""
    once, each = (Histogram("h", "h", buckets=BUCKETS, registry=CollectorRegistry()) for _ in range(2))
    for _ in range(count):
        each.observe(amount)
    metrics._observe_each(once, amount, count)
    assert _samples(once) == _samples(each)


def test_a_series_observes_each_on_pdserves_and_vllms_families():
    def read() -> dict[tuple[str, str], float]:
        """Summed over label sets: the series' cached child may carry the identity an earlier test set."""
        out: dict[tuple[str, str], float] = {}
        for family in metrics.inter_token_latency.families:
            for f in family.collect():
                for s in f.samples:
                    if s.labels.get("le") in ("0.04", "0.05", None):
                        key = (s.name, s.labels.get("le", ""))
                        out[key] = out.get(key, 0.0) + s.value
        return out

    before = read()
    metrics.inter_token_latency.observe_each(0.03125, 4)
    after = read()
    changed = {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k, 0.0)}
    assert changed == {
        ("pdserve_inter_token_latency_seconds_bucket", "0.04"): 4.0,
        ("pdserve_inter_token_latency_seconds_count", ""): 4.0,
        ("pdserve_inter_token_latency_seconds_sum", ""): 0.125,
        ("vllm:inter_token_latency_seconds_bucket", "0.05"): 4.0,
        ("vllm:inter_token_latency_seconds_count", ""): 4.0,
        ("vllm:inter_token_latency_seconds_sum", ""): 0.125,
        ("vllm:time_per_output_token_seconds_bucket", "0.05"): 4.0,  # vLLM's older name, the same buckets
        ("vllm:time_per_output_token_seconds_count", ""): 4.0,
        ("vllm:time_per_output_token_seconds_sum", ""): 0.125,
    }
