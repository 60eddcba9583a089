"""Goodput against request rate: where the prefill/decode split pays on this machine (issue 32, item 5).

    .venv/bin/python -m pdserve.benchmarks.load.goodput --systems pdserve,vllm,vllm-pd --rates 1,2,4,8 \
        --duration 20 --slo-ttft-ms 1000 --slo-tpot-ms 100 [--model DIR] [--allow-noisy]

Goodput is DistServe's metric: requests per second that completed and met both SLOs (TTFT <= --slo-ttft-ms
and TPOT <= --slo-tpot-ms; server/plan/run_summary.py `summarize`, bench's own rule). For each system it starts
the system once with servers.py's launcher (`pdserve`: JAX prefill on core 0, torch decode on core 1,
the coordinator's OpenAI front; `vllm`: one colocated `vllm serve` on both cores; `vllm-pd`: vLLM's own P/D,
two instances and ExampleConnector behind benchmarks/load/vllm_pd_proxy.py), warms it up on every prompt shape
the sweep sends (prompts of its own), then sends Poisson arrivals (seeded, the same requests for every
system; each rate's prompts its own, none sent twice: a prefix cache would serve a repeated prompt) at each
rate for --duration seconds, lowest rate first. A system that cannot start here is reported with why, and the
others run on. The machine and its load average are recorded before, during and after (protocol.py).

Writes <out>/<time>/goodput.json (every rate's whole summary), table.md (goodput, throughput, attainment,
TTFT/TPOT p50 and p99 per system and rate) and goodput.png (goodput and throughput against the offered
rate, one line per system; matplotlib, else said).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pdserve.server.plan import datasets
from pdserve.benchmarks.bench import Group, run_groups, warmup
from pdserve.server.plan.bench_flags import arrivals_bound
from pdserve.benchmarks.clients import Target
from pdserve.server.plan.arrivals import LoadSpec
from pdserve.server.plan.run_summary import summarize
from pdserve.benchmarks.protocol import LoadMonitor, MachineRecord, gate, load_average

SYSTEMS = ("pdserve", "vllm", "vllm-pd")


@dataclass(frozen=True)
class Sweep:
    rates: tuple[float, ...]
    duration: float
    slo_ttft_ms: float
    slo_tpot_ms: float
    input_len: int = 128
    output_len: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.rates or any(not r > 0 for r in self.rates):
            raise ValueError(f"--rates must be requests/s > 0, got {list(self.rates)}")
        if not self.duration > 0:
            raise ValueError(f"--duration must be > 0 s, got {self.duration}")
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        if self.input_len < 1 or self.output_len < 2:
            raise ValueError("--input-len must be >= 1 and --output-len >= 2 (TPOT needs two tokens)")


def requests(sweep: Sweep, vocab_size: int, rate: float | None = None) -> list[datasets.BenchRequest]:
    """The prompts sent at `rate` (None: the warm-up's 8), the same for every system: as many as that rate's
    arrivals with room for Poisson's spread, seeded by (--seed, rate), so no prompt is sent twice in the sweep
    (a system's prefix cache would serve it again, and the sweep would measure the cache)."""
    if rate is None:
        n, key = 8, 0
    else:
        n, key = arrivals_bound(rate, sweep.duration), 1 + round(rate * 1000)
    return datasets.synthetic(n, input_len=sweep.input_len, output_len=sweep.output_len, vocab_size=vocab_size,
                              seed=[sweep.seed, key])


def row(rate: float, summary: dict) -> dict:
    """One rate's figures for the table and the plot."""
    return {"rate": rate, "goodput": summary["goodput"], "request_throughput": summary["request_throughput"],
            "slo_attainment": summary["slo_attainment"], "completed": summary["completed"],
            "failed": summary["failed"], "requests": summary["requests"],
            "ttft_p50_ms": summary["ttft_ms"].get("median"), "ttft_p99_ms": summary["ttft_ms"].get("p99"),
            "tpot_p50_ms": summary["tpot_ms"].get("median"), "tpot_p99_ms": summary["tpot_ms"].get("p99"),
            "load_avg": load_average()[0]}


async def sweep_rates(target: Target, sweep: Sweep, vocab_size: int, progress: bool = False,
                      log=lambda message: None) -> list[dict]:
    """Each rate in turn, lowest first: Poisson arrivals of that rate's own prompts (`requests`) for the
    sweep's duration; a row per rate (and its whole summary under "summary")."""
    rows = []
    for rate in sorted(sweep.rates):
        log(f"{rate:g} req/s for {sweep.duration:g} s (load {load_average()[0]})")
        group = Group(f"rate-{rate:g}", requests(sweep, vocab_size, rate),
                      LoadSpec(rate=rate, arrival="poisson", seed=sweep.seed))
        result = await run_groups(target, [group], duration=sweep.duration, progress=progress)
        summary = summarize(result.outputs, slo_ttft_ms=sweep.slo_ttft_ms, slo_tpot_ms=sweep.slo_tpot_ms)
        rows.append({**row(rate, summary), "summary": summary})
        log(f"{rate:g} req/s: goodput {summary['goodput']:.3f} req/s of {summary['request_throughput']:.3f} "
            f"completed ({100 * summary['slo_attainment']:.0f}% met both SLOs)")
    return rows


def _fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def table(results: dict[str, list[dict]], sweep: Sweep) -> str:
    lines = [f"SLOs: TTFT <= {sweep.slo_ttft_ms:g} ms, TPOT <= {sweep.slo_tpot_ms:g} ms; {sweep.input_len}-token "
             f"prompts, {sweep.output_len} tokens out, Poisson arrivals (seed {sweep.seed}), {sweep.duration:g} s per rate",
             "",
             "| system | offered (req/s) | goodput (req/s) | completed (req/s) | SLO attainment | TTFT p50 / p99 (ms) | "
             "TPOT p50 / p99 (ms) | failed | load avg |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for system, rows in results.items():
        for r in rows:
            lines.append(f"| {system} | {r['rate']:g} | {r['goodput']:.2f} | {r['request_throughput']:.2f} | "
                         f"{100 * r['slo_attainment']:.0f}% | {_fmt(r['ttft_p50_ms'])} / {_fmt(r['ttft_p99_ms'])} | "
                         f"{_fmt(r['tpot_p50_ms'])} / {_fmt(r['tpot_p99_ms'])} | {r['failed']} | {r['load_avg']:.1f} |")
    return "\n".join(lines)


def best(rows: list[dict]) -> dict | None:
    """The rate with the highest goodput (the lowest such rate on a tie)."""
    return max(rows, key=lambda r: (r["goodput"], -r["rate"]), default=None)


def plot(results: dict[str, list[dict]], sweep: Sweep, path: Path) -> str | None:
    """goodput.png; None, or why not (matplotlib missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'pdserve[bench]'): no plot"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for system, rows in results.items():
        rates = [r["rate"] for r in rows]
        line, = ax.plot(rates, [r["goodput"] for r in rows], marker="o", label=f"{system}: goodput")
        ax.plot(rates, [r["request_throughput"] for r in rows], linestyle="--", color=line.get_color(),
                label=f"{system}: completed")
    top = max((r["rate"] for rows in results.values() for r in rows), default=1.0)
    ax.plot([0, top], [0, top], color="grey", linewidth=0.5, label="offered")
    ax.set_xlabel("offered rate (req/s)")
    ax.set_ylabel("req/s")
    ax.set_title(f"goodput at TTFT <= {sweep.slo_ttft_ms:g} ms, TPOT <= {sweep.slo_tpot_ms:g} ms")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="goodput", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {', '.join(SYSTEMS)}")
    p.add_argument("--rates", default="0.5,1,2,4", help="offered request rates (req/s), comma-separated")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per rate")
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=100.0)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", type=Path, help="checkpoint dir (default: the side-by-side's Qwen2.5-0.5B-shaped one)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=None, help="default: the model's, at most 4096")
    p.add_argument("--max-load", type=float, default=2.0, help="refuse to start above this 1-minute load average")
    p.add_argument("--allow-noisy", action="store_true", help="run on a busy machine, marking the result noisy")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/goodput"))
    p.add_argument("--no-progress", action="store_true")
    return p


def _rates(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--rates {text!r}: give numbers, comma-separated (e.g. 1,2,4)") from None


def log(message: str) -> None:
    print(f"[goodput {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    from pdserve.benchmarks import servers
    from pdserve.benchmarks.checkpoint import make_qwen25_05b_shape
    from pdserve.server.cache_dir import cache_dir
    from pdserve.server.model.config import load_config

    args = build_parser().parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    unknown = set(systems) - set(SYSTEMS)
    if unknown or not systems:
        raise SystemExit(f"unknown systems {sorted(unknown)}: choose from {', '.join(SYSTEMS)}")
    try:
        sweep = Sweep(_rates(args.rates), args.duration, args.slo_ttft_ms, args.slo_tpot_ms, args.input_len,
                      args.output_len, args.seed)
    except ValueError as e:
        raise SystemExit(f"goodput: {e}") from None
    record = MachineRecord.take()
    gate(record, args.max_load, args.allow_noisy)
    model = args.model or make_qwen25_05b_shape(cache_dir() / "models" / f"qwen2.5-0.5b-shape-random-{args.dtype}",
                                                args.dtype)
    config = load_config(model)
    if sweep.input_len + sweep.output_len > config.max_model_len:
        raise SystemExit(f"--input-len + --output-len ({sweep.input_len + sweep.output_len}) exceed the model's "
                         f"max length {config.max_model_len}: shorten them")
    launch = argparse.Namespace(dtype=args.dtype, max_model_len=args.max_model_len or min(config.max_model_len, 4096),
                                pdserve_front="http")
    run_dir = args.out / time.strftime("%Y%m%d-%H%M%S")
    results: dict[str, list[dict]] = {}
    failures: dict[str, str] = {}
    with LoadMonitor() as monitor:
        for system in systems:
            out = run_dir / system
            out.mkdir(parents=True, exist_ok=True)
            log(f"{system}: starting (load {load_average()[0]}; logs in {out})")
            try:
                server = servers.start_system(system, model, launch, out)
            except (RuntimeError, SystemExit) as e:
                failures[system] = f"{str(e).splitlines()[0]} (logs: {out})"
                log(f"{system} could not run: {failures[system]}")
                continue
            try:
                servers.wait_for_compiles(server.compile_watch, 600, system)

                async def go() -> list[dict]:
                    target = server.make_target()
                    try:
                        await warmup(target, requests(sweep, config.vocab_size), 8)
                        return await sweep_rates(target, sweep, config.vocab_size, progress=not args.no_progress,
                                                 log=lambda m: log(f"{system}: {m}"))
                    finally:
                        await target.close()

                results[system] = asyncio.run(go())
                died = server.died()
                if died:
                    failures[system] = f"died during the sweep: {died}"
                    results.pop(system)
            finally:
                server.stop()
    record.finish(monitor)
    text = table(results, sweep)
    run_dir.mkdir(parents=True, exist_ok=True)
    why_no_plot = plot(results, sweep, run_dir / "goodput.png") if results else "nothing ran: no plot"
    peaks = "".join(f"\n- `{s}`: the most goodput, {b['goodput']:.2f} req/s, at {b['rate']:g} req/s offered"
                    if b["goodput"] > 0 else f"\n- `{s}`: no rate met both SLOs"
                    for s, rows in results.items() if (b := best(rows)))
    notes = "".join(f"\n- `{s}` could not run here: {why}" for s, why in failures.items())
    cmd = "python -m pdserve.benchmarks.load.goodput " + " ".join(argv if argv is not None else sys.argv[1:])
    doc = f"`{cmd.strip()}` (model {model.name})\n\n{record.markdown()}\n\n{text}\n{peaks}{notes}\n"
    if why_no_plot:
        doc += f"\n{why_no_plot}\n"
    (run_dir / "table.md").write_text(doc)
    (run_dir / "goodput.json").write_text(json.dumps(
        {"sweep": sweep.__dict__, "model": str(model), "machine": record.as_dict(), "failures": failures,
         "results": results}, indent=1, default=str))
    print(doc)
    log(f"written: {run_dir / 'table.md'}" + ("" if why_no_plot else f", {run_dir / 'goodput.png'}"))
    return 0 if results else 1


if __name__ == "__main__":
    sys.exit(main())
