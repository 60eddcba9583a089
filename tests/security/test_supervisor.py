"""`pdserve up` supervises: kill -9 of any one worker under load loses no stream (every stream
completes with the no-fault run's tokens) and the worker is started again, counted and logged; its
`--metrics-port` serves every process's series labelled by process, the dead one's left out until it is back."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from pdserve.server.launcher import free_port
from tests.e2e.procs import Stream, generate, greedy_at_once, request, wait_until
from tests.security.test_attacks import PROMPTS

MAX_TOKENS = 300


@pytest.fixture(scope="module")
def up(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("up")
    state = tmp / "state.json"
    metrics_port, http_port = free_port(), free_port()
    log = open(tmp / "up.log", "w")
    cmd = [sys.executable, "-m", "pdserve.server.cli", "up", "--model", str(tiny_model("llama")), "--port", "0",
           "--prefill-workers", "1", "--decode-workers", "2", "--state-file", str(state), "--stall-timeout", "5",
           "--metrics-port", str(metrics_port), "--http-port", str(http_port)]
    # (the environment carries the tests' compilation cache, tests/conftest.py)
    popen = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: state.exists() or popen.poll() is not None, "pdserve up started", timeout=180)
        assert popen.poll() is None, (tmp / "up.log").read_text()[-3000:]
        yield popen, state, tmp / "up.log", metrics_port, http_port
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


def _scrape(address: str) -> str:
    return urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()


def _samples(text: str, name: str) -> dict[str, float]:
    """The `worker` label of each sample called `name` -> its value."""
    return {s.labels.get("worker", ""): s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == name}


def _up(metrics_port: int) -> dict[str, float]:
    return _samples(_scrape(f"127.0.0.1:{metrics_port}"), "pdserve_worker_up")


def test_every_process_series_on_the_supervisors_metrics_labelled_by_process(up):
    _, state_file, log, metrics_port, http_port = up
    state = json.loads(state_file.read_text())
    names = ["prefill-0", "decode-0", "decode-1", "coordinator"]
    assert sorted(state["metrics"]) == sorted(names)
    for name in names:  # each process's own /metrics, where the state file says, is local and scrapable
        assert state["metrics"][name].startswith("127.0.0.1:")
        assert f'role="{name.partition("-")[0]}"' in _scrape(state["metrics"][name])
    assert "each process's own Prometheus metrics: prefill-0 http://" in log.read_text()
    wait_until(lambda: _serving(state["coordinator"]), "the coordinator serving")
    assert len(generate(state["coordinator"], request(PROMPTS[0], 8))) == 8
    wait_until(lambda: _up(metrics_port) == dict.fromkeys(names, 1.0), "every process scraped", timeout=60)
    text = _scrape(f"127.0.0.1:{metrics_port}")
    types = [line for line in text.splitlines() if line.startswith("# TYPE ")]
    assert len(types) == len(set(types)) and len({t.split()[2] for t in types}) == len(types)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    # the decode workers' KV usage, read from their block pools (every process has the gauge: 0 off decode)
    usage = {s.labels["worker"] for s in families["vllm:kv_cache_usage_perc"].samples if s.labels["role"] == "decode"}
    assert sorted(usage) == ["decode-0", "decode-1"]
    blocks = {s.labels["worker"]: s.value for s in families["pdserve_kv_blocks_total"].samples if s.value > 0}
    assert sorted(blocks) == ["decode-0", "decode-1"]
    computed = {s.labels["worker"]: s.value for s in families["pdserve_prefill_computed_tokens"].samples if s.value}
    assert sorted(computed) == ["prefill-0"]  # the request's prompt, computed there
    engines = {s.labels["worker"]: s.labels["engine"] for f in families.values() for s in f.samples
               if "worker" in s.labels}
    assert engines == {"prefill-0": "0", "decode-0": "1", "decode-1": "2", "coordinator": "3"}
    assert _samples(text, "vllm:e2e_request_latency_seconds_count")["coordinator"] >= 1
    # the supervisor adds no zeros of its own beside them (its restarts count appears when one happens)
    assert [s for f in families.values() for s in f.samples if s.labels.get("role") == "supervisor"] == []
    # the coordinator's HTTP /metrics (where vLLM's users point Prometheus): its own series and every worker's
    front = _scrape(f"127.0.0.1:{http_port}")
    assert _samples(front, "pdserve_worker_up") == {"prefill-0": 1.0, "decode-0": 1.0, "decode-1": 1.0}
    blocks = {k: v for k, v in _samples(front, "pdserve_kv_blocks_total").items() if v > 0}
    assert sorted(blocks) == ["decode-0", "decode-1"]
    assert _samples(front, "vllm:e2e_request_latency_seconds_count")[""] >= 1  # its own, unlabelled
    engines = {s.labels["worker"]: s.labels["engine"] for f in text_string_to_metric_families(front)
               for s in f.samples if "worker" in s.labels}
    assert engines == {"prefill-0": "0", "decode-0": "1", "decode-1": "2"}  # as the supervisor numbers them


@pytest.fixture(scope="module")
def reference(up) -> list[list[int]]:
    """The no-fault tokens of PROMPTS (before any worker is killed)."""
    address = json.loads(up[1].read_text())["coordinator"]
    wait_until(lambda: _serving(address), "the coordinator serving")
    return greedy_at_once(address, PROMPTS, MAX_TOKENS)


@pytest.mark.parametrize("victim", ["decode-0", "prefill-0"])
def test_kill_9_of_one_worker_under_load_loses_no_stream(up, reference, victim):
    popen, state_file, log, metrics_port, _ = up
    state = json.loads(state_file.read_text())
    restarts = state["restarts"]
    address = state["coordinator"]
    wait_until(lambda: _serving(address), "the coordinator serving")
    streams = [Stream(address, request(p, MAX_TOKENS)) for p in PROMPTS]
    wait_until(lambda: all(s.tokens for s in streams), "every stream's first tokens", every=0.01)
    old_pid = state["pids"][victim]
    os.kill(old_pid, signal.SIGKILL)
    # the dead one is left out of the merged /metrics (reported down); a restart takes seconds to serve again
    down = _scrape(f"127.0.0.1:{metrics_port}")
    assert _samples(down, "pdserve_worker_up")[victim] == 0.0 and victim not in _samples(down, "vllm:num_requests_running")
    assert len(_samples(down, "vllm:num_requests_running")) == 3
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
    # every series names the served model, and this one the role it counts
    assert re.search(rf'pdserve_worker_restarts_total{{model_name="[^"]+",role="{role}"}} 1.0', metrics), metrics
    worker = state[role][int(victim.rpartition("-")[2])]
    wait_until(lambda: _serving(worker), f"{victim} serving again", timeout=180)
    assert popen.poll() is None
    assert f"{victim} (pid {old_pid}) exited with code -9; restarting it" in log.read_text()
    wait_until(lambda: _up(metrics_port)[victim] == 1.0, f"{victim}'s metrics back", timeout=60)
