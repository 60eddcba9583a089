"""Start-up compiles in the order requests need them: a plain prompt's programs before the worker serves,
the rarer ones in the background while it serves.

1. `Warmup(engine)` lists the compile jobs of every program a step can dispatch (`PrefillEngine._run`),
   most likely first: the step shapes without context, which a plain prompt runs (small token buckets
   first), and sampling of the logits as the head returns them at each row count; these are `common`.
   Then the shapes with context, which a chunked prompt's later chunks and a cached prefix's suffix run
   (small contexts and token buckets first), and sampling with penalties (short prompts first).
2. `compile(jobs, threads)` compiles a set on that many threads (XLA compiles outside the GIL) and
   returns when it is done: `PrefillEngine.warmup` compiles all of them so; a worker that serves
   compiles `first(--compile-before-serving)` so, then
3. `start(threads=1)` compiles the rest on a background thread, only while no prompt waits: the
   engine's loop calls `pause` when it takes a step and `resume` when its queue is empty, and the
   background takes its next job only when resumed (a step waits for at most the compile in flight;
   under a load that never lets up, the rest compile when a step first needs them, 4.). (A lower CPU
   priority would not do it: XLA compiles on threads of its own, which keep the priority they had.)
   `finished` is set, the log says so and `pdserve_prefill_compiles_pending` reads 0 when the last is
   done.
4. A step whose shape (or penalized sampling) is still waiting compiles it on the step's own thread
   (`ensure_step`); one that a background thread is compiling waits for that compile: no program
   compiles twice, and a request never queues behind the background's order. Jobs depend on nothing
   but the first step shape (whose head gives the samplers their logits), which depends on nothing:
   no wait can close a cycle.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import jax

    from pdserve.server.prefill.engine import PrefillEngine
    from pdserve.server.prefill.step_packing import StepShape
    from pdserve.server.prefill.step_inputs import StepInputs

log = logging.getLogger("pdserve.prefill")

CompileBeforeServing = Literal["common", "all"]
COMPILE_BEFORE_SERVING: tuple[CompileBeforeServing, ...] = ("common", "all")


@dataclass(eq=False)
class CompileJob:
    key: Hashable
    """A StepShape, ("sample", rows) or ("penalized", rows, prompt length bucket)."""
    run: Callable[[], object]
    common: bool
    """Among what a plain prompt needs (no context, no penalties)."""
    state: Literal["waiting", "compiling", "done"] = "waiting"
    result: object = None
    done: threading.Event = field(default_factory=threading.Event)


def cores() -> int:
    """The cores this process may run on (a worker pinned to one core has one, whatever the machine has)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class Warmup:
    def __init__(self, engine: PrefillEngine, shapes: list[StepShape] | None = None):
        shapes = engine.shapes() if shapes is None else shapes
        self._first_shape = min(shapes, key=lambda s: (s.context, s.tokens))
        rows = [1 << i for i in range((engine.config.max_batch_size - 1).bit_length() + 1)]  # up to a power of two
        steps = sorted(shapes, key=lambda s: (s.context, s.tokens))
        self.jobs = [CompileJob(s, lambda s=s: engine.runner.compile_step(s), s.context == 0) for s in steps]
        self.jobs += [CompileJob(("sample", r), lambda i=i: engine.runner.compile_sample(self._logits()[i]), True)
                      for i, r in enumerate(rows)]
        runner = engine.runner
        self.jobs += [CompileJob(("penalized", r, n), lambda i=i, n=n: runner.compile_penalized(self._logits()[i], n),
                                 False) for n in engine.rates.buckets for i, r in enumerate(rows)]
        self._by_key = {j.key: j for j in self.jobs}
        self._lock = threading.Lock()
        self._stopping = False
        self._all_done = False
        self._idle = threading.Event()
        """Set while no prompt waits for a step: the background compiles only then."""
        self._idle.set()
        self._threads: list[threading.Thread] = []
        self.finished = threading.Event()
        """Set when every job is done."""
        self.created = time.perf_counter()

    @property
    def pending(self) -> int:
        """Jobs not done yet."""
        return sum(not j.done.is_set() for j in self.jobs)

    def first(self, before_serving: CompileBeforeServing) -> list[CompileJob]:
        """What a worker compiles before it serves."""
        return [j for j in self.jobs if j.common or before_serving == "all"]

    def _logits(self) -> list[jax.ShapeDtypeStruct]:
        """The head's logits [R, V] at each row count, as the samplers take them."""
        return self.ensure(self._first_shape)

    def ensure_step(self, shape: StepShape, inputs: StepInputs) -> None:
        """Returns when every program of the step is compiled (a step calls it before it dispatches)."""
        self.ensure(shape)
        if inputs.penalties is not None:
            self.ensure(("penalized", *inputs.penalties[0].shape))  # tokens [R, S]: rows, prompt length bucket

    def ensure(self, key: Hashable) -> object:
        """Returns when `key`'s programs are compiled (nothing to do for a key without a job), compiling
        them on this thread if no other is; returns what the compile returned."""
        job = self._by_key.get(key)
        if job is None:
            return None
        with self._lock:
            mine = job.state == "waiting"
            if mine:
                job.state = "compiling"
        if mine:
            self._run(job)
        job.done.wait()
        return job.result

    def compile(self, jobs: list[CompileJob], threads: int, progress: bool = False) -> float:
        """Compiles `jobs` on `threads` threads (fewer when fewer jobs); returns the seconds it took."""
        from tqdm import tqdm

        t0 = time.perf_counter()
        bar = tqdm(total=len(jobs), desc="compiling prefill shapes", unit="shape", disable=not progress)
        errors: list[BaseException] = []

        def work() -> None:
            while (job := self._take(jobs)) is not None:
                try:
                    self._run(job, raise_errors=True)
                except Exception as e:  # re-raised on the calling thread
                    errors.append(e)
                bar.update()

        pool = [threading.Thread(target=work, name=f"compile-{i}", daemon=True) for i in range(min(threads, len(jobs)))]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        for job in jobs:  # taken by a step's ensure meanwhile
            job.done.wait()
        bar.close()
        if errors:
            raise errors[0]
        return time.perf_counter() - t0

    def start(self, threads: int = 1) -> None:
        """Compiles what is left in the background, on `threads` threads, while the engine is not paused."""
        if self.finished.is_set():
            return
        self._threads = [threading.Thread(target=self._background, name=f"compile-background-{i}", daemon=True)
                         for i in range(threads)]
        for t in self._threads:
            t.start()
        atexit.register(self.stop)  # the interpreter exits after the compile in flight, not after all of them

    def pause(self) -> None:
        """A step is about to run: the background takes no new job until `resume`."""
        self._idle.clear()

    def resume(self) -> None:
        """No prompt waits: the background goes on."""
        self._idle.set()

    def stop(self) -> None:
        """Stops the background after the compiles in flight (a stopping worker needs no more)."""
        self._stopping = True
        self._idle.set()
        for t in self._threads:
            t.join()

    def _background(self) -> None:
        while self._idle.wait() and not self._stopping and (job := self._take(self.jobs)) is not None:
            self._run(job)

    def _take(self, jobs: list[CompileJob]) -> CompileJob | None:
        """The first waiting job of `jobs`, now compiling (None: none waits)."""
        with self._lock:
            for job in jobs:
                if job.state == "waiting":
                    job.state = "compiling"
                    return job
        return None

    def _run(self, job: CompileJob, raise_errors: bool = False) -> None:
        try:
            job.result = job.run()
        except Exception:
            if raise_errors:
                raise
            # a step that needs it compiles it again (jax.jit on the call) and fails there with the reason
            log.exception("prefill: compiling %s failed", job.key)
        finally:
            with self._lock:
                job.state = "done"
                job.done.set()
                last = not self._all_done and not self.pending
                self._all_done |= last
            if last:
                atexit.unregister(self.stop)
                log.info("prefill: all %d start-up programs compiled, %.1f s after the first began",
                         len(self.jobs), time.perf_counter() - self.created)
                self.finished.set()

