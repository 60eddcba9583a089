"""What the kernel says of the cluster's processes and the host, from /proc (Linux; zeros elsewhere).

- `cpu_seconds(pids)`: user + system CPU seconds of each process so far (/proc/PID/stat).
- `thread_run_seconds(pid)`: each thread's (on-CPU, waiting-to-run) seconds (/proc/PID/task/TID/schedstat);
  between two readings, the busiest thread's on / (on + waiting) is the share of a core the process got
  while it wanted one, and the process's CPU over that thread's the cores it keeps busy while it works
  (`hot_thread`).
- `host_busy_seconds()`: CPU seconds every core spent busy so far (/proc/stat's first line).
`Window` takes the three at its start and end and gives each process's cores used and share, and the
cores the rest of the host kept busy (`external_cores`).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path


def _tick() -> int:
    return os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """User + system CPU seconds of each process so far (0 where unreadable)."""
    out = {}
    for name, pid in pids.items():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            out[name] = (int(fields[11]) + int(fields[12])) / _tick()
        except (OSError, IndexError, ValueError):
            out[name] = 0.0
    return out


def thread_run_seconds(pid: int) -> dict[str, tuple[float, float]]:
    """{thread id: (seconds on a CPU, seconds runnable but waiting)} of the process ({} where unreadable)."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            a, b, *_ = Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()
        except (OSError, ValueError):
            continue
        out[tid] = (int(a) / 1e9, int(b) / 1e9)
    return out


def hot_thread(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> tuple[float, float]:
    """(on-CPU, waiting) seconds between two readings of the process's busiest thread (its engine loop, its
    compute thread). Its on / (on + waiting) is the share of a core the process got while it wanted one:
    threads are not summed, as a process's own threads runnable at once would count as waiting for each other."""
    best = (0.0, 0.0)
    for tid, (on, wait) in after.items():
        on0, wait0 = before.get(tid, (0.0, 0.0))
        if on - on0 > best[0]:
            best = (on - on0, wait - wait0)
    return best


def host_busy_seconds() -> float:
    """CPU seconds all cores were busy so far: /proc/stat's total less idle and iowait (0 where unreadable)."""
    try:
        values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return 0.0
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    return (sum(values[:8]) - idle) / _tick()


@dataclass
class Window:
    """Readings at the start of a measured window; `end()` gives what happened over it."""

    pids: dict[str, int]
    t0: float = field(default_factory=time.perf_counter)
    cpu0: dict[str, float] = field(default_factory=dict)
    run0: dict[str, dict[str, tuple[float, float]]] = field(default_factory=dict)
    busy0: float = 0.0

    def __post_init__(self) -> None:
        self.cpu0 = cpu_seconds(self.pids)
        self.run0 = {k: thread_run_seconds(p) for k, p in self.pids.items()}
        self.busy0 = host_busy_seconds()
        self.t0 = time.perf_counter()

    def end(self) -> dict:
        """{"wall_s", "cores": {name: CPU / wall}, "share": {name: its busiest thread's on / (on + waiting)}, "hot_cpu_s": {name: that thread's on-CPU s}, "cpu_s": {name: s},
        "external_cores": host busy less these processes' CPU, over the wall}."""
        wall = max(time.perf_counter() - self.t0, 1e-9)
        cpu1 = cpu_seconds(self.pids)
        cpu = {k: cpu1[k] - self.cpu0[k] for k in self.pids}
        hot = {k: hot_thread(self.run0[k], thread_run_seconds(pid)) for k, pid in self.pids.items()}
        share = {k: on / (on + wait) if on > 0 else 1.0 for k, (on, wait) in hot.items()}
        busy = host_busy_seconds() - self.busy0
        return {"wall_s": wall, "cpu_s": cpu, "cores": {k: v / wall for k, v in cpu.items()}, "share": share,
                "hot_cpu_s": {k: on for k, (on, _) in hot.items()},
                "external_cores": max(busy - sum(cpu.values()), 0.0) / wall}
