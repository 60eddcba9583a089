"""A hostile run against a served cluster: no request may kill a process, bad input gets a client error
(never a 5xx), and a greedy stream beside it all keeps its pace (issue 38's acceptance).

    python -m pdserve.benchmarks.hostile [--requests 10000] [--concurrency 16] [--out runs/hostile]
    python -m pdserve.benchmarks.hostile --addr HOST:PORT --http URL --state-file FILE   # a cluster already up

Life cycle:
1. Starts `pdserve up` on 127.0.0.1 (the embedded model unless --model; 1 prefill + 1 decode worker; the
   OpenAI HTTP front, pdserve.v1.Generation and KServe v2 on the coordinator's gRPC port), or attaches to one.
2. Builds every family's cases once (`families.py`: deep/wide/long schemas, Lark and regex bombs,
   huge tool lists, deep JSON, bad UTF-8, integers past int64, NaN/inf, oversized bodies and messages,
   malformed protobufs, wrong types, internal ports without the cluster credential).
3. Sends --requests of them, families in turn, --concurrency at a time, each with a deadline; meanwhile
   one greedy gRPC stream after another runs (`ItlProbe`) and every process's pid is watched
   (`ProcessWatch`: the state file the supervisor rewrites on a restart, and its "exited with code" lines).
4. Prints a table and writes hostile.json + hostile.txt to --out; exits 1 when the acceptance fails,
   naming what failed and where to look.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
import httpx
from pdserve.benchmarks.hostile.families import GENERATE, Case, Targets, families
from pdserve.benchmarks.hostile.send import Outcome, Ports
from pdserve.benchmarks.servers import UpCluster, pdserve_up
from pdserve.v1 import generation_pb2 as gen_pb
from tqdm import tqdm

MAX_GAP_S = 2.0
"""The acceptance: the greedy stream's worst inter-token gap stays under this."""


class ItlProbe(threading.Thread):
    """One greedy gRPC stream at a time, until stopped; records the gaps between token-bearing messages."""

    def __init__(self, address: str, max_tokens: int = 64, timeout: float = 120.0):
        super().__init__(daemon=True, name="itl-probe")
        self.address, self.max_tokens, self.timeout = address, max_tokens, timeout
        self.gaps: list[float] = []
        self.worst_at: float = 0.0
        self.streams = 0
        self.errors: list[str] = []
        self._halt = threading.Event()
        self._t0 = time.monotonic()

    def run(self) -> None:
        request = gen_pb.GenerateRequest(token_ids=gen_pb.TokenIds(ids=[3, 4, 5, 6]), sampling=gen_pb.SamplingParams(
            max_tokens=self.max_tokens, temperature=0.0, ignore_eos=True))
        with grpc.insecure_channel(self.address) as ch:
            call = ch.unary_stream(GENERATE, request_serializer=gen_pb.GenerateRequest.SerializeToString,
                                   response_deserializer=gen_pb.GenerateResponse.FromString)
            while not self._halt.is_set():
                last = None
                try:
                    for message in call(request, timeout=self.timeout):
                        now = time.monotonic()
                        if message.token_ids:
                            if last is not None:
                                self.gaps.append(now - last)
                                if self.gaps[-1] >= max(self.gaps):
                                    self.worst_at = now - self._t0
                            last = now
                    self.streams += 1
                except grpc.RpcError as e:
                    self.errors.append(f"{e.code().name}: {e.details()}"[:300])
                    self._halt.wait(0.5)

    def stop(self) -> None:
        self._halt.set()
        self.join(self.timeout)


