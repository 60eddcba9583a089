"""benchmarks.kv_stream's transfer part and its references: the bytes arrive exactly, the rows are whole."""

from __future__ import annotations

import numpy as np

from pdserve.benchmarks import ceilings, kv_stream


async def test_grpcio_with_copies_lands_every_byte_in_place_over_each_stream():
    loopback = await ceilings.GrpcLoopback(1000, streams=3, copies=10_007).start()
    try:
        assert await loopback.seconds(10_007) > 0
    finally:
        await loopback.close()
    assert loopback.server.target.tobytes() == loopback.client.source.tobytes() and loopback.client.source.any()


async def test_transfer_rows_compare_each_stream_count_against_both_references():
    rows = await kv_stream.transfer(num_tokens=40, streams=[1, 2], repeats=2, chunk_bytes=2**16)
    assert [r.streams for r in rows] == [1, 2]
    for r in rows:
        spreads = (r.transfer_gbps, r.raw_gbps, r.ratio, r.copies_gbps, r.copies_ratio,
                   r.transfer_cpu_s_per_gb, r.raw_cpu_s_per_gb, r.copies_cpu_s_per_gb)
        assert [s["n"] for s in spreads] == [2] * 8
        assert np.isclose(r.ratio["median"], np.median([r.ratio["min"], r.ratio["max"]]))
