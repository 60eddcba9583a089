"""Real pdserve processes on 127.0.0.1, started one by one (`pdserve coordinator|prefill|decode`), so
tests can add workers to a live pool, SIGTERM or `kill -9` them, and read their metrics and logs."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.v1 import generation_pb2_grpc
from pdserve.v1 import worker_pb2 as pb
from pdserve.v1 import worker_pb2_grpc
from pdserve.server.client import open_channel
from pdserve.server.launcher import free_port
from pdserve.server.security import CLUSTER_SECRET_HEADER, TlsConfig


@dataclass
class Proc:
    name: str
    role: str
    address: str
    popen: subprocess.Popen
    log: Path
    metrics_port: int = 0
    tls: TlsConfig | None = None
    """How clients reach it (None: plaintext)."""
    internal: tuple[tuple[str, str], ...] = ()
    """Metadata the test's internal calls carry (the cluster secret, when the cluster has one)."""

    def families(self) -> set[str]:
        """The metric families the process exports (`# TYPE` lines; counters without `_total`)."""
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).read().decode()
        return {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE pdserve_")}

    def metrics_text(self) -> str:
        return urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).read().decode()

    def metrics(self) -> dict[str, float]:
        """The process's pdserve_* samples, `name{labels}` -> value, without the model_name and role
        labels every series carries (checked here: the process's own role, one model)."""
        out = {}
        for line in self.metrics_text().splitlines():
            if line.startswith("pdserve_"):
                key, value = line.rsplit(" ", 1)
                name, _, labels = key.partition("{")
                pairs = re.findall(r'(\w+="(?:[^"\\]|\\.)*")', labels)
                assert f'role="{self.role}"' in pairs and any(p.startswith("model_name=") for p in pairs), line
                rest = [p for p in pairs if not p.startswith(("model_name=", "role="))]
                out[name + (f"{{{','.join(rest)}}}" if rest else "")] = float(value)
        return out