class ProcessWatch(threading.Thread):
    """Polls the cluster's state file and pids; a pid that changed or is gone is a death."""

    def __init__(self, cluster: UpCluster | None, every: float = 0.25):
        super().__init__(daemon=True, name="process-watch")
        self.cluster, self.every = cluster, every
        self.first = cluster.processes() if cluster else {}
        self.deaths: list[str] = []
        self._seen = {name: pid for name, (pid, _) in self.first.items()}
        self._gone: set[int] = set()
        self._halt = threading.Event()
        self._t0 = time.monotonic()

    def run(self) -> None:
        while not self._halt.wait(self.every):
            self.poll()

    def poll(self) -> None:
        if self.cluster is None:
            return
        try:
            now = self.cluster.processes()
        except (OSError, ValueError):
            return  # the supervisor is rewriting it
        for name, (pid, _) in now.items():
            if pid != self._seen.get(name):
                if self._seen.get(name) not in self._gone:
                    self.deaths.append(f"{self._at()}: {name} (pid {self._seen.get(name)}) was replaced by pid {pid}")
                self._seen[name] = pid
            elif pid not in self._gone and not _alive(pid):
                self._gone.add(pid)
                self.deaths.append(f"{self._at()}: {name} (pid {pid}) is gone")

    def _at(self) -> str:
        return f"{time.monotonic() - self._t0:.1f} s"

    def stop(self) -> dict:
        self._halt.set()
        self.join()
        self.poll()
        exits = self.cluster.exits() if self.cluster else []
        restarts = sum(r for _, r in self.cluster.processes().values()) - sum(r for _, r in self.first.values()) \
            if self.cluster else 0
        return {"deaths": max(len(self.deaths), len(exits), restarts), "restarts": restarts,
                "exits": [f"{name} (pid {pid}) exited with code {code}" for name, pid, code in exits],
                "seen": self.deaths}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except OSError:
        return False


@dataclass
class Report:
    requests: int = 0
    elapsed_s: float = 0.0
    by_family: dict[str, dict[str, int]] = field(default_factory=dict)
    """family: {client_error, served, failure, and per port}."""
    codes: dict[str, dict[str, int]] = field(default_factory=dict)
    """family: {answer code: count}."""
    failures: dict[str, dict] = field(default_factory=dict)
    """family: {count, example: {case, port, code, detail}, cases: {case: "port code"} (each failing case once)}."""
    first_failures: list[str] = field(default_factory=list)
    """The first failures in the order they came back (the first is the likeliest cause of those after it)."""
    processes: dict = field(default_factory=dict)
    itl: dict = field(default_factory=dict)

    @property
    def problems(self) -> list[str]:
        """What broke the acceptance, each with where to look next."""
        out = [f"{f}: {v['count']} failures, e.g. {v['example']['port']} '{v['example']['case']}' -> "
               f"{v['example']['code']}: {v['example']['detail'][:160]}" for f, v in self.failures.items()]
        if self.processes.get("deaths"):
            out.append(f"{self.processes['deaths']} process deaths ({'; '.join(self.processes['exits'][:4])}): "
                       f"the supervisor's log (up.log) says which request preceded each")
        if self.itl.get("worst_gap_s", 0) >= MAX_GAP_S:
            out.append(f"the greedy stream's worst inter-token gap was {self.itl['worst_gap_s']:.2f} s "
                       f"(at {self.itl['worst_at_s']:.0f} s into the run; limit {MAX_GAP_S} s): something blocked the "
                       f"coordinator's event loop or the decode step; rerun on a quiet machine to rule out load")
        if self.failures:
            out.append("each failing case above is bad input a front must answer with a 4xx / INVALID_ARGUMENT (or "
                       "serve): `--families NAME --requests N --concurrency 1` replays one family alone, the "
                       "coordinator's log (up.log in --out) holds each 5xx's traceback")
        if not self.itl.get("tokens"):
            out.append("the greedy stream got no tokens at all: is the cluster serving? (see up.log)")
        if self.itl.get("errors"):
            out.append(f"the greedy stream failed {len(self.itl['errors'])} times, first: {self.itl['errors'][0]}")
        return out


def _targets(cluster: UpCluster, deadline: float) -> Targets:
    try:
        model = httpx.get(f"{cluster.http}/v1/models", timeout=deadline).json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise SystemExit(f"the OpenAI front at {cluster.http} did not list its model ({e}); pass --http the URL "
                         f"`pdserve up --http-port` serves") from e
    return Targets(cluster.grpc, cluster.http, model, tuple(cluster.prefill), tuple(cluster.decode))


