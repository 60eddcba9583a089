"""Goodput against request rate: where the prefill/decode split pays on this machine (issue 32, item 5).

    .venv/bin/python -m pdserve.benchmarks.load.goodput --systems pdserve,vllm,vllm-pd --rates 1,2,4,8 \
        --duration 20 --slo-ttft-ms 1000 --slo-tpot-ms 100 [--slo-itl-ms 200] [--model DIR | --layers N] [--allow-noisy]

    # long prompts, an ITL SLO, and the rate where colocated vLLM first misses it:
    .venv/bin/python -m pdserve.benchmarks.load.goodput --systems vllm,pdserve --find-miss --rates 0.1 \
        --step 1.5 --input-len 4096 --output-len 64 --layers 4 --slo-ttft-ms 10000 --slo-itl-ms 200

Goodput is DistServe's metric: requests per second that completed and met every SLO (TTFT <= --slo-ttft-ms,
TPOT <= --slo-tpot-ms and, when given, each request's longest inter-token gap <= --slo-itl-ms;
server/plan/run_summary.py `summarize`, bench's own rule, which says why the longest gap). For each system it starts
the system once with servers.py's launcher (`pdserve`: JAX prefill on core 0, torch decode on core 1,
the coordinator's OpenAI front; `vllm`: one colocated `vllm serve` on both cores; `vllm-pd`: vLLM's own P/D,
two instances and ExampleConnector behind benchmarks/load/vllm_pd_proxy.py), warms it up on every prompt shape
the sweep sends (prompts of its own), then sends Poisson arrivals (seeded, the same requests for every
system; each rate's prompts its own, none sent twice: a prefix cache would serve a repeated prompt) at each
rate for --duration seconds, lowest rate first. A system that cannot start here is reported with why, and the
others run on. The machine and its load average are recorded before, during and after (protocol.py).

--find-miss: the first system (the reference, colocated `vllm` in the example) climbs a ladder of rates from the
lowest of --rates, each --step times the last, up to --max-rate, and stops at the first rate where fewer than
--attainment of its requests meet every SLO: "the rate where vLLM first misses the SLO". Every other system then
runs at that rate and the one below it, and the table ends with each one's goodput there as a ratio of the
reference's (issue 43's "goodput at the ITL SLO with 4k prompts, at the rate where vLLM first misses it").

--layers N: the Qwen2.5-0.5B-shaped checkpoint with N of its 24 layers (every matmul and attention shape the
same, each prompt N/24 of the compute), so that 4k-token prompts saturate 2 cores at rates a sweep of minutes
reaches: the full 24 layers prefill a 4,096-token prompt in ~14 s on pdserve's one prefill core (~300 tok/s),
0.07 req/s of capacity, a handful of requests per minute-long rate.

Writes <out>/<time>/goodput.json (every rate's whole summary), table.md (goodput, throughput, attainment,
TTFT/TPOT p50 and p99 per system and rate) and goodput.png (goodput and throughput against the offered
rate, one line per system; matplotlib, else said).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
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
    slo_itl_ms: float | None = None

    def __post_init__(self) -> None:
        if not self.rates or any(not r > 0 for r in self.rates):
            raise ValueError(f"--rates must be requests/s > 0, got {list(self.rates)}")
        if not self.duration > 0:
            raise ValueError(f"--duration must be > 0 s, got {self.duration}")
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        if self.slo_itl_ms is not None and not self.slo_itl_ms > 0:
            raise ValueError(f"--slo-itl-ms must be > 0 (or left out: no ITL SLO), got {self.slo_itl_ms}")
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
            "max_itl_p50_ms": summary["max_itl_ms"].get("median"), "max_itl_p99_ms": summary["max_itl_ms"].get("p99"),
            "load_avg": load_average()[0]}


async def sweep_rates(target: Target, sweep: Sweep, vocab_size: int, progress: bool = False,
                      log=lambda message: None, stop_below: float | None = None) -> list[dict]:
    """Each rate in turn, lowest first: Poisson arrivals of that rate's own prompts (`requests`) for the
    sweep's duration; a row per rate (and its whole summary under "summary"). stop_below: stop after the first
    rate whose SLO attainment is below it (--find-miss)."""
    rows = []
    for rate in sorted(sweep.rates):
        log(f"{rate:g} req/s for {sweep.duration:g} s (load {load_average()[0]})")
        group = Group(f"rate-{rate:g}", requests(sweep, vocab_size, rate),
                      LoadSpec(rate=rate, arrival="poisson", seed=sweep.seed))
        result = await run_groups(target, [group], duration=sweep.duration, progress=progress)
        summary = summarize(result.outputs, slo_ttft_ms=sweep.slo_ttft_ms, slo_tpot_ms=sweep.slo_tpot_ms,
                            slo_itl_ms=sweep.slo_itl_ms)
        rows.append({**row(rate, summary), "summary": summary})
        log(f"{rate:g} req/s: goodput {summary['goodput']:.3f} req/s of {summary['request_throughput']:.3f} "
            f"completed ({100 * summary['slo_attainment']:.0f}% met every SLO)")
        if stop_below is not None and summary["slo_attainment"] < stop_below:
            log(f"{rate:g} req/s: the first rate below {100 * stop_below:g}% attainment: stopping the ladder")
            break
    return rows


def ladder(start: float, step: float, max_rate: float) -> tuple[float, ...]:
    """--find-miss's rates: start, start x step, ... while at most max_rate (3 significant digits)."""
    if not step > 1:
        raise ValueError(f"--step must be > 1 (each rate that many times the last), got {step}")
    if not max_rate >= start > 0:
        raise ValueError(f"--max-rate ({max_rate:g}) must be >= the first of --rates ({start:g}) > 0")
    rates, r = [], start
    while r <= max_rate * (1 + 1e-9):
        rates.append(float(f"{r:.3g}"))
        r *= step
    return tuple(rates)


