"""Checks a client's StructuredOutput without letting its native work touch the serving process.

`await checker.check(spec, where)`: the limits (limits.py, plain Python, before anything else), then a child
of the pool (pool.py) builds and validates the grammar, and on a worker trial-compiles it against the
tokenizer. A refusal, a crash or a timeout raises SpecError naming `where` ("...: grammar too complex: the
grammar compiler crashed ..."); nothing about a refused spec is kept. Specs a child passed are remembered by
digest (a bounded LRU), so a repeated schema (the same tools every request) costs one child job.
The coordinator checks every front's spec here; a worker's Grammars (grammars.py) compiles only what passed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import threading
from collections import OrderedDict

from pdserve.server import metrics
from pdserve.server.structured import child
from pdserve.server.structured.limits import SpecLimits, check_spec
from pdserve.server.structured.output_spec import SpecError
from pdserve.server.structured.pool import ChildFailed, GrammarPool, JobError, PoolBusy, shared_pool
from pdserve.v1 import generation_pb2 as gen_pb

MAX_PASSED = 4096
"""Digests of passed specs remembered."""
INLINE_BYTES = 16 * 1024
"""A spec at most this large has its limits checked on the event loop (well under a millisecond); a larger
one in a thread."""


class ChecksBusy(Exception):
    """The grammar processes have more checks waiting than they queue: an overload, the client may retry."""


class SpecChecker:
    def __init__(self, limits: SpecLimits | None = None, pool: GrammarPool | None = None, field: str = "structured",
                 executor: concurrent.futures.Executor | None = None):
        """field: what a refusal names when the caller gives no `where` (`field.<kind>`); executor: where a
        large spec's limits are checked (default: the event loop's default executor)."""
        self.executor = executor
        self.limits = limits or SpecLimits()
        self.pool = pool or shared_pool()
        self.field = field
        self._passed: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def digest(spec: gen_pb.StructuredOutput) -> bytes:
        return hashlib.sha256(spec.SerializeToString(deterministic=True)).digest()

    def passed(self, spec: gen_pb.StructuredOutput) -> bool:
        """Whether a child passed this spec (and it is still remembered)."""
        with self._lock:
            return self.digest(spec) in self._passed

    async def check(self, spec: gen_pb.StructuredOutput, where: str | None = None) -> None:
        """SpecError naming `where` (default `<field>.<kind>`) when the spec cannot be enforced; ChecksBusy when
        the grammar processes are overloaded."""
        where = where or f"{self.field}.{spec.WhichOneof('kind')}"
        if spec.ByteSize() > INLINE_BYTES:
            await asyncio.get_running_loop().run_in_executor(self.executor, self._limits, spec, where)
        else:
            self._limits(spec, where)
        if self.passed(spec):
            return
        try:
            problem = await self.pool.run(child.check, spec.SerializeToString(), where, self.field)
        except PoolBusy as e:
            metrics.grammar_checks.labels("busy").inc()
            raise ChecksBusy(f"{where}: {e}; retry later") from e
        except (ChildFailed, JobError) as e:
            raise self._failure(where, e) from e
        self._record(spec, problem)

    def check_sync(self, spec: gen_pb.StructuredOutput, where: str | None = None) -> None:
        """check(), blocking the calling thread (never an event loop's) until the child answers."""
        where = where or f"{self.field}.{spec.WhichOneof('kind')}"
        self._limits(spec, where)
        if self.passed(spec):
            return
        try:
            problem = self.pool.submit(child.check, spec.SerializeToString(), where, self.field).result()
        except PoolBusy as e:
            metrics.grammar_checks.labels("busy").inc()
            raise ChecksBusy(f"{where}: {e}; retry later") from e
        except (ChildFailed, JobError) as e:
            raise self._failure(where, e) from e
        self._record(spec, problem)

    def _limits(self, spec: gen_pb.StructuredOutput, where: str) -> None:
        try:
            check_spec(spec, where, self.limits)
        except ValueError as e:
            metrics.grammar_checks.labels("limit").inc()
            raise SpecError(str(e)) from e

    @staticmethod
    def _failure(where: str, e: Exception) -> SpecError:
        """The refusal of a spec whose child crashed, ran out of time or raised (nothing of it is kept)."""
        if isinstance(e, ChildFailed):
            metrics.grammar_checks.labels("timeout" if e.timed_out else "crash").inc()
            return SpecError(f"{where}: grammar too complex: the grammar compiler {e}; simplify it (fewer rules, "
                             "$defs or nesting levels)")
        metrics.grammar_checks.labels("error").inc()
        return SpecError(f"{where}: the grammar compiler failed: {e}")

    def _record(self, spec: gen_pb.StructuredOutput, problem: str | None) -> None:
        if problem:
            metrics.grammar_checks.labels("refused").inc()
            raise SpecError(problem)
        metrics.grammar_checks.labels("passed").inc()
        with self._lock:
            self._passed[self.digest(spec)] = None
            while len(self._passed) > MAX_PASSED:
                self._passed.popitem(last=False)
