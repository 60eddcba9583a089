"""Eight seconds of mixed traffic from several clients (streams, seeded sampling, stop strings, cancels,
bad input, tiny deadlines; `benchmarks/load/soak.py`, which runs it for as long as asked): every request is
accounted for, and every KV block comes back. PDSERVE_SOAK_SECONDS=600 runs it longer here.

Each client's kinds of request follow its seed (not the timing): within the first three of clients 0 and 2 come
a completed, a cancelled and an invalid one, so the outcomes checked below occur in a short run too."""

from __future__ import annotations

import os

import pytest

from pdserve.benchmarks.load.soak import run_soak
from tests.e2e.procs import Procs, counter, list_workers, wait_blocks_free, wait_until

SECONDS = float(os.environ.get("PDSERVE_SOAK_SECONDS", "8"))
CLIENTS = 4


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    procs = Procs(tiny_model("llama"), tmp_path_factory.mktemp("soak"))
    try:
        coordinator = procs.coordinator()
        for name, role in (("p0", "prefill"), ("d0", "decode"), ("d1", "decode")):
            procs.worker(name, role, coordinator, wait=False)
        procs.wait_ready(coordinator, 3)
        yield procs
    finally:
        procs.stop_all()


def test_soak_every_request_accounted_for_and_every_block_back(cluster):
    p = cluster.procs
    coordinator = p["coordinator"]
    result = run_soak(coordinator.address, SECONDS, CLIENTS)
    print(result.summary(SECONDS, CLIENTS))
    outcomes = result.outcomes

    assert result.failures == []
    assert sum(outcomes.values()) == result.sent  # lost = 0
    assert outcomes["completed"] > 0 and outcomes["cancelled"] > 0 and outcomes["invalid"] > 0
    pairs = wait_blocks_free([p["d0"], p["d1"]], timeout=30)
    assert all(free == total for free, total in pairs), pairs
    wait_until(lambda: all(w.inflight == 0 for w in list_workers(coordinator)), "no request left in flight")
    # the coordinator counted every request that reached it once (a tiny deadline may expire before that)
    metrics = coordinator.metrics()
    served = counter(metrics, "pdserve_request_success_total") + counter(metrics, "pdserve_request_failure_total")
    assert result.sent - outcomes["deadline_exceeded"] <= served <= result.sent
