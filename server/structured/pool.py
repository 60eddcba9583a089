"""A small pool of spawned child processes (child.py) that runs the native grammar work on client input.

Life cycle of a job: `submit(fn, *args)` queues it and returns a concurrent.futures.Future (`run` awaits it);
one of the pool's `processes` slot threads takes it, starts its child if it has none (`python -m`, through
posix_spawn: nothing of the serving process is inherited, and no fork runs in a threaded gRPC process; the
child's start-up does not count against the job),
sends it and waits at most `timeout` seconds for the answer. The child dies (a segfault in llguidance, an
abort) -> ChildFailed("... crashed ..."), and the slot starts a fresh child for its next job; no answer in
time -> the child is killed, ChildFailed("... did not finish within N s"), and likewise replaced. A job
only fails for its own child's death: jobs queued or running on the other children go on.
A child exits by itself when its parent does (its socket closes).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import hashlib
import logging
import os
import queue
import signal
import socket
import sys
import threading
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pdserve

log = logging.getLogger("pdserve.grammar")

DEFAULT_PROCESSES = 2
DEFAULT_TIMEOUT_S = 10.0
QUEUED_PER_PROCESS = 64
"""Jobs that may wait per child; past that, submit refuses (PoolBusy) rather than queue without bound."""
START_TIMEOUT_S = 120.0
"""A child's start-up (imports, and the LLTokenizer of a large vocabulary) before it is given up as broken."""


class ChildFailed(Exception):
    """The job's child crashed or ran past its deadline (and was killed); nothing it did is kept."""

    def __init__(self, message: str, timed_out: bool):
        super().__init__(message)
        self.timed_out = timed_out


class PoolBusy(RuntimeError):
    """More jobs wait than the pool queues (`max_queued`): the caller may retry later."""


class JobError(RuntimeError):
    """The job's function raised in the child; the message is its exception's."""


class _Job:
    def __init__(self, fn: Callable[..., Any], args: tuple, timeout: float):
        self.fn, self.args, self.timeout = fn, args, timeout
        self.future: concurrent.futures.Future = concurrent.futures.Future()


CHILD_FD = 3
"""The child's end of its socket, as the child sees it."""