@dataclass
class Procs:
    model_dir: Path
    tmp: Path
    procs: dict[str, Proc] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    tls: TlsConfig | None = None
    """mTLS for every process (and the test's own calls) when set."""
    cluster_secret: str | None = None
    """Every process gets it (--cluster-secret-file), and the test's internal calls carry it."""

    def start(self, name: str, role: str, *args: str, model_dir: Path | None = None, metrics: bool = True,
              wait: bool = True, python: str = sys.executable, timeout: float = 120.0) -> Proc:
        port, mport = free_port(), free_port() if metrics else 0
        log = self.tmp / f"{name}.log"
        cmd = [python, "-m", "pdserve.server.cli", role, "--model", str(model_dir or self.model_dir),
               "--port", str(port), "--host", "127.0.0.1", *(["--metrics-port", str(mport)] if metrics else []),
               *args]
        if self.tls is not None:
            cmd += ["--tls-cert", str(self.tls.cert), "--tls-key", str(self.tls.key), "--tls-ca", str(self.tls.ca)]
        internal: tuple[tuple[str, str], ...] = ()
        if self.cluster_secret is not None:
            secret_file = self.tmp / "cluster-secret"
            secret_file.write_text(self.cluster_secret)
            cmd += ["--cluster-secret-file", str(secret_file)]
            internal = ((CLUSTER_SECRET_HEADER, self.cluster_secret),)
        # The environment carries the tests' XLA compilation cache (tests/conftest.py: one per machine, which
        # in-process engines fill too): a prefill worker loads what an earlier run or test compiled.
        env = dict(os.environ, PDSERVE_PROCESS=name, PDSERVE_LOG_LEVEL="INFO", **self.env)
        with open(log, "w") as out:
            popen = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        proc = Proc(name, role, f"127.0.0.1:{port}", popen, log, mport, self.tls, internal)
        self.procs[name] = proc
        if wait:
            self.wait_serving(proc, timeout)
        return proc

    def coordinator(self, name: str = "coordinator", *args: str) -> Proc:
        # a killed worker is dead at once (its port refuses GetInfo); a live one starved of CPU on a loaded machine
        # may answer late, and must not be taken for dead (its requests failed) for that
        return self.start(name, "coordinator", "--heartbeat-timeout", "10", *args)

    def worker(self, name: str, role: str, coordinator: Proc, *args: str, **kw) -> Proc:
        proc = self.start(name, role, "--coordinator", coordinator.address, *args, **kw)
        if kw.get("wait", True):
            wait_until(lambda: state_of(coordinator, proc) == "ready", f"{name} ready in {coordinator.name}")
        return proc

    def wait_ready(self, coordinator: Proc, count: int, timeout: float = 120.0) -> None:
        """Until `coordinator` lists `count` workers, all ready. A worker that exits meanwhile fails at once, and a
        timeout names each worker's state, both with the tail of the workers' logs (what to look at next)."""
        states: list[str] = []

        def ready() -> bool:
            nonlocal states
            self._raise_if_a_worker_exited()
            states = [w.state for w in list_workers(coordinator)]
            return states == ["ready"] * count

        try:
            wait_until(ready, f"{count} workers ready in {coordinator.name}", timeout)
        except TimeoutError as e:
            raise TimeoutError(f"{e}; its workers: {states}\n{self._worker_log_tails()}") from None

    def _raise_if_a_worker_exited(self) -> None:
        for proc in self.procs.values():
            if proc.role != "coordinator" and proc.popen.poll() is not None:
                raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.log.read_text()[-3000:]}")

    def _worker_log_tails(self) -> str:
        return "\n".join(f"--- {p.name} ({p.log}):\n{p.log.read_text()[-1500:]}"
                         for p in self.procs.values() if p.role != "coordinator")

    def wait_serving(self, proc: Proc, timeout: float = 120.0) -> None:
        def serving() -> bool:
            if proc.popen.poll() is not None:
                raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.log.read_text()[-3000:]}")
            from grpc_health.v1 import health_pb2, health_pb2_grpc

            try:
                with open_channel(proc.address, proc.tls) as ch:
                    reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
            except grpc.RpcError:
                return False
            return reply.status == health_pb2.HealthCheckResponse.SERVING or proc.role == "coordinator"

        wait_until(serving, f"{proc.name} serving", timeout)

    def kill(self, name: str) -> None:
        """kill -9."""
        proc = self.procs[name]
        os.kill(proc.popen.pid, signal.SIGKILL)
        proc.popen.wait()

    def terminate(self, name: str) -> None:
        os.kill(self.procs[name].popen.pid, signal.SIGTERM)

    def stop_all(self) -> None:
        # workers first (they drain and tell the coordinator), then the coordinators
        for proc in sorted(self.procs.values(), key=lambda p: p.role == "coordinator"):
            if proc.popen.poll() is None:
                proc.popen.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.popen.wait(15)
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait()


def wait_until(condition, what: str, timeout: float = 60.0, every: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(every)


def list_workers(coordinator: Proc) -> list[pb.WorkerStatus]:
    with open_channel(coordinator.address, coordinator.tls) as ch:
        return list(worker_pb2_grpc.RegistryStub(ch).ListWorkers(pb.ListWorkersRequest(), timeout=5,
                                                                 metadata=coordinator.internal).workers)


def state_of(coordinator: Proc, worker: Proc) -> str | None:
    return next((w.state for w in list_workers(coordinator) if w.address == worker.address), None)


def blocks(decode: Proc) -> tuple[int, int]:
    """(free, total) KV blocks of a live decode worker."""
    with open_channel(decode.address, decode.tls) as ch:
        load = worker_pb2_grpc.ControlStub(ch).GetInfo(pb.GetInfoRequest(), timeout=5, metadata=decode.internal).load
    return load.free_kv_blocks, load.total_kv_blocks


def wait_blocks_free(decodes: list[Proc], timeout: float = 15.0) -> list[tuple[int, int]]:
    deadline = time.monotonic() + timeout
    while True:
        pairs = [blocks(d) for d in decodes]
        if all(f == t for f, t in pairs) or time.monotonic() > deadline:
            return pairs
        time.sleep(0.1)


def request(ids: list[int], max_tokens: int, **sampling) -> gen_pb.GenerateRequest:
    return gen_pb.GenerateRequest(
        token_ids=gen_pb.TokenIds(ids=ids),
        sampling=gen_pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0, **sampling),
    )


