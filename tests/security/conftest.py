"""One cluster for the adversarial suite: real processes on 127.0.0.1 with a cluster secret, a
coordinator (gRPC, KServe, OpenAI HTTP; --stall-timeout 3), one prefill and two decode workers."""

from __future__ import annotations

import pytest

from pdserve.server.launcher import free_port
from pdserve.server.security import CLUSTER_SECRET_HEADER
from tests.e2e.procs import Procs

SECRET = "test-cluster-secret-0123456789abcdef"
INTERNAL = ((CLUSTER_SECRET_HEADER, SECRET),)
STALL_TIMEOUT = 3.0


@pytest.fixture(scope="package")
def secured(tiny_model, tmp_path_factory):
    procs = Procs(tiny_model("llama"), tmp_path_factory.mktemp("secured"), cluster_secret=SECRET)
    procs.http_port = free_port()
    try:
        # heartbeats may lapse for longer than the stall timeout: a frozen worker's streams then migrate by the
        # stall path test_stall.py counts, never first by its missed heartbeats (Procs' default: 2 s)
        coordinator = procs.coordinator("coordinator", "--stall-timeout", str(STALL_TIMEOUT),
                                        "--heartbeat-timeout", str(3 * STALL_TIMEOUT),
                                        "--http-port", str(procs.http_port))
        procs.worker("p0", "prefill", coordinator, wait=False)
        procs.worker("d0", "decode", coordinator, "--kv-cache-tokens", "4096")
        procs.worker("d1", "decode", coordinator, "--kv-cache-tokens", "4096")
        procs.wait_ready(coordinator, 3)
        yield procs
    finally:
        procs.stop_all()
