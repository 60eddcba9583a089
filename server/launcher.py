"""`pdserve up`: a coordinator and its workers as separate OS processes on one host, kept alive.

`launch` starts the workers, waits until they serve, then the coordinator. `Supervisor.poll` (the
`pdserve up` loop) starts a process that died again, on its own port with its own command, after a
backoff that doubles while it keeps dying young; the others keep serving meanwhile, and the
coordinator's retries and migration carry the requests a dead worker held.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.server.cluster_metrics import Target

log = logging.getLogger("pdserve.launcher")


_handed_out: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, for a process this one is about to start.

    Port 0's choice comes from the kernel's ephemeral range, where outgoing connections (every gRPC channel of
    the processes already running) take their local ports too, and it may return the same port twice in a row:
    a worker started a moment later could find its port taken and exit. So the port is drawn at random below that
    range, never twice from one process, and checked free by binding it; port 0 is the fallback."""
    low = _ephemeral_low()
    draw = random.SystemRandom()
    for _ in range(200):
        port = draw.randrange(10_000, low) if low > 11_000 else 0
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


@dataclass
class Proc:
    name: str
    address: str
    popen: subprocess.Popen
    cmd: list[str] = field(default_factory=list)
    """What started it (a restart runs it again)."""
    env: dict[str, str] = field(default_factory=dict)
    started_at: float = field(default_factory=time.monotonic)
    restarts: int = 0
    metrics_address: str | None = None
    """host:port of its own Prometheus /metrics, when it serves one (`launch(metrics=True)`)."""

    @property
    def role(self) -> str:
        return self.name.partition("-")[0]