def generate(address: str, req: gen_pb.GenerateRequest, timeout: float = 60.0, metadata=(),
             tls: TlsConfig | None = None) -> list[int]:
    """Every token id of a completed stream; raises grpc.RpcError."""
    with open_channel(address, tls) as ch:
        return [t for m in generation_pb2_grpc.GenerationStub(ch).Generate(req, timeout=timeout, metadata=metadata)
                for t in m.token_ids]


class Stream(threading.Thread):
    """One Generate call in a thread: `tokens` as they come, then `error` (a grpc.RpcError) or `finish_reason`."""

    def __init__(self, address: str, req: gen_pb.GenerateRequest, timeout: float = 120.0):
        super().__init__(daemon=True)
        self.address, self.req, self.timeout = address, req, timeout
        self.tokens: list[int] = []
        self.error: grpc.RpcError | None = None
        self.finish_reason = 0
        self.start()

    def run(self) -> None:
        try:
            with grpc.insecure_channel(self.address) as ch:
                for m in generation_pb2_grpc.GenerationStub(ch).Generate(self.req, timeout=self.timeout):
                    self.tokens.extend(m.token_ids)
                    self.finish_reason = m.finish_reason or self.finish_reason
        except grpc.RpcError as e:
            self.error = e


def greedy_at_once(address: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Each prompt's greedy tokens, every prompt streamed at once (a no-fault run, batched as the runs that a
    test then faults are); raises the first stream's grpc.RpcError."""
    streams = [Stream(address, request(p, max_tokens)) for p in prompts]
    for s in streams:
        s.join(120)
    for s in streams:
        if s.error is not None:
            raise s.error
        assert not s.is_alive(), "a no-fault stream still running after 120 s"
    return [s.tokens for s in streams]


def counter(samples: dict[str, float], name: str) -> float:
    """A counter's value summed over its labels (0 when absent)."""
    return sum(v for k, v in samples.items() if re.fullmatch(rf"{name}(\{{.*\}})?", k))


def spec_counters_agree(proc: Proc, model_name: str) -> tuple[dict[str, float], dict[str, float]]:
    """A speculating decode worker's counters: drafts were made and some accepted, per-position acceptance sums to
    the accepted tokens, and vLLM's names beside pdserve's carry the same values (with model_name and role).
    Returns (pdserve's samples, vLLM's spec_decode samples) for the caller's further checks."""
    d = proc.metrics()
    drafts = counter(d, "pdserve_spec_decode_num_drafts_total")
    proposed = counter(d, "pdserve_spec_decode_num_draft_tokens_total")
    accepted = counter(d, "pdserve_spec_decode_num_accepted_tokens_total")
    per_pos = counter(d, "pdserve_spec_decode_num_accepted_tokens_per_pos_total")
    assert drafts > 0 and proposed >= drafts and 0 < accepted <= proposed and per_pos == accepted
    vllm = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in proc.metrics_text().splitlines()
            if line.startswith("vllm:spec_decode")}
    own = f'model_name="{model_name}",role="decode"'
    assert vllm[f"vllm:spec_decode_num_drafts_total{{{own}}}"] == drafts
    assert vllm[f"vllm:spec_decode_num_accepted_tokens_total{{{own}}}"] == accepted
    return d, vllm
