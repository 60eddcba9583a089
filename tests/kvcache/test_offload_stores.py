"""The offload tiers: exact LRU eviction order, checksums that turn a flipped byte or a truncated file into a miss
(the file removed), a full disk as a miss, a dead writer's temporary file never read, concurrent saves of one block."""

from __future__ import annotations

import errno
import os
import threading

import numpy as np
import pytest

from pdserve.kvcache import disk_store
from pdserve.kvcache.block_bytes import BlockKv, block_nbytes, layout_fingerprint, pack_block, unpack_block
from pdserve.kvcache.disk_store import HEADER, DiskStore
from pdserve.kvcache.host_store import HostStore
from pdserve.kvcache.kv_events import KvEventRecorder
from pdserve.kvcache.layout import KvLayout
from pdserve.kvcache.tiered_store import TieredStore

FP = "0123456789abcdef" * 2


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def test_host_store_evicts_least_recently_used_first_and_records_events():
    events = KvEventRecorder("GPU", int_hashes=False)
    host = HostStore(30, events)
    for i in range(3):
        assert host.put(key(i), bytes([i]) * 10)
    assert host.get(key(0)) == b"\x00" * 10  # 0 becomes the most recently used
    assert host.put(key(3), b"\x03" * 10)  # evicts 1, the least recently used
    assert host.keys() == [key(2), key(0), key(3)]
    assert host.get(key(1)) is None and host.used_bytes == 30
    assert not host.put(key(9), b"x" * 31)  # larger than the tier: not stored, nothing evicted
    assert (host.stats.hits, host.stats.misses, host.stats.evictions, host.stats.saves) == (1, 1, 1, 4)
    kinds = [(type(e).__name__, e.block_hashes, e.medium) for e in events.pending]
    assert kinds == [("BlockStored", [key(0)], "CPU"), ("BlockStored", [key(1)], "CPU"),
                     ("BlockStored", [key(2)], "CPU"), ("BlockRemoved", [key(1)], "CPU"),
                     ("BlockStored", [key(3)], "CPU")]
    assert events.pending[0].token_ids == [] and events.pending[0].block_size == 0  # vLLM's placeholder


def test_disk_store_round_trips_and_evicts_least_recently_used_files(tmp_path):
    size = HEADER.size + 32 + 100
    disk = DiskStore(tmp_path, 3 * size, FP)
    for i in range(3):
        assert disk.put(key(i), bytes([i]) * 100)
    assert disk.get(key(0)) == b"\x00" * 100
    assert disk.put(key(3), b"\x03" * 100)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{FP}-{key(i).hex()}.kvb" for i in (0, 2, 3))
    assert disk.used_bytes == 3 * size
    reopened = DiskStore(tmp_path, 3 * size, FP)  # a restarted worker finds its files
    assert reopened.get(key(3)) == b"\x03" * 100 and reopened.used_bytes == 3 * size
    assert DiskStore(tmp_path, 0, "f" * 32).get(key(3)) is None  # another layout's name: never read


def test_a_flipped_byte_is_a_miss_and_the_file_is_removed(tmp_path):
    disk = DiskStore(tmp_path, 0, FP)
    disk.put(key(1), bytes(range(200)))
    path = disk.file_for(key(1))
    raw = bytearray(path.read_bytes())
    raw[-7] ^= 0x10
    path.write_bytes(bytes(raw))
    assert disk.get(key(1)) is None
    assert not path.exists() and not disk.contains(key(1)) and disk.stats.rejected == 1


def test_a_truncated_file_is_a_miss_and_is_removed(tmp_path):
    disk = DiskStore(tmp_path, 0, FP)
    disk.put(key(1), bytes(range(200)))
    path = disk.file_for(key(1))
    path.write_bytes(path.read_bytes()[:150])
    assert disk.get(key(1)) is None and not path.exists() and disk.used_bytes == 0
    path.write_bytes(b"pdKV")  # shorter than a header
    assert disk.get(key(1)) is None and not path.exists()


