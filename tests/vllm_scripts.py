"""Scripts run in .venv-vllm (the vLLM oracles, the connector's twin), each in a fresh process, vLLM imported once.

Importing vLLM costs seconds of CPU (torch, its inductor, vLLM's configs); the scripts the tests run there
each paid it. One server process per test session imports vLLM once and forks a child per script: the child
runs the script as `python -c CODE` or `python FILE` would (its own stdin, stdout, stderr, argv, cwd,
environment, exit code), on a copy of the server's memory, so no script sees what another did.

    run = run_vllm_script(code=ORACLE, stdin=json.dumps(request), env=env, timeout=300)
    run.returncode, run.stdout, run.stderr   # as subprocess.run(capture_output=True, text=True) gives them

The server exits when its stdin closes (the test session ended, or died); `atexit` closes it.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import threading
from pathlib import Path

from tests.vllm_python import VLLM_PYTHON

_SERVER = r"""
import importlib, json, os, runpy, sys, tempfile
reply = os.fdopen(os.dup(1), "w")
os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # stray output of the server itself stays off the replies
before = dict(os.environ)
for module in sys.argv[1:]:  # what every script pays: imported once, before the forks
    try:
        importlib.import_module(module)
    except Exception:  # noqa: BLE001  a script importing it says why
        pass
imported = {k: v for k, v in os.environ.items() if before.get(k) != v}  # what importing vLLM set
reply.write("ready\n"); reply.flush()
for line in sys.stdin:
    job = json.loads(line)
    with tempfile.TemporaryDirectory() as tmp:
        paths = {name: os.path.join(tmp, name) for name in ("stdin", "stdout", "stderr")}
        with open(paths["stdin"], "w") as f:
            f.write(job["stdin"])
        sys.stdout.flush(); sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                for fd, name, mode in ((0, "stdin", os.O_RDONLY), (1, "stdout", os.O_WRONLY | os.O_CREAT),
                                       (2, "stderr", os.O_WRONLY | os.O_CREAT)):
                    os.dup2(os.open(paths[name], mode), fd)
                sys.stdin = open(0, closefd=False)
                os.chdir(job["cwd"])
                os.environ.clear(); os.environ.update(job["env"]); os.environ.update(imported)
                if job["file"] is not None:
                    sys.argv = [job["file"]]
                    sys.path[0] = os.path.dirname(os.path.abspath(job["file"]))
                    runpy.run_path(job["file"], run_name="__main__")
                else:
                    sys.argv = ["-c"]
                    sys.path[0] = ""
                    exec(compile(job["code"], "<string>", "exec"), {"__name__": "__main__"})
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                if e.code is not None and not isinstance(e.code, int):
                    print(e.code, file=sys.stderr)
            except BaseException:
                import traceback
                traceback.print_exc()
            finally:
                sys.stdout.flush(); sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        out = {name: open(paths[name], errors="replace").read() for name in ("stdout", "stderr")}
    reply.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status), **out}) + "\n"); reply.flush()
"""

PRELOAD = ("vllm", "vllm.distributed", "vllm.distributed.kv_events", "vllm.distributed.kv_transfer.kv_connector.utils",
           "vllm.distributed.kv_transfer.kv_connector.v1.base", "vllm.lora.request", "vllm.utils.hashing",
           "vllm.v1.core.kv_cache_utils", "vllm.v1.outputs")
"""vLLM itself and the modules the scripts import (their import is most of a script's cost)."""

_lock = threading.Lock()
_server: subprocess.Popen | None = None


def run_vllm_script(*, code: str | None = None, file: Path | None = None, stdin: str = "",
                    env: dict[str, str] | None = None, cwd: Path | None = None,
                    timeout: float = 300.0) -> subprocess.CompletedProcess:
    """`VLLM_PYTHON -c code` (or `VLLM_PYTHON file`) with `stdin`, in `env` (default: this process's) and `cwd`,
    as a forked child of the session's vLLM server; raises TimeoutError past `timeout` (the server is stopped)."""
    assert (code is None) != (file is None), "give code or file"
    job = {"code": code, "file": None if file is None else str(file), "stdin": stdin,
           "env": dict(os.environ if env is None else env), "cwd": str(cwd or Path.cwd())}
    with _lock:
        server = _start()
        server.stdin.write(json.dumps(job) + "\n")
        server.stdin.flush()
        line = _read_line(server, timeout, "a script")
    reply = json.loads(line)
    argv = [str(VLLM_PYTHON), *(["-c", "<code>"] if file is None else [str(file)])]
    return subprocess.CompletedProcess(argv, reply["returncode"], reply["stdout"], reply["stderr"])


def _start() -> subprocess.Popen:
    global _server
    if _server is not None and _server.poll() is None:
        return _server
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    _server = subprocess.Popen([str(VLLM_PYTHON), "-c", _SERVER, *PRELOAD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, text=True, env=env, start_new_session=True)
    if _read_line(_server, 300.0, "vLLM's import") != "ready\n":
        raise RuntimeError(f"{VLLM_PYTHON} did not start the script server: run `{VLLM_PYTHON} -c 'import vllm'` "
                           "to see why")
    return _server


def _read_line(server: subprocess.Popen, timeout: float, what: str) -> str:
    """The server's next reply line; stops the server (its children with it) past `timeout`."""
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(server.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if reader.is_alive():
        _stop()
        raise TimeoutError(f"the vLLM script server ran {what} past {timeout:.0f} s; it was stopped (rerun the test "
                           f"alone to see whether the machine is just loaded)")
    return got[0]


@atexit.register
def _stop() -> None:
    global _server
    if _server is None:
        return
    server, _server = _server, None
    if server.poll() is None:
        server.stdin.close()  # the server's loop ends; a child still running is killed with its group
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(server.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    server.wait()
