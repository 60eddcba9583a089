"""One .venv-vllm process that runs `vllm_decode_rate.py`'s jobs in turn: vLLM (~10 s of imports per process on
this machine) is imported once, each job still gets an engine of its own, torn down after it.

    with shared_vllm():          # every vllm_rates call inside reuses one process (started on the first)
        vllm_rates(...); vllm_rates(...)

Outside `shared_vllm`, each `vllm_rates` call starts and ends a process of its own. The process is pinned to
core 0 (its OpenMP threads too: VLLM_CPU_OMP_THREADS_BIND=0) either way. Protocol: `vllm_decode_rate.py --serve`
reads a job per stdin line (a JSON list: the arguments of one `vllm_decode_rate.py` run) and ends each job's
output with a line `<DONE_MARK> <exit status> more|end`; a process that ends after a job (one that failed, or ran
speculation: see `serve`), or dies in one, is replaced on the next.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from pdserve.benchmarks.engine import vllm_decode_rate
from pdserve.benchmarks.engine.vllm_decode_rate import DONE_MARK


class VllmProcess:
    """A `vllm_decode_rate.py --serve` process, started on the first job."""

    def __init__(self, python: Path = vllm_decode_rate.VLLM_PYTHON, script: Path = Path(vllm_decode_rate.__file__)):
        self.python, self.script = python, script
        self.proc: subprocess.Popen | None = None
        self.lines: queue.Queue[str | None] = queue.Queue()

    def _start(self) -> None:
        # -P: the script's folder (benchmarks/engine/) off sys.path: its modules would shadow top-level ones
        env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0")
        self.proc = subprocess.Popen([str(self.python), "-P", str(self.script), "--serve"], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     preexec_fn=lambda: os.sched_setaffinity(0, {0}))
        self.lines = queue.Queue()
        threading.Thread(target=self._read, args=(self.proc, self.lines), daemon=True).start()

    @staticmethod
    def _read(proc: subprocess.Popen, lines: queue.Queue) -> None:
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    def run(self, args: list[str], timeout: float = 1800.0) -> tuple[int, list[str]]:
        """(exit status, output lines) of one job; a job that outlives `timeout` or kills the process: status -1."""
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        self.proc.stdin.write(json.dumps(args) + "\n")
        self.proc.stdin.flush()
        out: list[str] = []
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.proc.kill()
                self.close()
                return -1, [*out, f"no answer within {timeout:.0f} s: the vLLM process was stopped"]
            if line is None:
                code = self.proc.wait()
                self.proc = None
                return -1, [*out, f"the vLLM process exited with {code} mid-job"]
            if line.startswith(DONE_MARK):
                _, code, then = line.split()
                if then == "end":  # the process ends after this job (`serve` says why): the next starts anew
                    self.close()
                return int(code), out
            out.append(line)

    def close(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.stdin.close()  # the serve loop ends at end of input
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


_shared: VllmProcess | None = None


@contextlib.contextmanager
def shared_vllm() -> Iterator[VllmProcess]:
    """Inside, `process_for` hands every caller the same process (nested: the outer one's)."""
    global _shared
    if _shared is not None:
        yield _shared
        return
    _shared = VllmProcess()
    try:
        yield _shared
    finally:
        _shared.close()
        _shared = None


@contextlib.contextmanager
def process_for() -> Iterator[VllmProcess]:
    """The shared process if one is open, else one of its own, closed on the way out."""
    if _shared is not None:
        yield _shared
        return
    own = VllmProcess()
    try:
        yield own
    finally:
        own.close()
