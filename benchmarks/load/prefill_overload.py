"""Prefill under overload: `fifo` as before vs shortest-first + expected-wait admission, in one run.

    .venv/bin/python -m pdserve.benchmarks.load.prefill_overload --duration 40 [--allow-noisy]

The side-by-side's bursts scenario (pdserve only), with long prompts arriving faster than one prefill
worker serves them. Load, the same for every configuration:
- decode: --concurrency closed-loop clients, 32-token prompts, --decode-len tokens each; every new
  answer needs a short prefill, so their throughput is what a FIFO prefill queue starves;
- short: 32-token prompts (--short-len), 4 tokens, Poisson --short-rate/s;
- long: --long-len-token prompts, max_tokens 1, Poisson --long-rate/s (more than the worker serves).
For each configuration (--configs; default `fifo` without a TTFT budget, as before, and the new
default `shortest-first` with `--ttft-budget`, whose prefill worker keeps every admitted prompt's
first token within the budget, server/prefill/scheduler.py) it starts a fresh pdserve (prefill worker
pinned to core 0, decode worker to core 1, registered with the coordinator so it reports its load),
times one long prefill alone (`one prefill`), runs the load, and prints one table: TTFT p50/p99 of
short requests, the decoding clients' throughput, requests refused early (RESOURCE_EXHAUSTED with a
retry hint) and how fast, the longest TTFT of an admitted request against budget + one prefill (and
how many admitted requests went past the budget, and past budget + one prefill), and the
coordinator's expected vs actual prefill waits of the admitted requests (its /metrics). The machine
record (benchmarks/protocol.py: load average before, during and after) heads the table; above
--max-load the run is refused unless --allow-noisy, which marks it noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
import urllib.request
from pathlib import Path

from pdserve.benchmarks import protocol
from pdserve.server.plan import datasets
from pdserve.benchmarks.bench import Group, run_groups
from pdserve.benchmarks.checkpoint import VOCAB_SIZE, make_qwen25_05b_shape
from pdserve.benchmarks.clients import GrpcTarget
from pdserve.server.plan.run_summary import RequestOutput
from pdserve.server.plan.arrivals import LoadSpec
from pdserve.benchmarks.metrics import prometheus_value
from pdserve.server.plan.run_summary import stats
from pdserve.benchmarks.servers import Server, _spawn, _wait, pools_ready
from pdserve.benchmarks.paths import RESULTS
from pdserve.server.launcher import free_port
from pdserve.server.cache_dir import cache_dir


def start(model: Path, out: Path, order: str, budget: float, weight_dtype: str, chunk: int = 0) -> tuple[Server, int]:
    """A coordinator, one prefill and one decode worker (prefilling in chunks of `chunk` tokens when
    given); returns the server and the metrics port."""
    py = [sys.executable, "-m", "pdserve.server.cli"]
    host, cp, mp = "127.0.0.1", free_port(), free_port()
    coordinator = f"{host}:{cp}"
    env = {"PDSERVE_LOG_LEVEL": "WARNING"}
    logs = [out / "coordinator.log", out / "prefill.log", out / "decode.log"]
    procs = [_spawn([*py, "coordinator", "--model", str(model), "--port", str(cp), "--host", host,
                     "--metrics-port", str(mp), "--ttft-budget", str(budget)], logs[0], None, env)]
    procs.append(_spawn([*py, "prefill", "--model", str(model), "--port", str(free_port()), "--host", host,
                         "--weight-dtype", weight_dtype, "--prefill-order", order, "--coordinator", coordinator,
                         *(["--max-prefill-chunk", str(chunk)] if chunk else [])],
                        logs[1], {0}, env))
    procs.append(_spawn([*py, "decode", "--model", str(model), "--port", str(free_port()), "--host", host,
                         "--weight-dtype", weight_dtype, "--threads", "1", "--coordinator", coordinator],
                        logs[2], {1}, env))

    def ready() -> bool:
        try:
            text = scrape(mp)
        except OSError:
            return False
        return bool(re.search(r"^pdserve_num_requests_running[ {]", text, re.M)) and pools_ready(coordinator)

    server = Server(f"{order} budget={budget:g}", procs, lambda: GrpcTarget(coordinator, timeout=600), logs)
    try:
        _wait(ready, procs, logs, 600, "pdserve")
    except BaseException:
        server.stop()
        raise
    return server, mp


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def refused(o: RequestOutput) -> bool:
    return o.error.startswith("RESOURCE_EXHAUSTED") and "retry after" in o.error


async def one_prefill(target: GrpcTarget, long_len: int) -> float:
    """TTFT of one long prompt on the idle server (its prefill time, near enough)."""
    (req,) = datasets.synthetic(1, input_len=long_len, output_len=1, vocab_size=VOCAB_SIZE, seed=11)
    times = []
    for _ in range(2):  # the first compiles
        for _ in range(30):
            out = RequestOutput("probe", long_len)
            await target.send(req, out)
            if not refused(out):
                break
            await asyncio.sleep(1.0)  # the worker's last load report still held the previous probe
        if not out.success:
            raise RuntimeError(f"a lone long prompt failed: {out.error}")
        times.append(out.ttft)
    return min(times)


async def run_one(target: GrpcTarget, args, metrics_port: int, budget: float) -> dict:
    short = datasets.synthetic(8, input_len=args.short_len, output_len=4, vocab_size=VOCAB_SIZE, seed=5)
    for rows in (1, 2, 4, 8):  # compiles the short bucket at each batch size the load makes (near enough)
        await asyncio.gather(*(target.send(r, RequestOutput("warmup", r.prompt_len)) for r in short[:rows]))
    prefill_s = await one_prefill(target, args.long_len)  # and the long one
    before = scrape(metrics_port)
    groups = [
        Group("decode", datasets.synthetic(64, input_len=args.short_len, output_len=args.decode_len,
                                           vocab_size=VOCAB_SIZE, seed=2), LoadSpec(concurrency=args.concurrency)),
        Group("short", datasets.synthetic(64, input_len=args.short_len, output_len=4, vocab_size=VOCAB_SIZE,
                                          seed=3), LoadSpec(rate=args.short_rate, seed=6)),
        Group("long", datasets.synthetic(16, input_len=args.long_len, output_len=1, vocab_size=VOCAB_SIZE,
                                         seed=4), LoadSpec(rate=args.long_rate, seed=7, start_after=2.0)),
    ]
    res = await run_groups(target, groups, duration=args.duration, progress=False)
    after = scrape(metrics_port)
    by = {g.name: [o for o in res.outputs if o.group == g.name] for g in groups}
    ok = [o for o in res.outputs if o.success]
    deltas = {k: prometheus_value(after, k) - prometheus_value(before, k) for k in (
        "pdserve_prefill_expected_wait_seconds_sum", "pdserve_prefill_expected_wait_seconds_count",
        "pdserve_prefill_wait_seconds_sum", "pdserve_prefill_wait_seconds_count")}
    longest = max((o.ttft for o in ok), default=0.0)
    doc = {
        "one_prefill_s": prefill_s,
        "ttft_budget_s": budget,
        "run_s": res.end - res.start,
        "decode_tok_s": sum(o.output_len for o in by["decode"] if o.success) / args.duration,
        "longest_admitted_ttft_s": longest,
        "admitted_within_budget_plus_one_prefill": (longest <= budget + prefill_s) if budget else None,
        "admitted_past_budget": sum(o.ttft > budget for o in ok) if budget else None,
        "admitted_past_budget_plus_one_prefill": sum(o.ttft > budget + prefill_s for o in ok) if budget else None,
        "admitted": len(ok),
        "expected_wait_mean_s": _mean(deltas, "pdserve_prefill_expected_wait_seconds"),
        "actual_wait_mean_s": _mean(deltas, "pdserve_prefill_wait_seconds"),
    }
    for name, outs in by.items():
        served = [o for o in outs if o.success]
        doc[name] = {
            "sent": len(outs), "served": len(served), "refused_early": sum(refused(o) for o in outs),
            "other_errors": sorted({o.error[:100] for o in outs if not o.success and not refused(o)}),
            "ttft_ms": stats([o.ttft for o in served]),
            "refusal_ms": stats([o.latency for o in outs if refused(o)]),
        }
    return doc


def _mean(deltas: dict[str, float], name: str) -> float | None:
    n = deltas[f"{name}_count"]
    return deltas[f"{name}_sum"] / n if n else None


def table(results: dict[str, dict]) -> str:
    def f(v, digits=0):
        return "-" if v is None else f"{v:.{digits}f}"

    rows = [
        ("short TTFT p50 (ms)", lambda d: f(d["short"]["ttft_ms"].get("median"))),
        ("short TTFT p99 (ms)", lambda d: f(d["short"]["ttft_ms"].get("p99"))),
        ("decode clients' first-token p50 (ms)", lambda d: f(d["decode"]["ttft_ms"].get("median"))),
        ("decode clients' throughput (tok/s)", lambda d: f(d["decode_tok_s"], 1)),
        ("long served / sent", lambda d: f"{d['long']['served']} / {d['long']['sent']}"),
        ("long TTFT p50 (ms)", lambda d: f(d["long"]["ttft_ms"].get("median"))),
        ("refused early with a retry hint (long, short, decode)",
         lambda d: f"{d['long']['refused_early']}, {d['short']['refused_early']}, {d['decode']['refused_early']}"),
        ("refusal latency max (ms)", lambda d: f(max((d[g]["refusal_ms"].get("max", 0) for g in
                                                       ("long", "short", "decode")), default=0))),
        ("one prefill (long prompt alone, ms)", lambda d: f(d["one_prefill_s"] * 1000)),
        ("TTFT budget (s)", lambda d: f(d["ttft_budget_s"], 1) if d["ttft_budget_s"] else "none"),
        ("longest admitted TTFT (ms)", lambda d: f(d["longest_admitted_ttft_s"] * 1000)),
        ("longest <= budget + one prefill", lambda d: {None: "-", True: "yes", False: "NO"}[
            d["admitted_within_budget_plus_one_prefill"]]),
        ("admitted past budget, past budget + one prefill / admitted",
         lambda d: "-" if d["admitted_past_budget"] is None else
         f"{d['admitted_past_budget']}, {d['admitted_past_budget_plus_one_prefill']} / {d['admitted']}"),
        ("mean expected / actual prefill wait (s)",
         lambda d: f"{f(d['expected_wait_mean_s'], 2)} / {f(d['actual_wait_mean_s'], 2)}"),
        ("load run incl. drain (s)", lambda d: f(d["run_s"])),
    ]
    names = list(results)
    lines = ["| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    lines += [f"| {label} | " + " | ".join(get(results[n]) for n in names) + " |" for label, get in rows]
    return "\n".join(lines)


def run_configs(args, model: Path, run_dir: Path) -> dict[str, dict]:
    """Each configuration on a fresh pdserve, one after the other: its result by name."""
    results: dict[str, dict] = {}
    for config in args.configs.split(","):
        order, budget_text, chunk_text = (config.split(":") + ["", ""])[:3]
        budget, chunk = float(budget_text or 0), int(chunk_text or 0)
        name = f"{order}, budget {budget:g} s" if budget else f"{order}, no budget"
        name += f", chunks of {chunk}" if chunk else ""
        out = run_dir / config.replace(":", "-")
        out.mkdir(parents=True, exist_ok=True)
        print(f"== {name}: starting ...", file=sys.stderr, flush=True)
        server, metrics_port = start(model, out, order, budget, args.weight_dtype, chunk)
        try:

            async def go():
                target = server.make_target()
                try:
                    return await run_one(target, args, metrics_port, budget)
                finally:
                    await target.close()

            results[name] = asyncio.run(go())
            (out / "result.json").write_text(json.dumps(results[name], indent=1))
        finally:
            server.stop()
        print(f"== {name}: done", file=sys.stderr, flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="prefill_overload", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="checkpoint dir (default: Qwen2.5-0.5B's shape, --layers layers)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--weight-dtype", default="float32", help="both workers' --weight-dtype")
    p.add_argument("--configs", default="fifo:0,shortest-first:30,shortest-first:30:256",
                   help="ORDER:TTFT_BUDGET_S[:CHUNK] each; budget 0: none (the deadline alone); CHUNK: --max-prefill-chunk")
    p.add_argument("--duration", type=float, default=40.0, help="seconds of load per configuration")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--decode-len", type=int, default=16)
    p.add_argument("--short-len", type=int, default=32)
    p.add_argument("--short-rate", type=float, default=0.5)
    p.add_argument("--long-len", type=int, default=1536)
    p.add_argument("--long-rate", type=float, default=0.4)
    p.add_argument("--out", type=Path, default=RESULTS / "prefill_overload")
    p.add_argument("--max-load", type=float, default=2.0, help="refuse to run above this 1-minute load average")
    p.add_argument("--allow-noisy", action="store_true", help="run above --max-load anyway, the result marked noisy")
    args = p.parse_args(argv)
    record = protocol.MachineRecord.take()
    protocol.gate(record, args.max_load, args.allow_noisy)
    run_dir = args.out / time.strftime("%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    cache = cache_dir()
    model = args.model or make_qwen25_05b_shape(
        cache / "models" / f"qwen2.5-0.5b-shape-random-bfloat16-{args.layers}l", num_hidden_layers=args.layers)
    with protocol.LoadMonitor() as monitor:
        results = run_configs(args, model, run_dir)
    record.finish(monitor)
    text = f"{record.markdown()}\n\n{table(results)}"
    cmd = "python -m pdserve.benchmarks.load.prefill_overload " + " ".join(argv if argv is not None else sys.argv[1:])
    (run_dir / "table.md").write_text(f"`{cmd.strip()}` (model {model.name})\n\n{text}\n")
    (run_dir / "prefill_overload.json").write_text(json.dumps(
        {"config": {k: str(v) for k, v in vars(args).items()}, "machine": record.as_dict(), "results": results},
        indent=1))
    print(text)
    print(f"written: {run_dir / 'table.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