def first_miss(rows: list[dict], attainment: float) -> dict | None:
    """The lowest rate whose SLO attainment is below `attainment` (None: every rate met it)."""
    return next((r for r in sorted(rows, key=lambda r: r["rate"]) if r["slo_attainment"] < attainment), None)


def at_miss(results: dict[str, list[dict]], reference: str, attainment: float) -> tuple[float | None, dict]:
    """The reference's first missing rate and each other system's goodput there as a ratio of the
    reference's (None where the reference's goodput is 0 or the system did not run that rate)."""
    miss = first_miss(results.get(reference, []), attainment)
    if miss is None:
        return None, {}
    ratios = {}
    for system, rows in results.items():
        mine = next((r for r in rows if r["rate"] == miss["rate"]), None)
        if system != reference:
            ratios[system] = mine["goodput"] / miss["goodput"] if mine and miss["goodput"] > 0 else None
    return miss["rate"], ratios


def _fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def slos(sweep: Sweep) -> str:
    itl = "" if sweep.slo_itl_ms is None else f", each request's longest inter-token gap <= {sweep.slo_itl_ms:g} ms"
    return f"TTFT <= {sweep.slo_ttft_ms:g} ms, TPOT <= {sweep.slo_tpot_ms:g} ms{itl}"


def table(results: dict[str, list[dict]], sweep: Sweep) -> str:
    lines = [f"SLOs: {slos(sweep)}; {sweep.input_len}-token prompts, {sweep.output_len} tokens out, Poisson "
             f"arrivals (seed {sweep.seed}), {sweep.duration:g} s per rate",
             "",
             "| system | offered (req/s) | goodput (req/s) | completed (req/s) | SLO attainment | TTFT p50 / p99 (ms) | "
             "TPOT p50 / p99 (ms) | longest gap p50 / p99 (ms) | failed | load avg |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for system, rows in results.items():
        for r in rows:
            lines.append(f"| {system} | {r['rate']:g} | {r['goodput']:.2f} | {r['request_throughput']:.2f} | "
                         f"{100 * r['slo_attainment']:.0f}% | {_fmt(r['ttft_p50_ms'])} / {_fmt(r['ttft_p99_ms'])} | "
                         f"{_fmt(r['tpot_p50_ms'])} / {_fmt(r['tpot_p99_ms'])} | "
                         f"{_fmt(r.get('max_itl_p50_ms'))} / {_fmt(r.get('max_itl_p99_ms'))} | {r['failed']} | "
                         f"{r['load_avg']:.1f} |")
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
    ax.set_title(f"goodput at {slos(sweep)}", fontsize=8)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def miss_note(results: dict[str, list[dict]], reference: str, attainment: float) -> str:
    """--find-miss's lines under the table: where the reference first missed, each system's ratio there."""
    rate, ratios = at_miss(results, reference, attainment)
    if rate is None:
        return f"\n- `{reference}` met the SLOs for at least {100 * attainment:g}% of requests at every rate run"
    ref = next(r for r in results[reference] if r["rate"] == rate)
    lines = f"\n- `{reference}` first misses at {rate:g} req/s ({100 * ref['slo_attainment']:.0f}% < " \
            f"{100 * attainment:g}%; goodput {ref['goodput']:.2f} req/s)"
    for system, ratio in ratios.items():
        lines += (f"\n- `{system}` there: " + (f"{ratio:.2f}x `{reference}`'s goodput" if ratio is not None
                                                else "no ratio (not run at that rate, or the reference's goodput is 0)"))
    return lines


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="goodput", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {', '.join(SYSTEMS)}")
    p.add_argument("--rates", default="0.5,1,2,4", help="offered request rates (req/s), comma-separated")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per rate")
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=100.0)
    p.add_argument("--slo-itl-ms", type=float, default=None,
                   help="each request's longest inter-token gap must stay within this (default: no ITL SLO)")
    p.add_argument("--find-miss", action="store_true",
                   help="the first system climbs a ladder of rates (the lowest of --rates, x --step, up to --max-rate) "
                        "to the first rate below --attainment; the others run there and the rate below")
    p.add_argument("--step", type=float, default=1.5, help="--find-miss: each rate this many times the last")
    p.add_argument("--max-rate", type=float, default=64.0, help="--find-miss: the ladder's top")
    p.add_argument("--attainment", type=float, default=0.9,
                   help="--find-miss: a rate is missed when fewer than this share of requests meet every SLO")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", type=Path, help="checkpoint dir (default: the side-by-side's Qwen2.5-0.5B-shaped one)")
    p.add_argument("--layers", type=int, default=None,
                   help="the default checkpoint with this many of Qwen2.5-0.5B's 24 layers (shapes unchanged)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="every system's (pdserve's workers too); default: the model's, at most 4096, or "
                        "--input-len + --output-len rounded up to a power of two when more")
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
                      args.output_len, args.seed, args.slo_itl_ms)
        if args.find_miss:
            sweep = dataclasses.replace(sweep, rates=ladder(min(sweep.rates), args.step, args.max_rate))
            if not 0 < args.attainment <= 1:
                raise ValueError(f"--attainment must lie in (0, 1], got {args.attainment}")
        if args.model and args.layers:
            raise ValueError("--layers shapes the default checkpoint: give --model or --layers, not both")
        if args.layers is not None and not 1 <= args.layers <= 24:
            raise ValueError(f"--layers must lie in 1..24 (Qwen2.5-0.5B has 24), got {args.layers}")
    except ValueError as e:
        raise SystemExit(f"goodput: {e}") from None
    record = MachineRecord.take()
    gate(record, args.max_load, args.allow_noisy)
    layers = f"-{args.layers}l" if args.layers and args.layers != 24 else ""
    model = args.model or make_qwen25_05b_shape(
        cache_dir() / "models" / f"qwen2.5-0.5b-shape-random-{args.dtype}{layers}", args.dtype,
        num_hidden_layers=args.layers if layers else None)
    config = load_config(model)
    needed = sweep.input_len + sweep.output_len
    if needed > config.max_model_len:
        raise SystemExit(f"--input-len + --output-len ({needed}) exceed the model's "
                         f"max length {config.max_model_len}: shorten them")
    max_model_len = args.max_model_len or min(config.max_model_len, max(4096, 1 << (needed - 1).bit_length()))
    if needed > max_model_len:
        raise SystemExit(f"--input-len + --output-len ({needed}) exceed --max-model-len {max_model_len}: raise it")
    launch = argparse.Namespace(dtype=args.dtype, max_model_len=max_model_len, pdserve_max_model_len=max_model_len,
                                pdserve_front="http")
    run_dir = args.out / time.strftime("%Y%m%d-%H%M%S")
    results: dict[str, list[dict]] = {}
    failures: dict[str, str] = {}
    with LoadMonitor() as monitor:
        for system in systems:
            own, stop_below = sweep, None
            if args.find_miss and system == systems[0]:
                stop_below = args.attainment
            elif args.find_miss:
                miss = first_miss(results.get(systems[0], []), args.attainment)
                if miss is None:
                    failures[system] = (f"not run: the reference {systems[0]} did not miss the SLOs up to "
                                        f"{max(sweep.rates):g} req/s (raise --max-rate)")
                    log(f"{system}: {failures[system]}")
                    continue
                below = [r for r in sweep.rates if r < miss["rate"]]
                own = dataclasses.replace(sweep, rates=(*below[-1:], miss["rate"]))
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
                        return await sweep_rates(target, own, config.vocab_size, progress=not args.no_progress,
                                                 log=lambda m: log(f"{system}: {m}"), stop_below=stop_below)
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
    if args.find_miss:
        notes += miss_note(results, systems[0], args.attainment)
    cmd = "python -m pdserve.benchmarks.load.goodput " + " ".join(argv if argv is not None else sys.argv[1:])
    doc = f"`{cmd.strip()}` (model {model.name})\n\n{record.markdown()}\n\n{text}\n{peaks}{notes}\n"
    if why_no_plot:
        doc += f"\n{why_no_plot}\n"
    (run_dir / "table.md").write_text(doc)
    (run_dir / "goodput.json").write_text(json.dumps(
        {"sweep": sweep.__dict__, "model": str(model), "max_model_len": max_model_len,
         "find_miss": dict(zip(("rate", "ratios"), at_miss(results, systems[0], args.attainment)))
         if args.find_miss else None, "machine": record.as_dict(), "failures": failures,
         "results": results}, indent=1, default=str))
    print(doc)
    log(f"written: {run_dir / 'table.md'}" + ("" if why_no_plot else f", {run_dir / 'goodput.png'}"))
    return 0 if results else 1


if __name__ == "__main__":
    sys.exit(main())
