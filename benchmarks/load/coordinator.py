"""Tokens/s one coordinator process relays to many concurrent streams: before and after batched streams.

    python -m pdserve.benchmarks.load.coordinator [--streams 256 1024] [--fronts grpc sse] [--seconds 10]
        [--baseline-rev REV] [--out results/coordinator.json]

One fake prefill + decode worker process (`fake_workers.py`: no compute, tokens as fast as the coordinator
takes them), ONE coordinator process, and N closed-loop client streams (each request 8 prompt tokens,
`--output-len` tokens out; a new one starts when one ends): over gRPC `Generate` from this process
(grpc.aio), or over the OpenAI SSE front (`/v1/completions`, stream) from `--sse-clients` processes of
their own (`sse_client.py`: raw asyncio on uvloop, HTTP/1.1 keep-alive, every event's JSON parsed; httpx
cost more per event than the coordinator, and set the pace). After a warm-up, it counts the tokens the
clients receive in a `--seconds` window, and the CPU seconds in it (from /proc) of the coordinator, of
the clients and of the workers. Every stream that ends is checked against what the workers sent (its
tokens = max_tokens; SSE: = the usage, and `data: [DONE]` last); one that does not fails the run.

Three coordinators run in the same invocation against the same workers:
- before: the coordinator of `--baseline-rev` (default: the commit before batched streams), extracted
  with `git archive` and run from there: one message per token per request from decode, one response
  per token to the client;
- after: this checkout's, default flags: one `StepBatch` per decode step per connection, and adaptive
  coalescing (a stream still writing its previous response gets the tokens that arrived meanwhile in
  its next one; no timer);
- per-event: the same with `--max-coalesce 1`: one response per decode event, the coordinator merges
  nothing (a lagging coordinator still gets steps joined by the worker).

The figure is tokens/s (wall) and tokens per coordinator CPU-second, against before. The clients share
the machine's cores with the coordinator: on a small machine they can cap the wall figure (then the
coordinator's busy share, its CPU seconds per wall second, is well under 1); the CPU figure says what the
coordinator itself costs per token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from pdserve.benchmarks.load.stream_count import StreamCount
from pdserve.benchmarks.paths import ROOT
from pdserve.server.launcher import free_port

BASELINE_REV = "590e462"
"""main just before batched decode streams (issue 18): per-request decode streams, a response per token."""
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]


@dataclass
class Row:
    coordinator: str  # before | after | per-event
    front: str  # grpc | sse
    streams: int
    tokens: int
    seconds: float
    tokens_per_s: float
    coordinator_cpu_s: float
    tokens_per_cpu_s: float
    busy: float
    """The coordinator's CPU seconds per wall second of the window (1.0: a core all the time)."""
    client_processes: int
    client_cpu_s: float
    """The client processes' CPU seconds in the window (they share the machine's cores with the coordinator)."""
    workers_cpu_s: float
    messages: int
    """Responses (gRPC messages or SSE events) carrying tokens the clients received in the window."""
    requests: int
    """Requests that ended whole in the window, each checked: tokens = max_tokens (= what the workers sent)."""
    errors: int
    """Failed streams in the window (first_error: the first until the window's end; none after the stop)."""
    mismatches: int
    """Streams, in the whole case, whose tokens differ from what the workers sent (or, SSE, that end without
    data: [DONE]): the run fails."""
    first_error: str = ""
    first_mismatch: str = ""


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _one_char_token(model_dir: Path) -> int:
    """A token id each repetition of which adds exactly one character of text (so SSE text counts tokens)."""
    from pdserve.server.model.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(model_dir)
    for t in range(tokenizer.hf.get_vocab_size()):
        one = tokenizer.decode([t])
        if len(one) == 1 and one.isalpha() and tokenizer.decode([t] * 7) == one * 7:
            return t
    raise SystemExit(f"no single-character token in {model_dir}'s vocabulary; pass another --model")


