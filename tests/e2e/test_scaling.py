"""Pools that grow and shrink under load: workers join a running coordinator and take traffic;
SIGTERM drains a worker (no new work, in-flight streams finish, exit 0); no request is lost."""

from __future__ import annotations

import subprocess
import sys
import threading

import grpc
import pytest

from tests.e2e.procs import Procs, Stream, counter, generate, list_workers, request, wait_blocks_free, wait_until


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    procs = Procs(tiny_model("llama"), tmp_path_factory.mktemp("scaling"))
    try:
        coordinator = procs.coordinator()
        procs.worker("p0", "prefill", coordinator, wait=False)
        procs.worker("d0", "decode", coordinator)
        wait_until(lambda: [w.state for w in list_workers(coordinator)] == ["ready", "ready"], "p0 and d0 ready")
        yield procs
    finally:
        procs.stop_all()


class Load:
    """Client threads sending requests back to back until stopped; every outcome is kept."""

    def __init__(self, address: str, clients: int = 3, max_tokens: int = 24):
        self.address, self.max_tokens = address, max_tokens
        self.sent = 0
        self.completed: list[list[int]] = []
        self.errors: list[grpc.RpcError] = []
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)]
        for t in self.threads:
            t.start()

    def _client(self, i: int) -> None:
        n = 0
        while not self.stop.is_set():
            prompt = [(i * 31 + n * 7 + j) % 500 + 3 for j in range(8 + n % 24)]
            n += 1
            with self.lock:
                self.sent += 1
            try:
                tokens = generate(self.address, request(prompt, self.max_tokens), timeout=60)
                with self.lock:
                    self.completed.append(tokens)
            except grpc.RpcError as e:
                with self.lock:
                    self.errors.append(e)

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(90)


def test_workers_join_take_traffic_and_drain_under_load_losing_nothing(cluster):
    p = cluster.procs
    coordinator = p["coordinator"]
    load = Load(coordinator.address)
    try:
        wait_until(lambda: len(load.completed) >= 3, "load running")
        # scale up both tiers while the load runs
        cluster.worker("d1", "decode", coordinator, wait=False)
        cluster.worker("p1", "prefill", coordinator, wait=False)
        wait_until(lambda: sorted(w.state for w in list_workers(coordinator)) == ["ready"] * 4, "4 workers ready")
        wait_until(lambda: counter(p["d1"].metrics(), "pdserve_kv_transfer_bytes_total") > 0, "d1 takes traffic")
        wait_until(lambda: counter(p["p1"].metrics(), "pdserve_prompt_tokens_total") > 0, "p1 takes traffic")

        # scale down: SIGTERM a decode worker while it streams, and a prefill worker
        long = Stream(coordinator.address, request([5, 6, 7], 300))
        wait_until(lambda: len(long.tokens) >= 2, "a long stream under way")
        cluster.terminate("d0")
        wait_until(lambda: {w.address: w.state for w in list_workers(coordinator)}[p["d0"].address] != "ready",
                   "d0 leaves the routable pool", every=0.02)
        status = subprocess.run([sys.executable, "-m", "pdserve.server.cli", "status", "--addr", coordinator.address],
                                capture_output=True, text=True, timeout=30)
        cluster.terminate("p0")
        assert p["d0"].popen.wait(60) == 0 and p["p0"].popen.wait(60) == 0
        long.join(60)
        done = len(load.completed)
        wait_until(lambda: len(load.completed) >= done + 3, "the load goes on after the scale-down")
    finally:
        load.finish()

    print(f"\nscale up/down under load: sent {load.sent + 1}, completed {len(load.completed) + (long.error is None)}, "
          f"errors {len(load.errors)}; lost {load.sent - len(load.completed) - len(load.errors)}")
    assert status.returncode == 0, status.stderr
    lines = status.stdout.splitlines()
    assert lines[0].split()[:3] == ["ROLE", "ADDRESS", "STATE"]
    row = next(line.split() for line in lines if p["d0"].address in line)
    assert row[0] == "decode" and row[2] in ("draining", "dead")
    assert sum(1 for line in lines[1:] if line.split()[2] == "ready") >= 3

    assert long.error is None and len(long.tokens) == 300  # the drained worker finished it
    assert load.errors == [] and len(load.completed) == load.sent
    assert all(len(tokens) == 24 for tokens in load.completed)
    recoveries = [line for line in coordinator.log.read_text().splitlines() if "retrying as attempt" in line]
    assert counter(coordinator.metrics(), "pdserve_migrations_total") == 0, "\n".join(recoveries)
    log = p["d0"].log.read_text()
    assert "decode worker draining" in log and "decode worker stopping" in log
    # whatever d0 still held at SIGTERM it finished (the short requests the coordinator saw on it may end
    # before the signal lands, so whether it had to wait at all is a race; never cutting work off is not)
    assert "stopping anyway" not in log
    free, total = wait_blocks_free([p["d1"]])[0]
    assert free == total
    wait_until(lambda: {w.address: w.state for w in list_workers(coordinator)}[p["d0"].address] == "dead",
               "d0 dead after exit")
    assert len(generate(coordinator.address, request([9, 9, 9], 5))) == 5


def test_a_worker_serving_another_model_is_refused_at_registration(cluster, tiny_model):
    coordinator = cluster.procs["coordinator"]
    stranger = cluster.start("d-other", "decode", "--coordinator", coordinator.address,
                             model_dir=tiny_model("qwen2"), metrics=False, wait=False)
    assert stranger.popen.wait(120) != 0
    log = stranger.log.read_text()
    assert "FAILED_PRECONDITION" in log or "refused" in log, log[-2000:]
    assert "every worker must serve the same checkpoint" in log, log[-2000:]
    assert stranger.address not in {w.address for w in list_workers(coordinator)}