class _Child:
    def __init__(self, tokenizer: tuple[str, int, tuple[int, ...]] | None):
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        root = str(Path(pdserve.__file__).parent.parent)  # where this pdserve imports from
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        try:  # posix_spawn, not fork: no fork handlers run in this threaded (gRPC) process
            self.pid = os.posix_spawn(
                sys.executable, [sys.executable, "-m", "pdserve.server.structured.child", str(CHILD_FD)], env,
                file_actions=[(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                              (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0),
                              (os.POSIX_SPAWN_DUP2, theirs.fileno(), CHILD_FD)],
                setsid=True)  # the terminal's ^C goes to the server, which stops the pool
        finally:
            theirs.close()
        self.code: int | None = None
        """The exit code once reaped (negative: the signal that ended it)."""
        self._reaping = threading.Lock()
        self.conn = Connection(ours.detach())
        self.conn.send(("init", *(tokenizer or (None, 0, ()))))
        if not self.conn.poll(START_TIMEOUT_S):
            self.kill()
            raise RuntimeError(f"a grammar child process did not start within {START_TIMEOUT_S:g} s")
        try:
            self.conn.recv()
        except (EOFError, OSError) as e:
            code = self.kill()
            raise RuntimeError(f"a grammar child process exited while starting ({_exit_name(code)})") from e

    def alive(self) -> bool:
        with self._reaping:
            if self.code is None:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid:
                    self.code = os.waitstatus_to_exitcode(status)
            return self.code is None

    def signal_kill(self) -> None:
        """SIGKILL, from any thread (the slot's thread then sees its socket end and reaps the child)."""
        if self.code is None:
            with contextlib.suppress(OSError):
                os.kill(self.pid, signal.SIGKILL)

    def kill(self) -> int:
        """Kills the child (if it still runs), reaps it and closes its socket (the slot's thread only); its
        exit code."""
        if self.alive():
            with contextlib.suppress(OSError):
                os.kill(self.pid, signal.SIGKILL)
            with self._reaping:
                if self.code is None:
                    self.code = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        self.conn.close()
        return self.code


def _exit_name(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


class GrammarPool:
    def __init__(self, processes: int = DEFAULT_PROCESSES, timeout: float = DEFAULT_TIMEOUT_S,
                 tokenizer: tuple[str, int, tuple[int, ...]] | None = None, max_queued: int | None = None):
        """processes: children (and jobs at once); timeout: a job's deadline in seconds; tokenizer:
        (tokenizer.json text, vocab_size, eos_ids) for each child's LLTokenizer (trial compiles), or None;
        max_queued: jobs that may wait (default QUEUED_PER_PROCESS per child)."""
        if processes < 1:
            raise ValueError(f"--grammar-processes must be >= 1, got {processes}")
        if not timeout > 0:
            raise ValueError(f"--grammar-timeout must be > 0, got {timeout}")
        self.processes = processes
        self.timeout = timeout
        self.tokenizer = tokenizer
        self.max_queued = QUEUED_PER_PROCESS * processes if max_queued is None else max_queued
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._children: list[_Child | None] = [None] * processes
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False
        self.crashes = 0
        """Children that died under a job."""
        self.timeouts = 0
        """Children killed for running past a job's deadline."""
        _POOLS.add(self)

    def pids(self) -> list[int]:
        """The live children's process ids."""
        return [c.pid for c in self._children if c is not None and c.alive()]

    def submit(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> concurrent.futures.Future:
        """Runs fn(*args) (a module-level function: it is pickled by name) in a child; the future's result is
        its return value, or ChildFailed (crash, deadline), JobError (the job raised) or RuntimeError (no child
        could start). PoolBusy at once when `max_queued` jobs wait already."""
        job = _Job(fn, args, self.timeout if timeout is None else timeout)
        with self._lock:
            if self._closed:
                raise RuntimeError("the grammar pool is closed")
            if self._jobs.qsize() >= self.max_queued:
                raise PoolBusy(f"{self._jobs.qsize()} grammar checks wait for the {self.processes} grammar processes")
            if not self._threads:
                self._threads = [threading.Thread(target=self._serve, args=(i,), daemon=True, name=f"grammar-{i}")
                                 for i in range(self.processes)]
                for thread in self._threads:
                    thread.start()
        self._jobs.put(job)
        return job.future

    async def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> Any:
        """submit(), awaited (the event loop runs on meanwhile)."""
        return await asyncio.wrap_future(self.submit(fn, *args, timeout=timeout))

    def start(self) -> None:
        """Starts every child now (in the background), so the first requests do not wait for them."""
        for i in range(self.processes):
            self.submit(_ready, timeout=START_TIMEOUT_S)

    def close(self) -> None:
        """Kills the children and stops the slot threads; queued and running jobs fail. Each slot thread
        reaps its own child (it alone reads that child's socket)."""
        with self._lock:
            self._closed = True
        for _ in self._threads:
            self._jobs.put(None)
        for child in list(self._children):
            if child is not None:
                child.signal_kill()

    # ---- a slot: one child, one job at a time; only the slot's thread touches its child ----------------

    def _serve(self, slot: int) -> None:
        while True:
            job = self._jobs.get()
            if job is None or self._closed:
                if job is not None:
                    job.future.set_exception(RuntimeError("the grammar pool is closed"))
                self._replace(slot)
                return
            if not job.future.set_running_or_notify_cancel():
                continue
            try:
                job.future.set_result(self._run(slot, job))
            except BaseException as e:  # noqa: BLE001 - every failure belongs to the job's future
                job.future.set_exception(e)

    def _child(self, slot: int) -> _Child:
        child = self._children[slot]
        if child is not None and not child.alive():  # died between jobs: not this job's fault
            log.warning("grammar child %d exited while idle (%s); starting another", child.pid,
                        _exit_name(self._replace(slot)))
            child = None
        if child is None:
            child = self._children[slot] = _Child(self.tokenizer)
        if self._closed:
            self._replace(slot)
            raise RuntimeError("the grammar pool is closed")
        return child

    def _replace(self, slot: int) -> int:
        child = self._children[slot]
        self._children[slot] = None
        return child.kill() if child is not None else 0

    def _run(self, slot: int, job: _Job) -> Any:
        child = self._child(slot)
        try:
            child.conn.send((job.fn, job.args))
            answered = child.conn.poll(job.timeout)
            if answered:
                status, value = child.conn.recv()
        except (EOFError, OSError):
            answered, status = True, None
        if self._closed and (not answered or status is None):
            self._replace(slot)
            raise RuntimeError("the grammar pool is closed")
        if not answered:
            self.timeouts += 1
            pid = child.pid
            self._replace(slot)
            log.warning("grammar child %d ran past its %g s deadline: killed", pid, job.timeout)
            raise ChildFailed(f"did not finish within {job.timeout:g} s", timed_out=True)
        if status is None:
            self.crashes += 1
            pid = child.pid
            code = self._replace(slot)
            log.warning("grammar child %d crashed (%s) on a job; starting another", pid, _exit_name(code))
            raise ChildFailed(f"crashed ({_exit_name(code)})", timed_out=False)
        if status == "error":
            raise JobError(value)
        return value


_SHARED: dict[tuple, GrammarPool] = {}
_SHARED_LOCK = threading.Lock()


def shared_pool(processes: int = DEFAULT_PROCESSES, timeout: float = DEFAULT_TIMEOUT_S,
                tokenizer: tuple[str, int, tuple[int, ...]] | None = None) -> GrammarPool:
    """The process's one pool for these settings (every Grammars and SpecChecker of one tokenizer shares its
    children, however many are built)."""
    digest = None if tokenizer is None else (hashlib.sha256(tokenizer[0].encode()).hexdigest(), *tokenizer[1:])
    key = (processes, timeout, digest)
    with _SHARED_LOCK:
        pool = _SHARED.get(key)
        if pool is None or pool._closed:
            pool = _SHARED[key] = GrammarPool(processes, timeout, tokenizer)
        return pool


def _ready() -> None:
    """A job that does nothing: starts a child (`GrammarPool.start`)."""


_POOLS: weakref.WeakSet[GrammarPool] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for pool in list(_POOLS):
        pool.close()