def test_a_full_disk_is_a_miss_and_leaves_no_file(tmp_path, monkeypatch, caplog):
    disk = DiskStore(tmp_path, 0, FP)
    real_write = os.write

    def half_then_enospc(fd, data):
        if len(data) > 64:
            return real_write(fd, bytes(data[:64]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_store.os, "write", half_then_enospc)
    assert not disk.put(key(1), b"y" * 500)
    assert list(tmp_path.iterdir()) == [] and disk.stats.save_errors == 1
    assert "the disk is full" in caplog.text
    assert disk.get(key(1)) is None
    monkeypatch.setattr(disk_store.os, "write", real_write)
    assert disk.put(key(1), b"y" * 500) and disk.get(key(1)) == b"y" * 500  # space again: saved


def test_a_writer_killed_mid_save_leaves_a_temporary_file_no_read_opens(tmp_path):
    disk = DiskStore(tmp_path, 0, FP)
    final = disk.file_for(key(5))
    partial = final.with_name(f".{final.name}.4242.deadbeef.tmp")
    partial.write_bytes(b"pdKVblk1" + b"\x00" * 20)  # what a killed writer left
    assert not disk.contains(key(5)) and disk.get(key(5)) is None
    old = os.stat(partial).st_mtime - disk_store.STALE_TMP_S - 1
    os.utime(partial, (old, old))
    DiskStore(tmp_path, 0, FP)  # the next start deletes a dead writer's temporary file
    assert not partial.exists()


def test_concurrent_saves_of_one_block_leave_one_whole_file(tmp_path):
    stores = [DiskStore(tmp_path, 0, FP) for _ in range(4)]  # four workers sharing the directory
    data = os.urandom(4096)
    barrier = threading.Barrier(8)

    def save(store):
        barrier.wait()
        for _ in range(20):
            store.put(key(7), data)
            stores[0].evict(key(7)) if store is stores[1] else None

    threads = [threading.Thread(target=save, args=(stores[i % 4],)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stores[2].put(key(7), data)
    assert [s.get(key(7)) for s in stores] == [data] * 4
    assert [p.name for p in tmp_path.iterdir()] == [stores[0].file_for(key(7)).name]  # no temporary file left
    assert sum(s.stats.rejected for s in stores) == 0


def test_tiered_store_loads_from_the_first_tier_and_promotes(tmp_path):
    host = HostStore(1000)
    disk = DiskStore(tmp_path / "disk", 0, FP)
    shared = DiskStore(tmp_path / "shared", 0, FP, name="shared", locality="REMOTE")
    store = TieredStore([host, disk, shared])
    for i in range(3):
        assert store.save(key(i), bytes([i]) * 10)
    assert store.wait_saved(5)
    assert [t.contains(key(2)) for t in (host, disk, shared)] == [True, True, True]  # written through
    host.evict(key(1))
    disk.evict(key(1))
    other = DiskStore(tmp_path / "shared", 0, FP, name="shared")  # another worker's view of the shared directory
    other.put(key(9), b"z" * 10)
    assert store.held_prefix([key(0), key(1), key(9), key(4)]) == 3
    assert store.load([key(0), key(1), key(9), key(4), key(2)]) == [b"\x00" * 10, b"\x01" * 10, b"z" * 10]
    assert host.contains(key(1)) and host.contains(key(9))  # promoted
    assert (host.stats.hits, disk.stats.hits, shared.stats.hits) == (1, 0, 2)
    store.close()


def test_saves_past_the_queue_are_dropped_and_counted():
    host = HostStore(1 << 20)
    gate = threading.Event()
    real_put = host.put
    host.put = lambda k, d: (gate.wait(), real_put(k, d))[1]
    store = TieredStore([host], max_pending_saves=2)
    assert [store.save(key(i), b"a") for i in range(4)] == [True, True, False, False]
    assert store.save_drops == 2
    gate.set()
    assert store.wait_saved(5) and host.keys() == [key(0), key(1)]
    store.close()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_a_block_packs_to_its_exact_bytes_and_back(dtype):
    layout = KvLayout.of(2, 2, 4, 4, dtype)
    rng = np.random.default_rng(0)
    shape = (2, 4, 2, 4)
    k = rng.standard_normal(shape).astype(layout.np_dtype) if dtype != "int8" else rng.integers(-9, 9, shape, np.int8)
    v = (k * 2).astype(layout.np_dtype)
    scales = (rng.random((2, 2), np.float32), rng.random((2, 2), np.float32)) if dtype == "int8" else (None, None)
    data = pack_block(layout, BlockKv(k, v, *scales))
    assert len(data) == block_nbytes(layout) == 2 * k.nbytes + (32 if dtype == "int8" else 0)
    back = unpack_block(layout, data)
    assert back.k.tobytes() == k.tobytes() and back.v.tobytes() == v.tobytes()
    if dtype == "int8":
        assert back.k_scales.tobytes() == scales[0].tobytes() and back.v_scales.tobytes() == scales[1].tobytes()
    with pytest.raises(ValueError, match="not one block"):
        unpack_block(layout, data[:-1])


def test_the_layout_fingerprint_tells_models_dtypes_and_block_sizes_apart():
    base = KvLayout.of(2, 2, 4, 16, "float32")
    names = {layout_fingerprint(base, "m1"), layout_fingerprint(base, "m2"),
             layout_fingerprint(KvLayout.of(2, 2, 4, 32, "float32"), "m1"),
             layout_fingerprint(KvLayout.of(2, 2, 4, 16, "int8"), "m1")}
    assert len(names) == 4 and layout_fingerprint(base, "m1") == layout_fingerprint(base, "m1")
