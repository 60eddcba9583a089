"""The benchmark protocol: run order, spreads, the load gate, the machine record, the side-by-side table."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve.benchmarks import protocol
from pdserve.benchmarks.load.side_by_side import PER_CORE_ROWS, ROWS, table


def test_schedule_alternates_and_rotates():
    assert protocol.schedule(["a", "b"], 3) == [(0, "a"), (0, "b"), (1, "b"), (1, "a"), (2, "a"), (2, "b")]
    assert protocol.schedule(["a", "b", "c"], 2) == [(0, "a"), (0, "b"), (0, "c"), (1, "b"), (1, "c"), (1, "a")]


def test_spread_and_format():
    assert protocol.spread([3.0, None, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert protocol.spread([None]) is None
    assert protocol.fmt_spread(protocol.spread([0.31, 0.29, 0.35])) == "0.31 [0.29-0.35]"
    assert protocol.fmt_spread(protocol.spread([1234.0])) == "1234"
    assert protocol.fmt_spread(None) == "-"


def _record(load: float) -> protocol.MachineRecord:
    return protocol.MachineRecord(cores=2, cpu_model="x", memory_gib=24.0, python="3.11", packages={},
                                  load_before=[load, load, load], busy_before=[{"pid": 7, "cpu_percent": 99.0,
                                                                                "cmd": "/usr/bin/python -m pytest"}])


def test_gate_refuses_a_busy_machine_naming_what_is_busy():
    with pytest.raises(SystemExit) as e:
        protocol.gate(_record(5.2), 2.0, allow_noisy=False)
    assert "5.2 > 2.0" in str(e.value) and "pytest" in str(e.value) and "--allow-noisy" in str(e.value)
    noisy = _record(5.2)
    protocol.gate(noisy, 2.0, allow_noisy=True)
    assert noisy.status == "noisy"
    quiet = _record(0.4)
    protocol.gate(quiet, 2.0, allow_noisy=False)
    assert quiet.status == "quiet" and "**quiet**" in quiet.markdown()


def test_busy_processes_sees_a_spinning_child():
    child = subprocess.Popen([sys.executable, "-c", "import time\nt=time.time()\nwhile time.time()-t<20: pass"])
    try:
        busy = protocol.busy_processes(interval=1.0, min_cpu_percent=5.0)
        assert child.pid in [b["pid"] for b in busy]
    finally:
        child.kill()
        child.wait()


def test_load_monitor_samples_and_record_finishes():
    record = protocol.MachineRecord.take()
    with protocol.LoadMonitor(period=0.05) as monitor:
        import time

        time.sleep(0.2)
    record.finish(monitor)
    assert len(record.load_during) >= 2 and len(record.load_after) == 3
    assert record.cores >= 1 and "torch" in record.packages


def test_table_medians_and_per_repetition_ratios():
    results = {
        "vllm": [{"steady": {"output_throughput": 40.0}}, {"steady": {"output_throughput": 50.0}},
                 {"steady": {"output_throughput": 45.0}}],
        "pdserve": [{"steady": {"output_throughput": 20.0}}, {"steady": {"output_throughput": 20.0}},
                    {"steady": {"output_throughput": 27.0}}],
    }
    text = table(results, ROWS, ["vllm", "pdserve"])
    lines = text.splitlines()
    assert lines[0] == "| metric | vllm | pdserve | pdserve / vllm |"
    assert lines[2] == "| output throughput (tok/s) | 45.0 [40.0-50.0] | 20.0 [20.0-27.0] | 0.5 [0.4-0.6] |"
    assert len(lines) == 3  # rows with no figure anywhere are left out
    per_core = {"pdserve": [{"decode-b1": {"tokens_per_s": 10.0}}], "vllm-1core": [{"decode-b1": {"tokens_per_s": 20.0}}]}
    assert "| decode batch 1 (tok/s) | 20.0 | 10.0 | 0.5 |" in table(per_core, PER_CORE_ROWS, ["vllm-1core", "pdserve"])
