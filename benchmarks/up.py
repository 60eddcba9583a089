"""`pdserve up` as a user runs it, as a subprocess, for benchmarks that need the whole served cluster.

Life cycle: `pdserve_up` writes a cluster secret, starts `pdserve up` with `--state-file` and the OpenAI
HTTP front on a free port, waits for the state file (the launcher writes it once every process serves),
yields an `UpCluster` (addresses, the secret, the supervisor's log), then SIGTERMs `pdserve up`, which
stops its processes. `UpCluster.processes` reads the state file again (the supervisor rewrites it when it
restarts a process) and `UpCluster.exits` the supervisor's "exited with code" lines.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from pdserve.server.launcher import free_port
from pdserve.server.security import write_cluster_secret

_EXIT_LINE = re.compile(r"(\S+) \(pid (\d+)\) exited with code (-?\d+)")


@dataclass
class UpCluster:
    grpc: str
    """The coordinator's gRPC address: pdserve.v1.Generation, KServe v2 and the worker Registry."""
    http: str
    """The OpenAI HTTP front, e.g. http://127.0.0.1:8000."""
    prefill: list[str]
    decode: list[str]
    secret: str
    """The cluster secret every internal call needs."""
    state_file: Path | None
    log: Path
    up: subprocess.Popen | None = None
    """The `pdserve up` supervisor (None when attached to a cluster started elsewhere)."""

    def processes(self) -> dict[str, tuple[int, int]]:
        """name: (pid, restarts) of every process, as the supervisor last wrote them."""
        state = json.loads(self.state_file.read_text())
        return {name: (pid, state.get("restarts", {}).get(name, 0)) for name, pid in state["pids"].items()}

    def exits(self) -> list[tuple[str, int, int]]:
        """(name, pid, exit code) of every process death the supervisor logged."""
        if not self.log.exists():
            return []
        return [(m[1], int(m[2]), int(m[3])) for m in _EXIT_LINE.finditer(self.log.read_text(errors="replace"))]


@contextmanager
def pdserve_up(model: Path, workdir: Path, *, prefill_workers: int = 1, decode_workers: int = 1,
               extra_args: list[str] = (), timeout: float = 600.0) -> Iterator[UpCluster]:
    """`pdserve up --model MODEL` on 127.0.0.1 with `--http-port` (a free port); its output goes to
    workdir/up.log."""
    workdir.mkdir(parents=True, exist_ok=True)
    state, log_path = workdir / "state.json", workdir / "up.log"
    state.unlink(missing_ok=True)
    secret_file = write_cluster_secret(workdir / "cluster-secret")
    http_port = free_port()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve.server.cli", "up", "--model", str(model), "--port", "0",
             "--http-port", str(http_port), "--prefill-workers", str(prefill_workers),
             "--decode-workers", str(decode_workers), "--state-file", str(state),
             "--cluster-secret-file", str(secret_file), *extra_args],
            stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PDSERVE_LOG_LEVEL="WARNING"))
    try:
        deadline = time.monotonic() + timeout
        while not state.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"pdserve up did not start within {timeout:.0f} s (exit code {proc.poll()}); "
                                   f"its log, {log_path}, ends:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.3)
        addresses = json.loads(state.read_text())
        yield UpCluster(addresses["coordinator"], f"http://127.0.0.1:{http_port}", addresses["prefill"],
                        addresses["decode"], secret_file.read_text().strip(), state, log_path, proc)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
