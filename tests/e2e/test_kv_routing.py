"""`pdserve up --kv-events-config` with 1 prefill and 2 decode workers: the coordinator's KV index reads the events
the workers advertise, and a prompt that shares a served prompt's prefix goes to the decode worker holding it
(reason kv-index) although the rendezvous hash picks the other; a coordinator started later reads the same view
through the workers' replay endpoints and routes alike."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request

import msgspec
import zmq
from prometheus_client.parser import text_string_to_metric_families

from pdserve.kvcache.kv_events import KVEventBatch
from pdserve.server.coordinator.policies import _rank, route_key
from pdserve.server.coordinator.worker_pool import Worker
from pdserve.server.launcher import free_port, wait_serving, Cluster, Proc

from tests.e2e.cluster import pdserve_up, worker_info
from tests.e2e.procs import generate, request
from tests.kvcache.kv_events_helpers import chain, wire

CONFIG = {"enable_kv_cache_events": True, "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0",
          "topic": "kv@{worker}@tiny"}


class Reader:
    """A SUB socket connected to every decode worker's advertised endpoint, on a thread: the blocks each stored."""

    def __init__(self, endpoints: dict[bytes, str]) -> None:
        self.sub = zmq.Context.instance().socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        for endpoint in endpoints.values():
            self.sub.connect(endpoint)
        self.stored: dict[bytes, list[int]] = {topic: [] for topic in endpoints}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        while not self._stop.is_set():
            if self.sub.poll(50):
                topic, _, payload = self.sub.recv_multipart()
                for event in decoder.decode(payload).events:
                    if type(event).__name__ == "BlockStored":
                        self.stored[topic] += event.block_hashes

    def holder(self, hashes: list[int], timeout: float = 30.0) -> bytes:
        """The topic that stored all of `hashes`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for topic, stored in self.stored.items():
                if all(h in stored for h in hashes):
                    return topic
            time.sleep(0.05)
        raise AssertionError(f"no decode worker stored {hashes}: {self.stored}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sub.close(linger=0)


def _metrics(address: str) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "role")))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _decisions(metrics: dict, reason: str) -> float:
    return metrics.get(("pdserve_routing_decisions_total", (("reason", reason), ("tier", "decode"))), 0.0)


def _until(check, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _extension(prefix: list[int], decode: list[str], guess: str, seed: int) -> list[int]:
    """`prefix` (2 full blocks) + 3 more blocks and 8 tokens, such that the rendezvous hash of the first 4 blocks
    (the prefix-aware policy's guess without the KV index) picks `guess` among the decode workers."""
    workers = [Worker(a, "decode") for a in decode]
    for k in range(seed, seed + 1000):
        prompt = prefix + [(13 * i + k) % 250 + 20 for i in range(56)]
        key = route_key(prompt, 16)
        if max(workers, key=lambda w: _rank(key, w)).address == guess:
            return prompt
    raise AssertionError("no such prompt")


def test_kv_index_routes_to_the_holder_and_a_late_coordinator_converges(tiny_model, tmp_path):
    model = tiny_model("llama")
    with pdserve_up(model, tmp_path, prefill_workers=1, decode_workers=2,
                    extra_args=["--kv-events-config", json.dumps(CONFIG)]) as state:
        sources = {a: worker_info(a).kv_events for a in state["decode"]}
        topics = {s.topic.encode(): a for a, s in sources.items()}
        assert all(s.endpoint.startswith("tcp://127.0.0.1:") and s.replay_endpoint for s in sources.values())
        reader = Reader({s.topic.encode(): s.endpoint for s in sources.values()})
        late = None
        try:
            time.sleep(0.5)  # the reader's subscriptions reach the workers
            first = [(7 * i) % 300 + 3 for i in range(40)]  # 2 full blocks of 16
            assert generate(state["coordinator"], request(first, 4))
            holder = topics[reader.holder([wire(h) for h in chain(first, 16)[:2]])]
            other = next(a for a in state["decode"] if a != holder)
            coordinator_metrics = state["metrics"]["coordinator"]
            before = _decisions(_metrics(coordinator_metrics), "kv-index")

            second = _extension(first[:32], state["decode"], guess=other, seed=0)  # rendezvous: `other`
            time.sleep(0.5)  # the coordinator's index reads the first prompt's events (milliseconds)
            assert generate(state["coordinator"], request(second, 4))
            new = [wire(h) for h in chain(second, 16)[2:5]]
            assert topics[reader.holder(new)] == holder  # served where its first 2 blocks were
            assert not any(h in reader.stored[sources[other].topic.encode()] for h in new)
            assert _decisions(_metrics(coordinator_metrics), "kv-index") == before + 1

            # a second coordinator, started now, knows what the workers hold through their replay endpoints
            port, metrics_port = free_port("127.0.0.1"), free_port("127.0.0.1")
            log = open(tmp_path / "late.log", "w")
            workers = [a for p in state["prefill"] for a in ("--prefill", p)]
            workers += [a for d in state["decode"] for a in ("--decode", d)]
            late = subprocess.Popen(
                [sys.executable, "-m", "pdserve.server.cli", "coordinator", "--model", str(model), *workers,
                 "--port", str(port), "--metrics-port", str(metrics_port),
                 "--cluster-secret-file", str(tmp_path / "cluster-secret")],
                stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PDSERVE_LOG_LEVEL="INFO"))
            late_address = f"127.0.0.1:{port}"
            wait_serving(Cluster(), [Proc("late", late_address, late, [], {})], 120)
            late_metrics = f"127.0.0.1:{metrics_port}"
            _until(lambda: _metrics(late_metrics).get(("pdserve_kv_index_workers", (("state", "live"),))) == 3,
                   "the late coordinator's views of the 3 workers")
            assert _metrics(late_metrics)[("pdserve_kv_index_blocks", ())] >= 5 + 2  # the decode holder's and P's
            third = _extension(first[:32], state["decode"], guess=other, seed=2000)
            assert generate(late_address, request(third, 4))
            assert topics[reader.holder([wire(h) for h in chain(third, 16)[2:5]])] == holder
            assert _decisions(_metrics(late_metrics), "kv-index") == 1
        finally:
            reader.close()
            if late is not None:
                late.terminate()
                late.wait(30)