def schedule(cases: dict[str, list[Case]], n: int) -> list[Case]:
    """n cases: the families in turn, each family's cases in turn (its first cases are its worst)."""
    names = list(cases)
    return [cases[names[i % len(names)]][(i // len(names)) % len(cases[names[i % len(names)]])] for i in range(n)]


def run_hostile(cluster: UpCluster, *, requests: int, concurrency: int = 16, deadline: float = 60.0,
                only: list[str] | None = None, progress: bool = True) -> Report:
    """Steps 2-4 of the life cycle against a running cluster."""
    targets = _targets(cluster, deadline)
    plan = schedule(families(targets, only), requests)
    ports = Ports(cluster.http, deadline)
    probe, watch = ItlProbe(cluster.grpc), ProcessWatch(cluster if cluster.state_file else None)
    tallies: dict[str, Counter] = defaultdict(Counter)
    codes: dict[str, Counter] = defaultdict(Counter)
    failures: dict[str, dict] = {}
    first: list[str] = []
    lock = threading.Lock()
    bar = tqdm(total=len(plan), desc="hostile requests", unit="req", disable=not progress, file=sys.stderr,
               mininterval=1.0 if sys.stderr.isatty() else 15.0)

    def one(case: Case) -> None:
        try:
            outcome = case.send(ports)
        except Exception as e:  # noqa: BLE001 (a harness bug must not hide as a pass)
            outcome = Outcome("failure", "harness error", f"{type(e).__name__}: {e}"[:300])
        with lock:
            tallies[case.family].update([outcome.kind, f"port:{case.port}"])
            codes[case.family][outcome.code] += 1
            if outcome.kind == "failure":
                entry = failures.setdefault(case.family, {"count": 0, "example": {
                    "case": case.name, "port": case.port, "code": outcome.code, "detail": outcome.detail}, "cases": {}})
                entry["count"] += 1
                entry["cases"].setdefault(case.name, f"{case.port} {outcome.code}")
                if len(first) < 12:
                    first.append(f"{time.monotonic() - t0:.1f} s: {case.family} {case.port} '{case.name}' -> "
                                 f"{outcome.code}: {outcome.detail[:120]}")
            bar.update()
            bar.set_postfix(failures=sum(f["count"] for f in failures.values()), deaths=len(watch.deaths),
                            worst_gap=f"{max(probe.gaps, default=0):.2f}s")

    t0 = time.monotonic()
    probe.start()
    watch.start()
    try:
        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(one, plan))
        time.sleep(1.0)  # a process that dies of the last request dies now
    finally:
        bar.close()
        elapsed = time.monotonic() - t0
        probe.stop()
        processes = watch.stop()
        ports.close()
    gaps = sorted(probe.gaps)
    pct = lambda q: gaps[min(len(gaps) - 1, int(q * len(gaps)))] if gaps else 0.0
    return Report(
        requests=len(plan), elapsed_s=round(elapsed, 1),
        by_family={f: dict(c) for f, c in tallies.items()}, codes={f: dict(c) for f, c in codes.items()},
        failures=failures, first_failures=first, processes=processes,
        itl={"worst_gap_s": round(max(gaps, default=0.0), 3), "worst_at_s": round(probe.worst_at, 1),
             "p50_ms": round(pct(0.5) * 1e3, 2), "p99_ms": round(pct(0.99) * 1e3, 2), "tokens": len(gaps),
             "streams": probe.streams, "errors": probe.errors[:20]})


def table(report: Report) -> str:
    ports = ("openai", "grpc", "kserve", "internal")
    lines = [f"{'family':24} {'sent':>6} {'client err':>10} {'served':>7} {'FAILED':>7}   "
             + " ".join(f"{p:>8}" for p in ports) + "   answers"]
    for fam, c in report.by_family.items():
        sent = c.get("client_error", 0) + c.get("served", 0) + c.get("failure", 0)
        answers = ", ".join(f"{k} x{v}" for k, v in sorted(report.codes[fam].items(), key=lambda kv: -kv[1])[:5])
        per_port = " ".join(f"{c.get(f'port:{p}', 0):8}" for p in ports)
        lines.append(f"{fam:24} {sent:6} {c.get('client_error', 0):10} {c.get('served', 0):7} "
                     f"{c.get('failure', 0):7}   {per_port}   {answers}")
    itl = report.itl
    lines += ["", (f"requests {report.requests} in {report.elapsed_s} s; process deaths "
                   f"{report.processes.get('deaths')} (restarts by the supervisor {report.processes.get('restarts')})"),
              (f"greedy stream beside it: {itl['streams']} streams, {itl['tokens']} gaps, worst "
               f"{itl['worst_gap_s']:.3f} s (limit {MAX_GAP_S} s), p50 {itl['p50_ms']} ms, p99 {itl['p99_ms']} ms, "
               f"{len(itl['errors'])} stream errors")]
    for fam, v in report.failures.items():
        lines += ["", f"{fam}: the failing cases"] + [f"  {port_code:32} {name}" for name, port_code in v["cases"].items()]
    if report.first_failures:
        lines += ["", "first failures, in order:"] + [f"  {f}" for f in report.first_failures]
    if report.processes.get("seen"):
        lines += ["process deaths seen:"] + [f"  {d}" for d in report.processes["seen"]]
    problems = report.problems
    lines += ["", "ACCEPTANCE: " + ("PASS" if not problems else "FAIL")] + [f"  - {p}" for p in problems]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdserve.benchmarks.hostile", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--deadline", type=float, default=60.0, help="seconds a request may take before it counts as a hang")
    ap.add_argument("--families", nargs="+", help="only these families (default: all)")
    ap.add_argument("--out", type=Path, help="write hostile.json and hostile.txt here")
    ap.add_argument("--model", type=Path, help="checkpoint to serve (default: the embedded model)")
    ap.add_argument("--up-arg", action="append", default=[], metavar="FLAG",
                    help="a flag for `pdserve up` (repeat; e.g. --up-arg=--max-queue=64)")
    g = ap.add_argument_group("attach to a cluster already up (instead of starting one)")
    g.add_argument("--addr", help="the coordinator's gRPC HOST:PORT")
    g.add_argument("--http", help="its OpenAI front's URL, e.g. http://127.0.0.1:8000")
    g.add_argument("--state-file", type=Path, help="its `pdserve up --state-file` (pids and workers; without it no "
                                                   "process is watched and internal ports are not tried)")
    g.add_argument("--up-log", type=Path, help="its `pdserve up` output (the supervisor's exit lines)")
    args = ap.parse_args(argv)
    if args.requests < 1 or args.concurrency < 1:
        ap.error("--requests and --concurrency must be >= 1")
    with ExitStack() as stack:
        if args.addr:
            if not args.http:
                ap.error("--addr needs --http (the OpenAI front's URL) too")
            state = json.loads(args.state_file.read_text()) if args.state_file else {"prefill": [], "decode": []}
            cluster = UpCluster(args.addr, args.http, state["prefill"], state["decode"], "", args.state_file,
                                args.up_log or Path(os.devnull))
        else:
            from pdserve.server.cli import default_model_dir

            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="pdserve-hostile-")))
            if args.out:
                workdir = args.out
            print("starting pdserve up (1 prefill + 1 decode worker) ...", file=sys.stderr)
            try:
                cluster = stack.enter_context(pdserve_up(args.model or default_model_dir(), workdir,
                                                         extra_args=args.up_arg))
            except RuntimeError as e:
                print(f"hostile: {e}\n(check --model and the --up-arg flags; `pdserve up --help` lists them)",
                      file=sys.stderr)
                return 2
            print(f"serving: gRPC {cluster.grpc}, HTTP {cluster.http}; its log: {cluster.log}", file=sys.stderr)
        report = run_hostile(cluster, requests=args.requests, concurrency=args.concurrency, deadline=args.deadline,
                             only=args.families)
    text = table(report)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "hostile.json").write_text(json.dumps({**asdict(report), "problems": report.problems,
                                                           "argv": sys.argv[1:]}, indent=2))
        (args.out / "hostile.txt").write_text(text + "\n")
        print(f"wrote {args.out / 'hostile.json'} and {args.out / 'hostile.txt'}", file=sys.stderr)
    return 1 if report.problems else 0


if __name__ == "__main__":
    sys.exit(main())
