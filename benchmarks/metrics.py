"""Benchmark-only run figures: the throughput over a run's time (its plots) and a sample scraped from /metrics.
The per-request latencies and the run's summary are `pdserve.server.plan.run_summary`'s (`pdserve plan` shares them).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from pdserve.server.plan.run_summary import RequestOutput


def throughput_timeline(
    outputs: Sequence[RequestOutput], start: float, bin_s: float = 1.0
) -> dict[str, list]:
    """Per `bin_s` window from `start`: output tokens/s, completed requests/s and requests in flight."""
    ends = [o.done - start for o in outputs] or [0.0]
    n_bins = max(1, int(np.ceil(max(ends) / bin_s)))
    tokens = np.zeros(n_bins)
    completed = np.zeros(n_bins)
    running = np.zeros(n_bins)
    for o in outputs:
        for t, k in zip(o.chunk_times, o.chunk_tokens):
            tokens[min(n_bins - 1, int((t - start) / bin_s))] += k
        if o.success:
            completed[min(n_bins - 1, int((o.done - start) / bin_s))] += 1
        lo, hi = int((o.sent - start) / bin_s), int((o.done - start) / bin_s)
        running[lo : min(n_bins, hi + 1)] += 1
    return {
        "t_s": [float(i * bin_s) for i in range(n_bins)],
        "output_tokens_per_s": list(tokens / bin_s),
        "completed_per_s": list(completed / bin_s),
        "in_flight": list(running),
    }


def prometheus_value(text: str, name: str) -> float:
    """A Prometheus sample's value summed over its label sets (each pdserve process labels its samples
    with its identity); a counter may be named with or without its `_total` suffix. 0 when absent."""
    pattern = rf"^{re.escape(name)}(?:_total)?(?:{{[^}}]*}})? ([0-9.e+-]+)$"
    return sum(float(v) for v in re.findall(pattern, text, re.MULTILINE))