def _baseline_tree(rev: str, into: Path) -> Path:
    """`rev`'s source as an importable `pdserve` package under `into` (PYTHONPATH=into)."""
    src = into / "src"
    src.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    pkg = into / "pdserve"
    shutil.copytree(src / "proto" / "pdserve", pkg)
    for name in ("server", "kvcache", "benchmarks"):
        (pkg / name).symlink_to(src / name)
    return into


class Coordinator:
    def __init__(self, name: str, model_dir: Path, prefill: str, decode: str, pythonpath: Path | None,
                 args: list[str] = (), log: Path | None = None):
        self.name = name
        self.port, self.http_port = free_port(), free_port()
        env = dict(os.environ)
        if pythonpath is not None:
            env["PYTHONPATH"] = str(pythonpath)
        cmd = [sys.executable, "-m", "pdserve.server.cli", "coordinator", "--model", str(model_dir),
               "--prefill", prefill, "--decode", decode, "--port", str(self.port), "--http-port", str(self.http_port),
               "--max-queue", "100000", "--stall-timeout", "600", "--log-format", "text", *args]
        self.log = log or Path(tempfile.mkstemp(prefix=f"pdserve-coordinator-{name}-", suffix=".log")[1])
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=out)

    def wait_serving(self, timeout: float = 120.0) -> None:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"the {self.name} coordinator exited: {self.log.read_text()[-2000:]}")
            try:
                with grpc.insecure_channel(f"127.0.0.1:{self.port}") as ch:
                    reply = health_pb2_grpc.HealthStub(ch).Check(
                        health_pb2.HealthCheckRequest(service="pdserve.v1.Generation"), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.3)
        raise SystemExit(f"the {self.name} coordinator did not serve within {timeout:.0f} s")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


async def _grpc_streams(port: int, streams: int, output_len: int, counter: StreamCount, stop: asyncio.Event) -> None:
    import grpc

    from pdserve.v1 import generation_pb2 as pb
    from pdserve.v1 import generation_pb2_grpc

    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}") for _ in range(max(1, streams // 128))]
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT), sampling=pb.SamplingParams(
        max_tokens=output_len, temperature=0.0, ignore_eos=True))

    async def one(i: int) -> None:
        await asyncio.sleep(i * 0.002)  # ramp up
        stub = generation_pb2_grpc.GenerationStub(channels[i % len(channels)])
        while not stop.is_set():
            tokens = 0
            try:
                async for response in stub.Generate(request):
                    tokens += len(response.token_ids)
                    counter.tokens += len(response.token_ids)
                    counter.messages += 1
                    if stop.is_set():
                        break
                else:
                    counter.ended(tokens, output_len, "gRPC Generate")
            except grpc.aio.AioRpcError as e:
                counter.error(f"{e.code().name}: {e.details()}")
                await asyncio.sleep(0.1)

    try:
        await asyncio.gather(*(one(i) for i in range(streams)))
    finally:
        for ch in channels:
            await ch.close()


class GrpcClients:
    """The gRPC streams, in this process (grpc.aio on asyncio's own loop)."""

    def __init__(self, port: int, streams: int, output_len: int):
        self.count, self._stop = StreamCount(), asyncio.Event()
        self._task = asyncio.create_task(_grpc_streams(port, streams, output_len, self.count, self._stop))
        self.pids = [os.getpid()]

    async def counts(self) -> StreamCount:
        return StreamCount.total([vars(self.count)])

    async def stop(self) -> StreamCount:
        self._stop.set()
        try:
            await asyncio.wait_for(self._task, 60)
        except TimeoutError:
            self.count.error("the gRPC streams did not end within 60 s of the stop")
        return self.count


