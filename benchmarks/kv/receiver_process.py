"""A ReceivingSide in a process of its own, on a core of its own: the decode worker of benchmarks.kv.stream.

    side = await ReceiverProcess.start(layout, num_tokens, nbytes, core=1)
    cpu0 = await side.begin(system, request_id, token); ...; cpu1, digest = await side.end(system, request_id)
    await side.close()

Life of the process:
1. Spawned (not forked: grpcio's threads do not survive a fork); it pins itself to `core` with
   os.sched_setaffinity before it imports grpcio, so every thread it starts stays on that core.
2. It starts a `ReceivingSide` in its own uvloop event loop and sends back the servers' addresses.
3. It answers the proxy's calls over a multiprocessing Pipe, read from the event loop without blocking
   it: (method, args) -> ("ok", result) | ("error", traceback). Calls come only between timed runs.
4. `close()` stops the servers and the process (killed if it does not stop within seconds).

`pinned(core)` pins every thread of this process (the sender's side) likewise, and restores them after.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import traceback
from collections.abc import Iterator
from multiprocessing.connection import Connection

from pdserve.kvcache.layout import KvLayout


def core_plan(pin: bool) -> tuple[int | None, int | None]:
    """(sender core, receiver core): the first two cores this process may use, or None, None when
    pinning is off or fewer than two are allowed."""
    allowed = sorted(os.sched_getaffinity(0))
    if not pin or len(allowed) < 2:
        return None, None
    return allowed[0], allowed[1]


@contextlib.contextmanager
def pinned(core: int | None) -> Iterator[None]:
    """Every thread of this process on `core` (threads started meanwhile inherit it); restored after."""
    if core is None:
        yield
        return
    before = os.sched_getaffinity(0)
    _pin_threads({core})
    try:
        yield
    finally:
        _pin_threads(before)


def _pin_threads(cores: set[int]) -> None:
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread that just ended
            os.sched_setaffinity(int(tid), cores)


class _Pipe:
    """One end of a multiprocessing Pipe, read from an event loop without blocking it."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    async def receive(self):
        """The next message; EOFError once the other end is closed."""
        loop = asyncio.get_running_loop()
        ready = loop.create_future()
        fd = self.conn.fileno()
        loop.add_reader(fd, lambda: ready.done() or ready.set_result(None))
        try:
            await ready
        finally:
            loop.remove_reader(fd)
        return self.conn.recv()


class ReceiverProcess:
    """The proxy of a ReceivingSide running in a child process: the same begin/end/close, over a Pipe."""

    own_process = True

    def __init__(self, process: multiprocessing.process.BaseProcess, conn: Connection) -> None:
        self.process, self._pipe = process, _Pipe(conn)
        self.addresses: dict[str, str] = {}

    @classmethod
    async def start(cls, layout: KvLayout, num_tokens: int, nbytes: int, core: int | None) -> ReceiverProcess:
        context = multiprocessing.get_context("spawn")
        ours, theirs = context.Pipe()
        process = context.Process(target=_main, args=(theirs, layout, num_tokens, nbytes, core),
                                  name="kv-receiver", daemon=True)
        process.start()
        theirs.close()
        side = cls(process, ours)
        try:
            side.addresses = await side._reply()
        except BaseException:
            await side.close()
            raise
        return side

    async def begin(self, system: str, request_id: str, token: bytes) -> float:
        return await self._call("begin", system, request_id, token)

    async def end(self, system: str, request_id: str) -> tuple[float, str | None]:
        return await self._call("end", system, request_id)

    async def close(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._call("close"), 10)
        self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self._pipe.conn.close()

    async def _call(self, method: str, *args):
        self._pipe.conn.send((method, args))
        return await self._reply()

    async def _reply(self):
        try:
            status, value = await self._pipe.receive()
        except EOFError:
            self.process.join(1)
            raise RuntimeError(f"the receiver process (pid {self.process.pid}) ended with exit code "
                               f"{self.process.exitcode}; its error is printed above") from None
        if status == "error":
            raise RuntimeError(f"the receiver process (pid {self.process.pid}) failed:\n{value}")
        return value


def _main(conn: Connection, layout: KvLayout, num_tokens: int, nbytes: int, core: int | None) -> None:
    if core is not None:
        os.sched_setaffinity(0, {core})  # before grpcio starts a thread
    import uvloop  # what every pdserve process runs on

    uvloop.run(_serve(conn, layout, num_tokens, nbytes))


async def _serve(conn: Connection, layout: KvLayout, num_tokens: int, nbytes: int) -> None:
    from pdserve.benchmarks.kv.receiving_side import ReceivingSide

    pipe = _Pipe(conn)
    try:
        side = await ReceivingSide(layout, num_tokens, nbytes).start()
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    try:
        conn.send(("ok", side.addresses))
        while True:
            try:
                method, args = await pipe.receive()
            except EOFError:  # the sender is gone
                return
            try:
                result = await getattr(side, method)(*args)
            except Exception:
                conn.send(("error", traceback.format_exc()))
                continue
            conn.send(("ok", result))
            if method == "close":
                return
    finally:
        await side.close()
