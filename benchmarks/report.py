"""Writes a run's results: `results.json` (config, summaries, per-request records) and PNG plots
(`latency_cdf.png`: TTFT/TPOT/ITL/E2E CDFs per group; `throughput.png`: tokens/s and requests over time)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from pdserve.server.plan.run_summary import RequestOutput
from pdserve.benchmarks.metrics import throughput_timeline
from pdserve.server.plan.run_summary import tpot


def request_records(outputs: Sequence[RequestOutput], start: float) -> list[dict]:
    return [
        {
            "group": o.group,
            "prompt_len": o.prompt_len,
            "output_len": o.output_len,
            "success": o.success,
            "error": o.error,
            "finish_reason": o.finish_reason,
            "sent_s": o.sent - start,
            "ttft_s": o.ttft if o.chunk_times else None,
            "tpot_s": tpot(o) if o.chunk_times else None,
            "e2el_s": o.latency,
            "itl_s": o.itl,
        }
        for o in outputs
    ]


def write_json(path: Path, result: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    return path


def _cdf(ax, values_ms: Sequence[float], label: str) -> None:
    if len(values_ms) == 0:
        return
    xs = np.sort(np.asarray(values_ms))
    ax.step(xs, np.arange(1, xs.size + 1) / xs.size, where="post", label=label)


def plot_latency_cdfs(path: Path, outputs: Sequence[RequestOutput], title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({o.group for o in outputs})
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    panels = [
        ("TTFT", lambda os: [o.ttft for o in os]),
        ("TPOT", lambda os: [t for o in os if (t := tpot(o)) is not None]),
        ("ITL", lambda os: [g for o in os for g in o.itl]),
        ("E2E latency", lambda os: [o.latency for o in os]),
    ]
    for ax, (name, pick) in zip(axes.flat, panels):
        for g in groups:
            ok = [o for o in outputs if o.success and o.group == g]
            _cdf(ax, [v * 1000.0 for v in pick(ok)], g)
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests" if name != "ITL" else "fraction of gaps")
        ax.set_ylim(0, 1.01)
        ax.grid(alpha=0.3)
        if len(groups) > 1:
            ax.legend(fontsize=8)
    fig.suptitle(title or "latency CDFs")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_throughput(path: Path, outputs: Sequence[RequestOutput], start: float, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    span = max((o.done for o in outputs), default=start + 1.0) - start
    bin_s = 1.0 if span >= 40 else max(span / 40, 1e-3)  # at least ~40 bins on short runs
    tl = throughput_timeline(outputs, start, bin_s)
    edges = [*tl["t_s"], tl["t_s"][-1] + bin_s]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    top.stairs(tl["output_tokens_per_s"], edges, label="output tokens/s")
    top.set_ylabel(f"output tokens/s ({bin_s:.3g} s bins)")
    top.grid(alpha=0.3)
    bottom.stairs(tl["in_flight"], edges, label="in flight")
    bottom.stairs(tl["completed_per_s"], edges, label="completed/s")
    bottom.set_xlabel("time since start (s)")
    bottom.set_ylabel("requests")
    bottom.grid(alpha=0.3)
    bottom.legend(fontsize=8)
    fig.suptitle(title or "throughput over time")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
