"""Two coordinator replicas share one pool of real workers (each worker registers with both).

d0 runs at most 2 requests and queues none (--max-running 2 --max-queue 0): it refuses whatever it cannot
hold, so two replicas routing to it at once race for its last slots.
"""

from __future__ import annotations

import grpc
import pytest

from tests.e2e.procs import Procs, Stream, counter, generate, list_workers, request, wait_blocks_free, wait_until

PROMPTS = [[(5 * i + 3 * j) % 400 + 7 for j in range(10 + i)] for i in range(6)]
TOKENS = 24


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    procs = Procs(tiny_model("llama"), tmp_path_factory.mktemp("replicas"))
    try:
        a, b = procs.coordinator("coord-a"), procs.coordinator("coord-b")
        both = f"{a.address},{b.address}"
        procs.start("p0", "prefill", "--coordinator", both, wait=False)
        procs.start("d0", "decode", "--coordinator", both, "--max-running", "2", "--max-queue", "0", wait=False)
        for name in ("p0", "d0"):
            procs.wait_serving(procs.procs[name])
        for c in (a, b):
            wait_until(lambda c=c: [w.state for w in list_workers(c)] == ["ready"] * 2, f"2 workers ready in {c.name}")
        yield procs
    finally:
        procs.stop_all()


@pytest.fixture(scope="module")
def reference(cluster):
    """Each prompt's greedy tokens, one request at a time."""
    return [generate(cluster.procs["coord-a"].address, request(p, TOKENS)) for p in PROMPTS]


def test_two_replicas_racing_for_the_last_slots_never_fail_a_client_or_over_commit(cluster, reference):
    p = cluster.procs
    a, b, d0 = p["coord-a"], p["coord-b"], p["d0"]
    # Six requests on each replica at once, for a worker that holds two: each replica sees d0's free
    # slots before the other's requests land there, so d0 refuses some and the replicas pick again.
    streams = [Stream(c.address, request(prompt, TOKENS)) for prompt in PROMPTS for c in (a, b)]
    for s in streams:
        s.join(120)
    assert [s.error for s in streams] == [None] * len(streams)
    assert [s.tokens for s in streams] == [ref for ref in reference for _ in (a, b)]
    refusals = counter(a.metrics(), "pdserve_decode_refusals_total") + counter(b.metrics(), "pdserve_decode_refusals_total")
    assert refusals > 0  # the race happened, and cost no client anything
    for c in (a, b):
        assert counter(c.metrics(), "pdserve_request_failure_total") == 0
    free, total = wait_blocks_free([d0])[0]
    assert free == total


def test_kill_9_one_replica_under_load_its_clients_get_unavailable_the_others_finish(cluster, reference):
    p = cluster.procs
    a, b, d0 = p["coord-a"], p["coord-b"], p["d0"]
    long = 300
    on_a = Stream(a.address, request(PROMPTS[0], long))
    on_b = Stream(b.address, request(PROMPTS[1], long))
    wait_until(lambda: on_a.tokens and on_b.tokens, "both streams under way", every=0.02)
    cluster.kill("coord-a")
    on_a.join(60)
    on_b.join(120)
    assert on_a.error is not None and on_a.error.code() == grpc.StatusCode.UNAVAILABLE
    assert on_b.error is None and len(on_b.tokens) == long
    assert on_b.tokens[:TOKENS] == reference[1]
    # the workers keep serving the surviving replica; the dead one's stream freed its blocks
    free, total = wait_blocks_free([d0])[0]
    assert free == total
    assert generate(b.address, request(PROMPTS[2], TOKENS)) == reference[2]
    assert [w.state for w in list_workers(b)] == ["ready", "ready"]
