"""The cpu overlay's containers, run here: the same argv, with only addresses and the model path local.

Each Deployment's container command (after kubelet's $(VAR) expansion) is started as a process on
127.0.0.1: the workers register with the coordinator the way the pods do, one generation goes through,
and each tier's /metrics serves the series its HorizontalPodAutoscaler scales on.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.server.launcher import free_port
from tests.deploy.manifests import KUSTOMIZATIONS, POD_IP, by_kind, option, processes, render

LOCAL = "127.0.0.1"


def localize(argv: list[str], ports: dict[int, int], registry: str, model: str) -> list[str]:
    """argv with the pod's addresses and model path replaced by local ones; every flag kept."""
    out = []
    for arg in argv:
        flag, sep, value = arg.partition("=")
        if sep and flag == "--host":
            value = LOCAL
        elif sep and flag in ("--port", "--http-port", "--metrics-port", "--kv-port"):
            value = str(ports[int(value)])
        elif sep and flag == "--advertise-address":
            ip, port = value.rsplit(":", 1)
            assert ip == POD_IP
            value = f"{LOCAL}:{ports[int(port)]}"
        elif sep and flag == "--coordinator":
            value = registry
        elif sep and flag == "--model":
            value = model
        out.append(f"{flag}={value}" if sep else arg)
    return out


def health(address: str) -> str:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
        except grpc.RpcError as e:
            return e.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def scrape(port: int) -> set[str]:
    text = urllib.request.urlopen(f"http://{LOCAL}:{port}/metrics", timeout=5).read().decode()
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    objects = render(KUSTOMIZATIONS["cpu"])
    procs = {p.deployment: p for p in processes(objects)}
    logs = tmp_path_factory.mktemp("local-run")
    # One local port for each (tier, container port): the pods all use 9090 for metrics.
    started, layout = {}, {}
    env = {**os.environ, "PDSERVE_LOG_LEVEL": "WARNING", "JAX_PLATFORMS": "cpu"}
    coordinator_port = free_port()
    order = ["pdserve-coordinator", "pdserve-decode", "pdserve-prefill"]
    try:
        for name in order:
            ports = {int(option(procs[name].argv, f)): free_port()
                     for f in ("--port", "--http-port", "--metrics-port", "--kv-port")
                     if option(procs[name].argv, f) is not None}
            if name == "pdserve-coordinator":
                ports[50051] = coordinator_port
            argv = localize(procs[name].argv, ports, f"{LOCAL}:{coordinator_port}", str(tiny_model("llama")))
            assert argv[0] == "pdserve"
            cmd = [sys.executable, "-m", "pdserve.server.cli", *argv[1:]]
            log = open(logs / f"{name}.log", "w")
            started[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            layout[name] = {"argv": argv, "ports": ports}
        address = f"{LOCAL}:{coordinator_port}"
        deadline = time.monotonic() + 240
        # Every process SERVING (the coordinator alone may be ready before prefill: decode can prefill).
        addresses = [f"{LOCAL}:{option(layout[n]['argv'], '--port')}" for n in order]
        while any(health(a) != "SERVING" for a in addresses):
            dead = [n for n, p in started.items() if p.poll() is not None]
            assert not dead, f"{dead} exited: " + "".join((logs / f"{n}.log").read_text()[-3000:] for n in dead)
            assert time.monotonic() < deadline, "not every process reported SERVING"
            time.sleep(0.5)
        yield {"address": address, "layout": layout, "objects": objects}
    finally:
        for p in started.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in started.values():
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def test_a_generation_goes_through(cluster):
    out = subprocess.run(
        [sys.executable, "-m", "pdserve.server.cli", "generate", "--addr", cluster["address"], "--token-ids", "1,2,3",
         "--max-tokens", "8", "--temperature", "0", "--ignore-eos", "--json"],
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    events = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    tokens = [t for e in events for t in e.get("token_ids", [])]
    assert len(tokens) == 8, events


def test_each_tier_exports_what_its_autoscaler_reads(cluster):
    hpas = {h["spec"]["scaleTargetRef"]["name"]: [m["pods"]["metric"]["name"] for m in h["spec"]["metrics"]]
            for h in by_kind(cluster["objects"], "HorizontalPodAutoscaler")}
    for deployment, metrics in hpas.items():
        layout = cluster["layout"][deployment]
        try:
            exported = scrape(int(option(layout["argv"], "--metrics-port")))
        except OSError as e:
            raise AssertionError(f"{deployment}: no /metrics on {layout['argv']}: {e}") from e
        assert set(metrics) <= exported, (deployment, set(metrics) - exported)
