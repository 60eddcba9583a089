"""benchmarks.engine.vllm_process's protocol, on a stand-in for `vllm_decode_rate.py --serve` (no vLLM): jobs share
one process until one ends it (`end`), dies in it, or outlives its timeout; each replaced on the next job."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from pdserve.benchmarks.engine import vllm_process
from pdserve.benchmarks.engine.vllm_decode_rate import DONE_MARK
from pdserve.benchmarks.engine.vllm_process import VllmProcess, process_for, shared_vllm

STAND_IN = textwrap.dedent(f"""
    import json, os, sys, time
    for line in sys.stdin:
        job = json.loads(line)
        bind = os.environ["VLLM_CPU_OMP_THREADS_BIND"]
        print("pid", os.getpid(), "cores", sorted(os.sched_getaffinity(0)), "bind", bind)
        print("job", *job, flush=True)
        if job[0] == "die":
            os._exit(3)
        if job[0] == "sleep":
            time.sleep(30)
        last = job[0] == "fail"
        print("{DONE_MARK}", 1 if last else 0, "end" if last else "more", flush=True)
        if last:
            sys.exit(1)
""")


@pytest.fixture
def stand_in(tmp_path) -> Path:
    script = tmp_path / "serve.py"
    script.write_text(STAND_IN)
    return script


def pid(lines: list[str]) -> int:
    return int(lines[0].split()[1])


def test_jobs_share_one_pinned_process_until_one_ends_it(stand_in):
    proc = VllmProcess(Path(sys.executable), stand_in)
    try:
        code, first = proc.run(["a", "1"])
        assert code == 0 and first[1:] == ["job a 1"]
        assert first[0].split()[2:] == ["cores", "[0]", "bind", "0"]  # pinned to core 0, its OpenMP threads too
        code, second = proc.run(["b"])
        assert (code, second[1:], pid(second)) == (0, ["job b"], pid(first))
        code, failed = proc.run(["fail"])
        assert (code, pid(failed)) == (1, pid(first)) and proc.proc is None  # ended with its failed job
        code, after = proc.run(["c"])
        assert (code, after[1:]) == (0, ["job c"]) and pid(after) != pid(first)
    finally:
        proc.close()
    assert proc.proc is None


def test_a_process_that_dies_or_hangs_in_a_job_is_replaced_on_the_next(stand_in):
    proc = VllmProcess(Path(sys.executable), stand_in)
    try:
        code, died = proc.run(["die"])
        assert code == -1 and died[1:] == ["job die", "the vLLM process exited with 3 mid-job"]
        code, started = proc.run(["d"])  # a new process, started before the timed job: its start is not timed
        assert code == 0 and pid(started) != pid(died)
        code, hung = proc.run(["sleep"], timeout=3)
        assert code == -1 and hung[-1] == "no answer within 3 s: the vLLM process was stopped" and proc.proc is None
        code, after = proc.run(["e"])
        assert code == 0 and pid(after) != pid(started)
    finally:
        proc.close()


def test_inside_shared_vllm_every_caller_gets_the_same_process(monkeypatch):
    monkeypatch.setattr(vllm_process, "_shared", None)
    with process_for() as alone_1, process_for() as alone_2:
        assert alone_1 is not alone_2
    with shared_vllm() as outer:
        with shared_vllm() as inner, process_for() as used:
            assert outer is inner is used
    assert vllm_process._shared is None