class SseClients:
    """The SSE streams from client processes of their own (`sse_client.py`), sharing `streams` evenly."""

    def __init__(self, procs: list[asyncio.subprocess.Process]):
        self.procs = procs
        self.pids = [p.pid for p in procs]

    @classmethod
    async def start(cls, port: int, streams: int, output_len: int, processes: int) -> SseClients:
        url = f"http://127.0.0.1:{port}/v1/models"
        with await asyncio.to_thread(urllib.request.urlopen, url, timeout=60) as reply:
            model = json.load(reply)["data"][0]["id"]
        body = {"model": model, "prompt": PROMPT, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        shares = [streams // processes + (i < streams % processes) for i in range(processes)]
        return cls([await asyncio.create_subprocess_exec(
            sys.executable, "-m", "pdserve.benchmarks.load.sse_client", "--port", str(port), "--streams", str(n),
            "--body", json.dumps(body), "--ramp-s", str(0.002 * processes),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE) for n in shares if n])

    async def _read(self) -> StreamCount:
        parts = []
        for p in self.procs:
            line = await p.stdout.readline()
            if not line:
                raise SystemExit(f"an SSE client process (pid {p.pid}) exited with {await p.wait()}: its "
                                 "error is above; fix it, or run `python -m pdserve.benchmarks.load.sse_client` alone")
            parts.append(json.loads(line))
        return StreamCount.total(parts)

    async def counts(self) -> StreamCount:
        for p in self.procs:
            p.stdin.write(b"\n")
        return await self._read()

    async def stop(self) -> StreamCount:
        for p in self.procs:
            p.stdin.close()
        try:
            return await asyncio.wait_for(self._read(), 90)
        finally:
            for p in self.procs:
                if p.returncode is None:
                    p.kill()
                await p.wait()


async def measure(coordinator: Coordinator, front: str, streams: int, output_len: int, warmup: float,
                  seconds: float, workers_pid: int, sse_processes: int = 1) -> Row:
    if front == "grpc":
        clients: GrpcClients | SseClients = GrpcClients(coordinator.port, streams, output_len)
    else:
        clients = await SseClients.start(coordinator.http_port, streams, output_len, sse_processes)
    try:
        await asyncio.sleep(warmup + streams * 0.002)
        pids = (coordinator.proc.pid, workers_pid, *clients.pids)
        first, cpu, t0 = await clients.counts(), [_cpu_seconds(p) for p in pids], time.perf_counter()
        await asyncio.sleep(seconds)
        last, elapsed = await clients.counts(), time.perf_counter() - t0
        coordinator_cpu, workers_cpu, *client_cpu = (_cpu_seconds(p) - c for p, c in zip(pids, cpu))
    finally:
        final = await clients.stop()  # its streams all checked, including those that ended after the window
    tokens = last.tokens - first.tokens
    return Row(coordinator.name, front, streams, tokens, round(elapsed, 3), round(tokens / elapsed, 1),
               round(coordinator_cpu, 3), round(tokens / coordinator_cpu, 1) if coordinator_cpu else 0.0,
               round(coordinator_cpu / elapsed, 3), len(clients.pids), round(sum(client_cpu), 3),
               round(workers_cpu, 3), last.messages - first.messages, last.requests - first.requests,
               last.errors - first.errors, final.mismatches, last.first_error, final.first_mismatch)


def _table(rows: list[Row]) -> str:
    lines = [f"{'front':<5} {'streams':>7} {'coordinator':<11} {'tok/s':>9} {'x before':>9} {'tok/cpu-s':>10} "
             f"{'x before':>9} {'tok/msg':>8} {'coord cpu-s':>11} {'busy':>5} {'client cpu-s':>12} "
             f"{'workers cpu-s':>13} {'checked':>7} {'errors':>6}"]
    for front in dict.fromkeys(r.front for r in rows):
        for n in dict.fromkeys(r.streams for r in rows):
            by = {r.coordinator: r for r in rows if r.front == front and r.streams == n}
            b = by.get("before")
            for name, r in by.items():
                x_wall = f"{r.tokens_per_s / b.tokens_per_s:.2f}" if b and b.tokens_per_s else "-"
                x_cpu = f"{r.tokens_per_cpu_s / b.tokens_per_cpu_s:.2f}" if b and b.tokens_per_cpu_s else "-"
                lines.append(f"{front:<5} {n:>7} {name:<11} {r.tokens_per_s:>9.0f} {x_wall:>9} "
                             f"{r.tokens_per_cpu_s:>10.0f} {x_cpu:>9} {r.tokens / max(r.messages, 1):>8.2f} "
                             f"{r.coordinator_cpu_s:>11.2f} {r.busy:>5.2f} {r.client_cpu_s:>12.2f} "
                             f"{r.workers_cpu_s:>13.2f} {r.requests:>7} {r.errors:>6}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[Row]:
    from pdserve.server.cli import default_model_dir

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--fronts", nargs="+", choices=["grpc", "sse"], default=["grpc", "sse"])
    p.add_argument("--seconds", type=float, default=10.0, help="the measured window per case")
    p.add_argument("--warmup", type=float, default=3.0)
    p.add_argument("--output-len", type=int, default=500)
    p.add_argument("--sse-clients", type=int, default=1, help="client processes the SSE streams are spread over")
    p.add_argument("--baseline-rev", default=BASELINE_REV, help="the 'before' coordinator's git revision; "
                                                                "'none': measure this checkout only")
    p.add_argument("--model", type=Path, help="tokenizer and config for the coordinator (default: the embedded model)")
    p.add_argument("--out", type=Path, help="write the rows here as JSON")
    args = p.parse_args(argv)
    model_dir = args.model or default_model_dir()
    from pdserve.server.model.config import load_config

    vocab_size = load_config(model_dir).vocab_size
    token = _one_char_token(model_dir)
    load = os.getloadavg()
    prefill_port, decode_port = free_port(), free_port()
    workers = subprocess.Popen([sys.executable, "-m", "pdserve.benchmarks.load.fake_workers", "--prefill-port",
                                str(prefill_port), "--decode-port", str(decode_port), "--vocab-size", str(vocab_size),
                                "--token", str(token)])
    tmp = Path(tempfile.mkdtemp(prefix="pdserve-bench-coordinator-"))
    rows: list[Row] = []
    try:
        kinds = [("after", None, []), ("per-event", None, ["--max-coalesce", "1"])]
        if args.baseline_rev != "none":
            kinds.insert(0, ("before", _baseline_tree(args.baseline_rev, tmp), []))
        cases = [(k, f, n) for f in args.fronts for n in args.streams for k in kinds]
        with tqdm(total=len(cases), desc="coordinator relay", unit="case") as bar:
            for (name, path, extra), front, n in cases:
                bar.set_postfix_str(f"{name} {front} {n} streams")
                log = (args.out.parent if args.out else tmp) / f"coordinator-{name}-{front}-{n}.log"
                log.parent.mkdir(parents=True, exist_ok=True)
                coordinator = Coordinator(name, model_dir, f"127.0.0.1:{prefill_port}", f"127.0.0.1:{decode_port}",
                                          path, extra, log)
                try:
                    coordinator.wait_serving()
                    rows.append(asyncio.run(measure(coordinator, front, n, args.output_len, args.warmup,
                                                    args.seconds, workers.pid, args.sse_clients)))
                finally:
                    coordinator.stop()
                bar.update()
    finally:
        workers.terminate()
        workers.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    for r in rows:
        print(json.dumps(asdict(r)))
    print(_table(rows))
    print(f"load average at start {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, at end "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} cores)")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"rows": [asdict(r) for r in rows], "loadavg_start": load,
                                        "baseline_rev": args.baseline_rev}, indent=2))
    wrong = [r for r in rows if r.mismatches]
    if wrong:
        raise SystemExit("\n".join(
            f"{r.coordinator} {r.front} {r.streams} streams: {r.mismatches} streams did not carry what the workers "
            f"sent, first: {r.first_mismatch}" for r in wrong) + "\nthe relay lost, invented or cut tokens: "
            "its figures are void; see the coordinator's log beside --out")
    return rows


if __name__ == "__main__":
    main()
