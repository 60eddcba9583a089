"""Start-up compiles: the few programs that serve any prompt before the worker serves, the rest in the
background while it serves, in the order the traffic asks for them; a step only ever runs programs
already compiled, so no request waits for a compile.

1. `Warmup(engine)` lists the compile jobs of every program a step can dispatch (`PrefillEngine._run`):
   the step shapes, small contexts and token buckets first, sampling of the logits as the head returns
   them at each row count, and penalized sampling (short prompts first). `first("common")` is what
   serves any prompt (`common`): every step shape without context (a plain prompt, packed with others),
   one shape of the largest context (CONTEXT_CHUNK token slots: a chunked prompt's later chunks and a
   cached prefix's suffix run in pieces of that size), sampling at every row count, and penalized
   sampling at the most rows and the longest prompts (smaller ones pad to it).
2. `compile(jobs, threads)` compiles a set on that many threads (XLA compiles outside the GIL) and
   returns when it is done: `PrefillEngine.warmup` compiles all of them so; a worker that serves
   compiles `first(--compile-before-serving)` so, then
3. `start(threads=1)` compiles the rest on a background thread. `compiled` (shapes.py `CompiledShapes`)
   grows as each finishes; the engine packs every step into it (the scheduler cuts prompts into chunks
   that fit a compiled shape, a context pads to a compiled context bucket, penalized sampling to compiled
   rows and lengths), so a step never waits for a compile. The engine tells `ask` what each prompt and
   step would have run with every shape compiled; the background takes the job asked most often next
   (ties: the order of 1.). While steps run (the engine's loop calls `pause` when it takes one, `resume`
   when its queue is empty) it takes only jobs the traffic asked for, which run on the other cores
   beside the steps; the rest wait until no prompt waits. `finished` is set, the log says so and
   `pdserve_prefill_compiles_pending` reads 0 when the last is done.
4. Jobs depend on nothing but the first step shape (whose head gives the samplers their logits), which
   depends on nothing, and is among the first set: no wait can close a cycle. A job whose compile fails
   is logged and never joins `compiled`: no step runs it.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from pdserve.server.prefill.shapes import CompiledShapes, StepShape

if TYPE_CHECKING:
    import jax

    from pdserve.server.prefill.engine import PrefillEngine

log = logging.getLogger("pdserve.prefill")

CompileBeforeServing = Literal["common", "all"]
COMPILE_BEFORE_SERVING: tuple[CompileBeforeServing, ...] = ("common", "all")
CONTEXT_CHUNK = 512
"""Token slots of the one context shape compiled before serving (at most the largest token bucket): a prompt
reading earlier KV runs in pieces of this many tokens until the larger shapes compile (a whole number of
any decode block size up to it)."""


@dataclass(eq=False)
class CompileJob:
    key: Hashable
    """A StepShape, ("sample", rows) or ("penalized", rows, prompt length bucket)."""
    run: Callable[[], object]
    common: bool
    """Among what serves any prompt, compiled before serving (1. above)."""
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
        lengths = list(engine.rates.buckets)
        steps = sorted(shapes, key=lambda s: (s.context, s.tokens))
        widest = _context_shape(steps)
        self.jobs = [CompileJob(s, lambda s=s: engine.runner.compile_step(s), s.context == 0 or s == widest)
                     for s in steps]
        self.jobs += [CompileJob(("sample", r), lambda i=i: engine.runner.compile_sample(self._logits()[i]), True)
                      for i, r in enumerate(rows)]
        runner = engine.runner
        self.jobs += [CompileJob(("penalized", r, n), lambda i=i, n=n: runner.compile_penalized(self._logits()[i], n),
                                 (r, n) == (rows[-1], lengths[-1])) for n in lengths for i, r in enumerate(rows)]
        self._by_key = {j.key: j for j in self.jobs}
        self.compiled = CompiledShapes()
        """The step shapes and penalized sampling compiled so far: every step packs into these."""
        self.asked: Counter[Hashable] = Counter()
        """How often the traffic asked for each job's programs (`ask`): the background's order."""
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        """Notified when a job is asked for, the engine resumes, or the background stops."""
        self._stopping = False
        self._all_done = False
        self._idle = True
        """No prompt waits for a step: the background takes any job, not only those asked for."""
        self._threads: list[threading.Thread] = []
        self.finished = threading.Event()
        """Set when every job is done."""
        self.created = time.perf_counter()
        self._executables = getattr(engine.runner, "executables", None)

    @property
    def pending(self) -> int:
        """Jobs not done yet."""
        return sum(not j.done.is_set() for j in self.jobs)

    @property
    def done(self) -> int:
        """Jobs done (compiled, or failed and logged)."""
        return len(self.jobs) - self.pending

    def first(self, before_serving: CompileBeforeServing) -> list[CompileJob]:
        """What a worker compiles before it serves."""
        return [j for j in self.jobs if j.common or before_serving == "all"]

    def _logits(self) -> list[jax.ShapeDtypeStruct]:
        """The head's logits [R, V] at each row count, as the samplers take them."""
        return self.ensure(self._first_shape)

    def ask(self, *keys: Hashable) -> None:
        """The traffic would run these programs (StepShape, ("penalized", rows, length)) if they were
        compiled: the background compiles the most asked for first, even while steps run."""
        with self._changed:
            self.asked.update(k for k in keys if k in self._by_key and self._by_key[k].state == "waiting")
            self._changed.notify_all()

    def ensure(self, key: Hashable) -> object:
        """Returns when `key`'s programs are compiled (nothing to do for a key without a job), compiling
        them on this thread if no other is; returns what the compile returned. (A job's dependency on
        the first step shape; steps never call it: they run only what `compiled` holds.)"""
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
        for job in jobs:  # taken by another thread meanwhile (a job's `ensure` of the first shape)
            job.done.wait()
        bar.close()
        if errors:
            raise errors[0]
        return time.perf_counter() - t0

    def start(self, threads: int = 1) -> None:
        """Compiles what is left in the background, on `threads` threads (3. above)."""
        if self.finished.is_set():
            return
        self._threads = [threading.Thread(target=self._background, name=f"compile-background-{i}", daemon=True)
                         for i in range(threads)]
        for t in self._threads:
            t.start()
        atexit.register(self.stop)  # the interpreter exits after the compile in flight, not after all of them

    def pause(self) -> None:
        """A step is about to run: the background takes only jobs the traffic asked for until `resume`."""
        self._idle = False

    def resume(self) -> None:
        """No prompt waits: the background takes any job."""
        with self._changed:
            self._idle = True
            self._changed.notify_all()

    def stop(self) -> None:
        """Stops the background after the compiles in flight (a stopping worker needs no more)."""
        with self._changed:
            self._stopping = True
            self._changed.notify_all()
        for t in self._threads:
            t.join()

    def _background(self) -> None:
        while (job := self._next_background_job()) is not None:
            self._run(job)

    def _next_background_job(self) -> CompileJob | None:
        """The waiting job asked for most (ties: the jobs' order), now compiling; while steps run, only an
        asked one (waits for one to be asked, or for the engine to resume). None: stopping, or none waits."""
        with self._changed:
            while not self._stopping:
                waiting = [j for j in self.jobs if j.state == "waiting"]
                if not waiting:
                    return None
                job = max(waiting, key=lambda j: self.asked[j.key])  # the first of the most asked
                if self._idle or self.asked[job.key]:
                    job.state = "compiling"
                    return job
                self._changed.wait()
        return None

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
            if isinstance(job.key, StepShape):
                self.compiled.add(job.key)
            elif job.key[0] == "penalized":
                self.compiled.add(job.key[1:])
        except Exception:
            if raise_errors:
                raise
            log.exception("prefill: compiling %s failed; no step runs it", job.key)
        finally:
            with self._lock:
                job.state = "done"
                job.done.set()
                last = not self._all_done and not self.pending
                self._all_done |= last
            if last:
                atexit.unregister(self.stop)
                log.info("prefill: all %d start-up programs compiled, %.1f s after the first began%s",
                         len(self.jobs), time.perf_counter() - self.created,
                         f" (executable cache: {self._executables.summary()})" if self._executables else "")
                self.finished.set()



def _context_shape(steps: list[StepShape]) -> StepShape | None:
    """The one shape with context compiled before serving: the largest context, with the most token slots
    up to CONTEXT_CHUNK (else the fewest); None when no step reads context."""
    widest = [s for s in steps if s.context == max(s.context for s in steps) > 0]
    if not widest:
        return None
    fitting = [s for s in widest if s.tokens <= CONTEXT_CHUNK]
    return max(fitting) if fitting else min(widest)
