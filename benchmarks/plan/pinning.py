"""Each worker on a core of its own (`plan profile --pin`, `plan validate --pin`), as issue 32's check
asks: the prefill worker, the coordinator and the load client (this process) on the first core this
process may use, the decode worker on the second. The same placement, by core index, is what
`plan simulate --placement` shares out (contention.py)."""

from __future__ import annotations

import os
from pathlib import Path

_CORES = sorted(os.sched_getaffinity(0))
"""The cores this process could use when it started (before pinning itself to one)."""


def placement() -> dict[str, int]:
    """{role: core index}: each worker on a core of its own, the coordinator and the load client beside the
    prefill worker (idle between prompts; the decode worker steps all the time). Raises below 2 cores."""
    if len(_CORES) < 2:
        raise ValueError(f"--pin needs at least 2 cores; this process may use {len(_CORES)}: run without --pin")
    return {"prefill": 0, "decode": 1, "coordinator": 0, "client": 0}


def launcher_cpus(chosen: dict[str, int]) -> dict[str, set[int]]:
    """The launcher's `cpus` (real core ids) for a placement by index."""
    return {role: {_CORES[core]} for role, core in chosen.items() if role != "client"}


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
