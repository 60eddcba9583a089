"""benchmarks/compare.py: figures of two runs side by side, never across CPU families."""

from __future__ import annotations

import json

from pdserve.benchmarks import compare
from pdserve.benchmarks.protocol import MachineRecord


def _run(family: str | None, tokens_per_s: list[float], cap: str | None = None) -> dict:
    machine = {"cpu_model": "cpu", "cpu": {"family": family, "cap": cap} if family else {}}
    return {"machine": machine, "config": {"reps": 3},
            "results": {"pdserve": [{"decode-b1": {"tokens_per_s": t}} for t in tokens_per_s]}}


def test_runs_of_one_family_compare_by_the_median_of_their_repetitions():
    code, lines = compare.compare(_run("x86_64/avx2", [10, 12, 11]), _run("x86_64/avx2", [22, 20, 24]))
    assert code == 0
    assert lines[1].split() == ["results/pdserve/decode-b1/tokens_per_s", "11", "22", "2.000"]
    assert not any("reps" in line for line in lines)  # the config holds no figures


def test_runs_of_different_families_or_caps_are_refused_naming_both():
    code, lines = compare.compare(_run("x86_64/amx-bf16", [10]), _run("x86_64/avx2", [5]))
    assert code == 2 and "different CPU families (x86_64/amx-bf16 on cpu, x86_64/avx2 on cpu)" in lines[0]
    code, lines = compare.compare(_run(None, [10]), _run("x86_64/avx2", [5]))
    assert code == 2 and "unrecorded" in lines[0]
    code, lines = compare.compare(_run("x86_64/avx2", [10], cap="avx2"), _run("x86_64/avx2", [5]))
    assert code == 2 and "PDSERVE_CPU_ISA" in lines[0]
    code, lines = compare.compare(_run("x86_64/amx-bf16", [10]), _run("x86_64/avx2", [5]), across_families=True)
    assert code == 0 and lines[1].endswith("[across families: x86_64/amx-bf16 -> x86_64/avx2]")


def test_the_machine_record_carries_this_cpus_family(tmp_path):
    record = MachineRecord.take().as_dict()
    assert record["cpu"]["family"].startswith(record["cpu"]["arch"])
    (tmp_path / "a.json").write_text(json.dumps({"machine": record, "results": {"x": 1.0}}))
    (tmp_path / "b.json").write_text(json.dumps({"machine": record, "results": {"x": 3.0}}))
    assert compare.main([str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
