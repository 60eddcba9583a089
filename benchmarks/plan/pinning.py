"""Each worker on a core of its own (`plan profile --pin`, `plan validate --pin`), as issue 32's check
asks: the prefill worker, the coordinator and the load client (this process) on the first core this
process may use, the decode worker on the second. The same placement, by core index, is what
`plan simulate --placement` shares out (contention.py)."""

from __future__ import annotations

import os
from pathlib import Path

from pdserve.benchmarks.plan.contention import pinned_placement

_CORES = sorted(os.sched_getaffinity(0))
"""The cores this process could use when it started (before pinning itself to one)."""


def placement() -> dict[str, int]:
    """{role: core index} for this machine; raises where fewer than 2 cores are there to pin to."""
    cores = len(_CORES)
    chosen = pinned_placement(cores)
    if chosen is None:
        raise ValueError(f"--pin needs at least 2 cores; this process may use {cores}: run without --pin")
    return chosen


def launcher_cpus(chosen: dict[str, int]) -> dict[str, set[int]]:
    """The launcher's `cpus` (real core ids) for a placement by index."""
    ids = _CORES
    return {role: {ids[core]} for role, core in chosen.items() if role != "client"}


def pin_this_process(chosen: dict[str, int]) -> None:
    """Every thread of this process (the load client) onto its core; threads started later inherit it."""
    core = {_CORES[chosen["client"]]}
    for tid in Path("/proc/self/task").iterdir():
        try:
            os.sched_setaffinity(int(tid.name), core)
        except (ProcessLookupError, PermissionError):  # a thread that ended meanwhile
            pass


def placement_argv(chosen: dict[str, int] | None) -> list[str]:
    """`plan simulate`'s flag for a placement."""
    return ["--placement", ",".join(f"{k}={v}" for k, v in chosen.items())] if chosen else []
