"""benchmarks.kv.stream's transfer part and its references: the bytes arrive exactly, the rows are whole."""

from __future__ import annotations

import os

import numpy as np
import pytest

from pdserve.benchmarks import ceilings
from pdserve.benchmarks.kv import push as kv_push
from pdserve.benchmarks.kv import stream as kv_stream


async def test_grpcio_with_copies_lands_every_byte_in_place_over_each_stream():
    loopback = await ceilings.GrpcLoopback(1000, streams=3, copies=10_007).start()
    try:
        assert await loopback.seconds(10_007) > 0
    finally:
        await loopback.close()
    source = loopback.client.source
    assert loopback.server.target.tobytes() == source.tobytes() and source.any()


def _check_rows(rows: list[kv_stream.TransferRow], repeats: int, receiver_cpu: bool) -> None:
    assert [r.streams for r in rows] == [1, 2]
    for r in rows:
        spreads = [r.transfer_gbps, r.raw_gbps, r.ratio, r.copies_gbps, r.copies_ratio,
                   r.transfer_cpu_s_per_gb, r.raw_cpu_s_per_gb, r.copies_cpu_s_per_gb]
        receiving = [r.transfer_receiver_cpu_s_per_gb, r.raw_receiver_cpu_s_per_gb,
                     r.copies_receiver_cpu_s_per_gb]
        if receiver_cpu:
            spreads += receiving
        else:
            assert receiving == [None] * 3
        assert [s["n"] for s in spreads] == [repeats] * len(spreads)
        assert np.isclose(r.ratio["median"], np.median([r.ratio["min"], r.ratio["max"]]))


async def test_transfer_rows_compare_each_stream_count_against_both_references_in_one_process():
    rows = await kv_stream.transfer(num_tokens=40, streams=[1, 2], repeats=2, chunk_bytes=2**16,
                                    one_process=True)
    _check_rows(rows, 2, receiver_cpu=False)


async def test_transfer_rows_with_the_receiver_in_its_own_process_count_each_sides_cpu():
    affinity = os.sched_getaffinity(0)
    rows = await kv_stream.transfer(num_tokens=40, streams=[1, 2], repeats=2, chunk_bytes=2**16)
    assert os.sched_getaffinity(0) == affinity  # the sender's pin is undone
    _check_rows(rows, 2, receiver_cpu=True)


async def test_a_transfer_that_loses_bytes_is_caught(monkeypatch):
    write = kv_push.CacheSink.write

    def write_all_but_the_first_block(self, request_id, piece):
        if piece.token_start:
            write(self, request_id, piece)

    monkeypatch.setattr(kv_push.CacheSink, "write", write_all_but_the_first_block)
    with pytest.raises(RuntimeError, match="pdserve: the bytes at the receiver differ from the bytes sent"):
        await kv_stream.transfer(num_tokens=40, streams=[1], repeats=1, chunk_bytes=2**16, one_process=True)
