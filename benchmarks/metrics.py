"""Per-request latency metrics and run summaries, by vLLM's `bench serve` definitions.

- TTFT: first chunk with tokens minus send time.
- ITL: gaps between successive chunks with tokens (all requests' gaps pooled).
- TPOT: (E2E - TTFT) / (output_len - 1), for requests with more than one output token.
- E2E: stream end minus send time.
- Throughputs divide by the run's wall time (first send to last stream end).
- Goodput: requests/s that completed and met every SLO given (TTFT <= slo_ttft, TPOT <= slo_tpot;
  a one-token request's TPOT counts as 0). SLO attainment: those requests / all requests sent.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from pdserve.benchmarks.clients import RequestOutput

PERCENTILES = (50, 90, 99)


def tpot(o: RequestOutput) -> float | None:
    return (o.latency - o.ttft) / (o.output_len - 1) if o.output_len > 1 else None


def stats(values_s: Sequence[float], percentiles: Sequence[int] = PERCENTILES) -> dict[str, float]:
    """mean, median, std and pNN of `values_s` (seconds), in milliseconds; np.percentile's linear rule."""
    if len(values_s) == 0:
        return {"n": 0}
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    out = {
        "n": int(ms.size),
        "mean": float(ms.mean()),
        "median": float(np.median(ms)),
        "std": float(ms.std()),
    }
    out.update({f"p{p}": float(np.percentile(ms, p)) for p in percentiles})
    return out


def meets_slo(o: RequestOutput, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    if not o.success:
        return False
    if slo_ttft_ms is not None and o.ttft * 1000.0 > slo_ttft_ms:
        return False
    t = tpot(o) or 0.0
    return slo_tpot_ms is None or t * 1000.0 <= slo_tpot_ms


def summarize(
    outputs: Sequence[RequestOutput],
    *,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
    duration: float | None = None,
) -> dict:
    """The run's figures. `duration` defaults to first send .. last stream end of `outputs`."""
    ok = [o for o in outputs if o.success]
    if duration is None:
        duration = (max(o.done for o in outputs) - min(o.sent for o in outputs)) if outputs else 0.0
    prompt_tokens = sum(o.prompt_len for o in ok)
    output_tokens = sum(o.output_len for o in ok)
    good = sum(meets_slo(o, slo_ttft_ms, slo_tpot_ms) for o in outputs)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    summary = {
        "requests": len(outputs),
        "completed": len(ok),
        "failed": len(outputs) - len(ok),
        "duration_s": duration,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "request_throughput": per_s(len(ok)),
        "output_throughput": per_s(output_tokens),
        "total_token_throughput": per_s(prompt_tokens + output_tokens),
        "ttft_ms": stats([o.ttft for o in ok]),
        "tpot_ms": stats([t for o in ok if (t := tpot(o)) is not None]),
        "itl_ms": stats([g for o in ok for g in o.itl]),
        "e2el_ms": stats([o.latency for o in ok]),
        "slo": {"ttft_ms": slo_ttft_ms, "tpot_ms": slo_tpot_ms},
        "good_requests": good,
        "goodput": per_s(good),
        "slo_attainment": good / len(outputs) if outputs else 0.0,
    }
    errors: dict[str, int] = {}
    for o in outputs:
        if not o.success:
            errors[o.error[:120]] = errors.get(o.error[:120], 0) + 1
    summary["errors"] = errors
    return summary


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
