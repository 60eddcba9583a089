"""A server process that stopped cleanly exits at once: its exit handlers run, what it printed is flushed, the
exit code is 0; an exception from its main still ends it with the traceback and a non-zero code."""

from __future__ import annotations

import subprocess
import sys

PROGRAM = """
import atexit, sys
from pdserve.server import serving

atexit.register(lambda: open(sys.argv[1], "w").write("handler ran"))

async def main():
    print("served", end="")  # no newline: sits in the buffer until flushed
    if sys.argv[2] == "raise":
        raise RuntimeError("the model could not load")

serving.run(main)
print("never printed: run does not return")
"""


def test_a_clean_stop_runs_the_exit_handlers_flushes_and_exits_zero(tmp_path):
    out = subprocess.run([sys.executable, "-c", PROGRAM, str(tmp_path / "mark"), "stop"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "served"
    assert (tmp_path / "mark").read_text() == "handler ran"


def test_an_exception_from_main_still_fails_with_its_traceback(tmp_path):
    out = subprocess.run([sys.executable, "-c", PROGRAM, str(tmp_path / "mark"), "raise"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 1
    assert "RuntimeError: the model could not load" in out.stderr
    assert (tmp_path / "mark").read_text() == "handler ran"


PROBE = """
import atexit, sys
import jax.numpy as jnp
from jax._src import api
from pdserve.server import prompt_exit

real = api.clean_up
atexit.unregister(real)

def clean_up():  # JAX's own, saying that it ran
    print("clean_up ran", flush=True)
    real()

api.clean_up = clean_up
atexit.register(clean_up)
if sys.argv[1] == "init":
    jnp.ones(2).block_until_ready()
prompt_exit._skip_jax_teardown_on_cpu()
"""


def test_jax_keeps_its_teardown_unless_this_single_process_initialized_the_cpu_backend():
    skipped = subprocess.run([sys.executable, "-c", PROBE, "init"], capture_output=True, text=True, timeout=120)
    kept = subprocess.run([sys.executable, "-c", PROBE, "no-backend"], capture_output=True, text=True, timeout=120)
    assert skipped.returncode == 0 and kept.returncode == 0, skipped.stderr + kept.stderr
    assert "clean_up ran" not in skipped.stdout
    assert "clean_up ran" in kept.stdout  # no backend to destroy: JAX's own teardown stays
