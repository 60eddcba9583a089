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


TRIAL_TOKENS = 8
"""How many tokens a check draws (each the lowest id the grammar allows next) after the trial compile: a
grammar that outgrows llguidance's parser limits within them (20,000 alternatives sharing a prefix) is refused
at the front instead of failing its request after the first token."""


def check(spec_bytes: bytes, where: str, field: str) -> str | None:
    """The job every tier runs: why the StructuredOutput cannot be enforced (a sentence starting with
    `where`), or None. With a tokenizer, a trial compile, then TRIAL_TOKENS masked draws (what a worker will do)."""
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
    for _ in range(TRIAL_TOKENS):
        matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        if matcher.is_error():
            return f"{where}: {one_line(matcher.get_error().split('<state>')[0])}"
        allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[: _grammars.vocab_size])
        allowed = allowed[~np.isin(allowed, _grammars.eos_ids)]
        if matcher.is_stopped() or not allowed.size:
            return None
        if not matcher.consume_token(int(allowed[0])) or matcher.is_error():
            return (f"{where}: grammar too complex: a trial output exceeds a parser limit "
                    f"({one_line(matcher.get_error().split('<state>')[0])})")
    return None


def _init(tokenizer_json: str | None, vocab_size: int, eos_ids: tuple[int, ...]) -> None:
    global _grammars
    if tokenizer_json is not None:
        from pdserve.server.structured.grammars import Grammars

        _grammars = Grammars(tokenizer_json, vocab_size, eos_ids, isolated=False)
        _grammars.tokenizer  # built now, before the child reports ready


def _run(conn: Connection) -> None:
    try:
        kind, *init = conn.recv()
        assert kind == "init", kind
        _init(*init)
        conn.send(("ready", None))
    except (EOFError, OSError):
        return  # the parent stopped before the child was ready
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
        try:
            conn.send(answer[0])
        except OSError:
            return  # the parent is gone (it stopped, or gave up on this job and closed the socket)


if __name__ == "__main__":
    # run as the module a pickled job names (pdserve.server.structured.child.check), not as __main__: the
    # tokenizer _init builds must be the one that module's jobs see
    from pdserve.server.structured import child as _module

    _module._run(Connection(int(sys.argv[1])))
