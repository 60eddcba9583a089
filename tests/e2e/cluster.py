"""Runs `pdserve up` as a user would, as a subprocess, and reads back where its processes listen."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import grpc

from pdserve.v1 import worker_pb2 as pb
from pdserve.v1 import worker_pb2_grpc
from pdserve.server.security import CLUSTER_SECRET_HEADER

_SECRETS: dict[str, str] = {}
"""The cluster secret of each process address a running `pdserve_up` started (for worker_info)."""


@contextmanager
def pdserve_up(model_dir: Path, tmp: Path, *, prefill_workers: int = 2, decode_workers: int = 2,
               timeout: float = 300.0, extra_args: list[str] = ()):
    state = tmp / "state.json"
    log = open(tmp / "up.log", "w")
    secret = os.urandom(16).hex()
    (tmp / "cluster-secret").write_text(secret)
    (tmp / "cluster-secret").chmod(0o600)
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.server.cli", "up", "--model", str(model_dir), "--port", "0",
         "--prefill-workers", str(prefill_workers), "--decode-workers", str(decode_workers),
         "--state-file", str(state), "--cluster-secret-file", str(tmp / "cluster-secret"), *extra_args],
        stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PDSERVE_LOG_LEVEL="WARNING"),
    )
    started: list[str] = []
    try:
        deadline = time.monotonic() + timeout
        while not state.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"pdserve up did not start:\n{(tmp / 'up.log').read_text()[-4000:]}")
            time.sleep(0.3)
        addresses = json.loads(state.read_text())
        started += [addresses["coordinator"], *addresses["prefill"], *addresses["decode"]]
        _SECRETS.update(dict.fromkeys(started, secret))
        yield addresses
    finally:
        for address in started:
            _SECRETS.pop(address, None)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def internal_metadata(address: str) -> tuple[tuple[str, str], ...]:
    """What a test's direct (internal) call to a `pdserve_up` process carries: its cluster's secret."""
    secret = _SECRETS.get(address)
    return ((CLUSTER_SECRET_HEADER, secret),) if secret else ()


def worker_info(address: str) -> pb.WorkerInfo:
    with grpc.insecure_channel(address) as ch:
        return worker_pb2_grpc.ControlStub(ch).GetInfo(pb.GetInfoRequest(), timeout=5,
                                                       metadata=internal_metadata(address))


def wait_all_blocks_free(decode_addresses: list[str], timeout: float = 10.0) -> list[tuple[int, int]]:
    """Polls each decode worker until its free blocks equal its total; returns (free, total) pairs."""
    deadline = time.monotonic() + timeout
    while True:
        loads = [worker_info(a).load for a in decode_addresses]
        pairs = [(load.free_kv_blocks, load.total_kv_blocks) for load in loads]
        if all(f == t for f, t in pairs) or time.monotonic() > deadline:
            return pairs
        time.sleep(0.1)
