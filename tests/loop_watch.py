"""A watchdog on the tests' shared event loop (a pytest plugin, see conftest.py): when a callback holds the
loop past STALL_S, the loop thread's stack goes to stderr, which pytest shows with the test that failed.

The suite's in-process servers (coordinator, fake workers, uvicorn) and their clients share pytest-asyncio's
session loop. One synchronous call in any of them stalls every request at once, and a client sees only a read
timeout; this names the call. A heartbeat task on the loop stamps the time; a thread reads the stamp while the
loop runs (between async tests the loop is idle, not held).
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
import traceback

import pytest

STALL_S = 3.0
"""A loop held this long without running its heartbeat is reported, once per stall."""
BEAT_S = 0.25
STACK_FRAMES = 20


class LoopWatch:
    def __init__(self, loop: asyncio.AbstractEventLoop, thread_id: int):
        self.loop = loop
        self.thread_id = thread_id
        self.beat = time.monotonic()
        self.reported = False
        self.stopped = threading.Event()

    async def heartbeat(self) -> None:
        while True:
            now = time.monotonic()
            if self.reported:
                sys.stderr.write(f"\n[loop-watch] the event loop ran again after {now - self.beat:.1f} s\n")
            self.beat, self.reported = now, False
            await asyncio.sleep(BEAT_S)

    def watch(self) -> None:
        while not self.stopped.wait(BEAT_S):
            if not self.loop.is_running():
                self.beat = time.monotonic()
                continue
            held = time.monotonic() - self.beat
            if held > STALL_S and not self.reported:
                self.reported = True
                frame = sys._current_frames().get(self.thread_id)
                stack = traceback.format_stack(frame)[-STACK_FRAMES:] if frame is not None else ["(gone)\n"]
                sys.stderr.write(f"\n[loop-watch] the event loop has been held {held:.1f} s; its thread is at:\n"
                                 + "".join(stack))


@pytest.fixture(scope="session", autouse=True)
async def loop_watch():
    """Watches the session loop (asyncio_default_fixture_loop_scope = session) for the whole run."""
    watch = LoopWatch(asyncio.get_running_loop(), threading.get_ident())
    beat = asyncio.create_task(watch.heartbeat())
    threading.Thread(target=watch.watch, name="loop-watch", daemon=True).start()
    yield watch
    watch.stopped.set()
    beat.cancel()
