"""`pdserve up` supervises: kill -9 of any one worker under load loses no stream (every stream
completes with the no-fault run's tokens) and the worker is started again, counted and logged."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.server.launcher import free_port
from tests.e2e.procs import Stream, generate, request, wait_until
from tests.security.test_attacks import PROMPTS

MAX_TOKENS = 300


@pytest.fixture(scope="module")
def up(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("up")
    state = tmp / "state.json"
    metrics_port = free_port()
    log = open(tmp / "up.log", "w")
    cmd = [sys.executable, "-m", "pdserve.server.cli", "up", "--model", str(tiny_model("llama")), "--port", "0",
           "--prefill-workers", "1", "--decode-workers", "2", "--state-file", str(state), "--stall-timeout", "5",
           "--metrics-port", str(metrics_port)]
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(tmp.parent / "jax-cache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    popen = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        wait_until(lambda: state.exists() or popen.poll() is not None, "pdserve up started", timeout=180)
        assert popen.poll() is None, (tmp / "up.log").read_text()[-3000:]
        yield popen, state, tmp / "up.log", metrics_port
    finally:
        popen.send_signal(signal.SIGTERM)
        try:
            assert popen.wait(60) == 0
        finally:
            if popen.poll() is None:
                popen.kill()
        log.close()


def _serving(address: str) -> bool:
    try:
        with grpc.insecure_channel(address) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
    except grpc.RpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("victim", ["decode-0", "prefill-0"])
def test_kill_9_of_one_worker_under_load_loses_no_stream(up, victim):
    popen, state_file, log, metrics_port = up
    state = json.loads(state_file.read_text())
    restarts = state["restarts"]
    address = state["coordinator"]
    wait_until(lambda: _serving(address), "the coordinator serving")
    reference = [generate(address, request(p, MAX_TOKENS)) for p in PROMPTS]
    streams = [Stream(address, request(p, MAX_TOKENS)) for p in PROMPTS]
    wait_until(lambda: all(s.tokens for s in streams), "every stream's first tokens", every=0.01)
    old_pid = state["pids"][victim]
    os.kill(old_pid, signal.SIGKILL)
    more = [Stream(address, request(p, MAX_TOKENS)) for p in PROMPTS]  # sent while it is down
    for s in [*streams, *more]:
        s.join(180)
    assert [s.error for s in [*streams, *more]] == [None] * 8
    assert [s.tokens for s in streams] == reference and [s.tokens for s in more] == reference
    # the worker comes back: a new process on the same address, counted; the others kept running
    wait_until(lambda: json.loads(state_file.read_text())["restarts"][victim] == restarts[victim] + 1,
               f"{victim} restarted", timeout=60)
    state = json.loads(state_file.read_text())
    assert state["pids"][victim] != old_pid
    assert state["restarts"] == {**restarts, victim: restarts[victim] + 1}
    role = victim.partition("-")[0]
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    assert f'pdserve_worker_restarts_total{{role="{role}"}} 1.0' in metrics
    worker = state[role][int(victim.rpartition("-")[2])]
    wait_until(lambda: _serving(worker), f"{victim} serving again", timeout=180)
    assert popen.poll() is None
    assert f"{victim} (pid {old_pid}) exited with code -9; restarting it" in log.read_text()
