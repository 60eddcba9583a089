"""`pdserve status --addr`: each worker's role, address, state, load and KV usage."""

from __future__ import annotations

import asyncio
import json

from pdserve.v1 import worker_pb2 as pb
from pdserve.server.client import format_status, run_status
from pdserve.server.coordinator.config import CoordinatorConfig
from pdserve.server.coordinator.main import start
from tests.coordinator.fakes import FakeDecode, FakePrefill, FakeWorker


def _status(role: str, address: str, state: str, **load) -> pb.WorkerStatus:
    return pb.WorkerStatus(role=role, address=address, state=state, registered=role == "decode", inflight=1,
                           info=pb.WorkerInfo(role=role, load=pb.WorkerLoad(**load)))


def test_format_status_one_row_per_worker():
    rows = format_status([
        _status("prefill", "10.0.0.1:50052", "ready", queued_prefill_tokens=512, running_requests=2),
        _status("decode", "10.0.0.2:50053", "draining", running_requests=3, waiting_requests=1, free_kv_blocks=750,
                total_kv_blocks=1000),
        _status("decode", "10.0.0.3:50053", "dead"),
    ]).splitlines()
    assert rows[0].split() == ["ROLE", "ADDRESS", "STATE", "JOINED", "INFLIGHT", "RUNNING", "WAITING", "QUEUED_TOK",
                               "KV_USED", "KV_USAGE", "HARDWARE"]
    assert [r.split() for r in rows[1:]] == [
        ["prefill", "10.0.0.1:50052", "ready", "flag", "1", "2", "0", "512", "-", "-", "-"],
        ["decode", "10.0.0.2:50053", "draining", "register", "1", "3", "1", "-", "250/1000", "25.0%", "-"],
        ["decode", "10.0.0.3:50053", "dead", "register", "1", "0", "0", "-", "0/0", "-", "-"],
    ]
    assert format_status([]).splitlines()[1] == "(no workers)"


def test_status_names_each_workers_cpu_family_device_and_matmul_path():
    status = _status("decode", "10.0.0.2:50053", "ready")
    status.info.hardware.CopyFrom(pb.Hardware(cpu_family="x86_64/avx2", cpu_cap="avx2", devices="cpu",
                                              paths={"matmuls": "bf16 weights -> fp32 compute"}))
    row = format_status([status]).splitlines()[1]
    assert row.endswith(" x86_64/avx2 (capped) cpu; bf16 weights -> fp32 compute")


async def test_status_lists_a_live_coordinator_pool(tiny_model, capsys):
    decode = await FakeWorker.start("decode", FakeDecode())
    prefill = await FakeWorker.start("prefill", FakePrefill())
    decode.control.load = pb.WorkerLoad(free_kv_blocks=60, total_kv_blocks=80, running_requests=2)
    coordinator = await start(CoordinatorConfig(tiny_model("llama"), port=0, prefill_addresses=[prefill.address],
                                                decode_addresses=[decode.address, "127.0.0.1:1"], refresh_seconds=0.1))
    try:
        address = f"127.0.0.1:{coordinator.port}"
        assert await asyncio.to_thread(run_status, address) == 0
        rows = [r.split() for r in capsys.readouterr().out.splitlines()[1:]]
        assert rows == [
            ["prefill", prefill.address, "ready", "flag", "0", "0", "0", "0", "-", "-", "-"],
            ["decode", "127.0.0.1:1", "dead", "flag", "0", "0", "0", "-", "0/0", "-", "-"],
            ["decode", decode.address, "ready", "flag", "0", "2", "0", "-", "20/80", "25.0%", "-"],
        ]
        assert await asyncio.to_thread(run_status, address, True) == 0
        lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert [(w["role"], w["state"]) for w in lines] == [("prefill", "ready"), ("decode", "dead"), ("decode", "ready")]
        assert await asyncio.to_thread(run_status, "127.0.0.1:1") == 1
        assert "UNAVAILABLE" in capsys.readouterr().err
    finally:
        await coordinator.stop(0)
        await prefill.stop()
        await decode.stop()