@dataclass
class Cluster:
    coordinator: Proc | None = None
    prefill: list[Proc] = field(default_factory=list)
    decode: list[Proc] = field(default_factory=list)
    replicas: list[Proc] = field(default_factory=list)
    """Coordinator processes beside `coordinator`, on the same port (SO_REUSEPORT), over the same workers."""

    @property
    def procs(self) -> list[Proc]:
        return [*self.prefill, *self.decode, *([self.coordinator] if self.coordinator else []), *self.replicas]

    def describe(self) -> dict:
        return {
            "coordinator": self.coordinator.address if self.coordinator else None,
            "coordinators": 1 + len(self.replicas) if self.coordinator else 0,
            "prefill": [p.address for p in self.prefill],
            "decode": [p.address for p in self.decode],
            "pids": {p.name: p.popen.pid for p in self.procs},
            "restarts": {p.name: p.restarts for p in self.procs},
            "metrics": {p.name: p.metrics_address for p in self.procs if p.metrics_address},
        }

    def metrics_targets(self) -> list[Target]:
        """Each process serving /metrics, `engine` its index in `procs` (stable: a restart keeps its place)."""
        return [Target(p.name, i, p.role, p.metrics_address, alive=p.popen.poll() is None)
                for i, p in enumerate(self.procs) if p.metrics_address]

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM every process (coordinator first), then SIGKILL what is left."""
        for p in reversed(self.procs):
            if p.popen.poll() is None:
                p.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.popen.kill()
                p.popen.wait()

    def failed(self) -> Proc | None:
        return next((p for p in self.procs if p.popen.poll() is not None), None)


def kv_events_args(args: list[str], index: int) -> list[str]:
    """A worker's flags with its own KV event ports: --kv-events-config's endpoints offset by the worker's index
    (decode workers 0.., then the prefill workers), as vLLM offsets them by data-parallel rank."""
    if "--kv-events-config" not in args:
        return list(args)
    from pdserve.kvcache.kv_events_config import parse_kv_events_config

    at = args.index("--kv-events-config") + 1
    config = parse_kv_events_config(args[at])
    return [*args[:at], config.for_worker(index).to_json(), *args[at + 1 :]]


def offloading_args(args: list[str], name: str) -> list[str]:
    """A worker's flags with a disk tier of its own: --kv-offloading-disk-path's directory joined with the worker's
    name (the shared path stays as given: every worker reads and writes it)."""
    if "--kv-offloading-disk-path" not in args:
        return list(args)
    at = args.index("--kv-offloading-disk-path") + 1
    return [*args[:at], str(Path(args[at]) / name), *args[at + 1 :]]


def _spawn(name: str, args: list[str], port: int, host: str, python: str = sys.executable,
           cpus: set[int] | None = None, metrics: bool = False) -> Proc:
    """cpus: the cores the process (every thread it starts) may run on; None: any. metrics: it serves its
    /metrics on a free port of `host` (kept across restarts)."""
    cmd = [python, "-m", "pdserve.server.cli", *args, "--port", str(port), "--host", host]
    metrics_address = None
    if metrics:
        metrics_port = free_port(host)
        cmd += ["--metrics-port", str(metrics_port)]
        metrics_address = f"{host}:{metrics_port}"
    env = dict(os.environ, PDSERVE_PROCESS=name)
    pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    return Proc(name, f"{host}:{port}", subprocess.Popen(cmd, env=env, preexec_fn=pin), cmd, env,
                metrics_address=metrics_address)


class Supervisor:
    """Restarts the cluster's processes that die (with backoff), counting each restart and logging it.

    A process that ran `stable_seconds` before dying is restarted after `min_backoff`; one that dies
    sooner waits twice its previous backoff, up to `max_backoff`."""

    def __init__(self, cluster: Cluster, *, min_backoff: float = 0.5, max_backoff: float = 30.0,
                 stable_seconds: float = 30.0):
        self.cluster = cluster
        self.min_backoff = min_backoff
        self.max_backoff = max_backoff
        self.stable_seconds = stable_seconds
        self._backoff: dict[str, float] = {}
        self._restart_at: dict[str, float] = {}

    def poll(self) -> None:
        """Notices dead processes and restarts those whose backoff has passed (call it every ~0.5 s)."""
        from pdserve.server import metrics

        now = time.monotonic()
        for p in self.cluster.procs:
            if p.popen.poll() is None:
                continue
            if p.name not in self._restart_at:
                young = now - p.started_at < self.stable_seconds
                previous = self._backoff.get(p.name, 0.0)
                backoff = min(self.max_backoff, previous * 2) if young and previous else self.min_backoff
                self._backoff[p.name] = backoff
                self._restart_at[p.name] = now + backoff
                log.warning("%s (pid %d) exited with code %s; restarting it in %.1f s", p.name, p.popen.pid,
                            p.popen.returncode, backoff)
            elif now >= self._restart_at[p.name]:
                del self._restart_at[p.name]
                p.popen = subprocess.Popen(p.cmd, env=p.env)
                p.started_at = now
                p.restarts += 1
                metrics.worker_restarts.labels(p.role).inc()
                log.warning("%s restarted as pid %d (restart %d)", p.name, p.popen.pid, p.restarts)


def wait_serving(cluster: Cluster, procs: list[Proc], timeout: float) -> None:
    """Blocks until every process answers SERVING on grpc.health.v1; fails fast if one dies."""
    deadline = time.monotonic() + timeout
    pending = list(procs)
    while pending:
        dead = cluster.failed()
        if dead is not None:
            raise RuntimeError(f"{dead.name} exited with code {dead.popen.returncode} during start-up; "
                               f"its log above says why")
        if time.monotonic() > deadline:
            names = ", ".join(p.name for p in pending)
            raise TimeoutError(f"{names} not serving after {timeout:.0f} s; check the logs above")
        proc = pending[0]
        try:
            with grpc.insecure_channel(proc.address) as ch:
                reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1.0)
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                pending.pop(0)
                continue
        except grpc.RpcError:
            pass
        time.sleep(0.2)


def launch(model_dir: Path, *, prefill_workers: int, decode_workers: int, port: int, host: str,
           prefill_args: list[str] = (), decode_args: list[str] = (), coordinator_args: list[str] = (),
           common_args: list[str] = (), timeout: float = 600.0, decode_python: str = sys.executable,
           coordinators: int = 1, cpus: dict[str, set[int]] | None = None, metrics: bool = False) -> Cluster:
    """common_args: flags every process gets (the cluster secret, TLS); decode_python: the interpreter of
    the decode workers (one with vLLM for `--engine vllm`); coordinators: that many coordinator processes
    share the public ports (SO_REUSEPORT: the kernel spreads connections over them), each routing over
    every worker with its own view of the load. cpus: the cores each role's processes are pinned to
    ("prefill", "decode", "coordinator"; `plan validate --pin`), a role not named floats. metrics: every
    process serves its own /metrics on a free port of `host` (`Proc.metrics_address`)."""
    cpus = cpus or {}
    cluster = Cluster()
    prefill_args, decode_args = [*prefill_args, *common_args], [*decode_args, *common_args]
    coordinator_args = [*coordinator_args, *common_args]
    try:
        for i in range(prefill_workers):
            own = offloading_args(kv_events_args(prefill_args, decode_workers + i), f"prefill-{i}")
            cluster.prefill.append(_spawn(f"prefill-{i}", ["prefill", "--model", str(model_dir), *own],
                                          free_port(host), host, cpus=cpus.get("prefill"), metrics=metrics))
        # Workers on one host share its cores: torch's intra-op threads spin-wait, and two processes
        # each running as many threads as there are cores slow decode by 10-100x (benchmarks/README).
        if "--threads" not in decode_args:
            share = max(1, (os.cpu_count() or 1) // max(1, prefill_workers + decode_workers))
            decode_args = [*decode_args, "--threads", str(share)]
        for i in range(decode_workers):
            own = offloading_args(kv_events_args(decode_args, i), f"decode-{i}")
            cluster.decode.append(_spawn(f"decode-{i}", ["decode", "--model", str(model_dir), *own],
                                         free_port(host), host, decode_python, cpus.get("decode"), metrics))
        wait_serving(cluster, cluster.procs, timeout)
        workers = [a for p in cluster.prefill for a in ("--prefill", p.address)]
        workers += [a for p in cluster.decode for a in ("--decode", p.address)]
        # the HTTP front's /metrics serves the workers' series too, numbered as metrics_targets numbers them
        workers += [a for p in cluster.procs if p.metrics_address for a in ("--worker-metrics",
                                                                             f"{p.name}={p.metrics_address}")]
        if coordinators == 1:
            cluster.coordinator = _spawn("coordinator", ["coordinator", "--model", str(model_dir), *workers,
                                                         *coordinator_args], port or free_port(host), host,
                                  cpus=cpus.get("coordinator"), metrics=metrics)
            wait_serving(cluster, [cluster.coordinator], timeout)
            return cluster
        # Several share the public port; each also serves its registry on a port of its own, which
        # tells them apart (a health check there reaches that one process).
        port, own = port or free_port(host), []
        for i in range(coordinators):
            registry = free_port(host)
            proc = _spawn("coordinator" if i == 0 else f"coordinator-{i}",
                          ["coordinator", "--model", str(model_dir), *workers, *coordinator_args, "--reuse-port",
                           "--registry-port", str(registry)], port, host, cpus=cpus.get("coordinator"),
                          metrics=metrics)
            cluster.replicas.append(proc)
            own.append(Proc(proc.name, f"{host}:{registry}", proc.popen))
        cluster.coordinator = cluster.replicas.pop(0)
        wait_serving(cluster, own, timeout)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def write_state(cluster: Cluster, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(cluster.describe(), indent=2))
    tmp.replace(path)
