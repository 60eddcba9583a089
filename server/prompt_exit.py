"""How a server process ends once it has stopped cleanly: its exit handlers run (logging flushed, grammar children
stopped, the compile in flight waited for), then the process exits at once, without the interpreter's teardown.

That teardown frees what the operating system frees anyway, slowly: a decode worker's final garbage collection
over every torch and transformers object, and on the CPU backend JAX's `clean_up` destroying its client and
clearing every cache (py-spy, 2026-12-07, a loaded 2-core machine: 6 s and 3 s of a worker's 13 s and 7 s from
SIGTERM to exit). A replacement worker, `pdserve up`'s Ctrl-C and every rolling restart wait for it.
JAX's `clean_up` still runs for a slice of several processes (it leaves jax.distributed together with the others)
and on accelerators (it releases the device)."""

from __future__ import annotations

import atexit
import os
import sys
from typing import NoReturn


def exit_promptly(code: int = 0) -> NoReturn:
    _skip_jax_teardown_on_cpu()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or its reader gone
            pass
    os._exit(code)


def _skip_jax_teardown_on_cpu() -> None:
    api = sys.modules.get("jax._src.api")
    if api is None:
        return
    import jax
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized() and not jax.distributed.is_initialized() and jax.default_backend() == "cpu":
        atexit.unregister(api.clean_up)
