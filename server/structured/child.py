"""A grammar child process: where llguidance parses a client's spec, so its crash kills only this process.

Life cycle: `pool.py` starts `python -m pdserve.server.structured.child FD` (spawned: nothing of the parent's
memory), sends ("init", tokenizer_json | None, vocab_size, eos_ids) on the socket FD, and the child answers
"ready" once it built its LLTokenizer (workers: trial compiles need one; the coordinator sends none). Then it
runs one job at a time, (function, args) -> ("ok", result) | ("error", message), until the socket closes
(its parent is gone). Each job runs on a thread whose stack is CHILD_STACK_BYTES, a quarter of the stack the
serving process compiles on (grammars.py): llguidance's recursion that fits here fits there.
"""

from __future__ import annotations

import sys
import threading
from multiprocessing.connection import Connection
from typing import Any

CHILD_STACK_BYTES = 4 * 2**20
"""A job thread's stack in the child; the serving process compiles on COMPILE_STACK_BYTES (grammars.py)."""

_grammars: Any = None
"""The child's Grammars (isolated=False: it compiles directly), None on the coordinator."""


def check(spec_bytes: bytes, where: str, field: str) -> str | None:
    """The job every tier runs: why the StructuredOutput cannot be enforced (a sentence starting with
    `where`), or None. With a tokenizer, a trial compile and the first mask too (what a worker will do)."""
    import numpy as np
    from pdserve.server.structured.bitmask import words
    from pdserve.server.structured.output_spec import SpecError, one_line, spec_problem
    from pdserve.v1 import generation_pb2 as gen_pb

    spec = gen_pb.StructuredOutput.FromString(spec_bytes)
    problem = spec_problem(spec, field, where)
    if problem or _grammars is None:
        return problem
    try:
        matcher, _ = _grammars._compile(spec, where)
    except SpecError as e:
        return str(e)
    row = np.zeros(words(_grammars.vocab_size), np.int32)
    matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
    return f"{where}: {one_line(matcher.get_error())}" if matcher.is_error() else None


def _init(tokenizer_json: str | None, vocab_size: int, eos_ids: tuple[int, ...]) -> None:
    global _grammars
    if tokenizer_json is not None:
        from pdserve.server.structured.grammars import Grammars

        _grammars = Grammars(tokenizer_json, vocab_size, eos_ids, isolated=False)
        _grammars.tokenizer  # built now, before the child reports ready


def _run(conn: Connection) -> None:
    kind, *init = conn.recv()
    assert kind == "init", kind
    _init(*init)
    conn.send(("ready", None))
    threading.stack_size(CHILD_STACK_BYTES)
    while True:
        try:
            fn, args = conn.recv()
        except (EOFError, OSError):
            return  # the parent is gone
        answer: list[tuple[str, Any]] = []

        def job() -> None:
            try:
                answer.append(("ok", fn(*args)))
            except BaseException as e:  # noqa: BLE001 - a job's failure is its answer
                answer.append(("error", f"{type(e).__name__}: {e}"))

        thread = threading.Thread(target=job, name="grammar-job")
        thread.start()
        thread.join()
        conn.send(answer[0])


if __name__ == "__main__":
    _run(Connection(int(sys.argv[1])))
