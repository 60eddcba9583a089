"""Staging received KV for vLLM's tensor-parallel ranks: exact head slices, and no stage left behind."""

from __future__ import annotations

import pickle
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from pdserve.kvcache.codec import KvPiece
from pdserve.server.decode.vllm.staging import (
    DIR_PREFIX,
    KvStaging,
    LocalKv,
    PendingReads,
    StagedKv,
    default_root,
    kv_head_range,
    remove_dead_workers_stages,
)

LAYERS, TOKENS, HEAD_DIM = 4, 40, 8


@pytest.mark.parametrize("heads, world, ranges", [
    (2, 1, [(0, 2)]),
    (2, 2, [(0, 1), (1, 2)]),
    (8, 4, [(0, 2), (2, 4), (4, 6), (6, 8)]),
    (2, 4, [(0, 1), (0, 1), (1, 2), (1, 2)]),  # T > kv heads: each head on T/H consecutive ranks
    (1, 2, [(0, 1), (0, 1)]),
    (4, 8, [(0, 1), (0, 1), (1, 2), (1, 2), (2, 3), (2, 3), (3, 4), (3, 4)]),
])
def test_each_rank_holds_vllms_kv_heads(heads, world, ranges):
    assert [kv_head_range(heads, r, world) for r in range(world)] == ranges


@pytest.mark.parametrize("heads, world", [(3, 2), (2, 3), (4, 6)])
def test_a_split_vllm_refuses_is_refused(heads, world):
    with pytest.raises(ValueError, match=f"tensor parallel size {world}"):
        kv_head_range(heads, 0, world)


def full_kv(heads: int, dtype) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(heads)
    shape = (LAYERS, TOKENS, heads, HEAD_DIM)  # [L, S, Hkv, D]
    return rng.standard_normal(shape).astype(dtype), rng.standard_normal(shape).astype(dtype)


def pieces_of(k: np.ndarray, v: np.ndarray) -> list[KvPiece]:
    """Two layer groups x three token chunks, as the wire splits a prompt (read-only, like received ones)."""
    out = []
    for l0, l1 in ((0, 3), (3, LAYERS)):
        for t0, t1 in ((0, 16), (16, 32), (32, TOKENS)):
            pk, pv = k[l0:l1, t0:t1].copy(), v[l0:l1, t0:t1].copy()
            pk.flags.writeable = pv.flags.writeable = False
            out.append(KvPiece(l0, t0, pk, pv))
    return out


def assemble(pieces: list[KvPiece], heads: int, dtype) -> tuple[np.ndarray, np.ndarray]:
    k = np.zeros((LAYERS, TOKENS, heads, HEAD_DIM), dtype)
    v = np.zeros_like(k)
    for p in pieces:
        k[p.layer_start:p.layer_start + p.num_layers, p.token_start:p.token_start + p.num_tokens] = p.k
        v[p.layer_start:p.layer_start + p.num_layers, p.token_start:p.token_start + p.num_tokens] = p.v
    return k, v


@pytest.fixture
def staging(tmp_path):
    s = KvStaging(shared=True, root=tmp_path)
    yield s
    s.close()


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
@pytest.mark.parametrize("heads, world", [(2, 1), (2, 2), (4, 2), (2, 4), (1, 2)])
def test_every_rank_reads_exactly_its_heads_of_every_piece(staging, dtype, heads, world):
    k, v = full_kv(heads, dtype)
    pieces = pieces_of(k, v)
    stage = staging.new("req/1")  # a request id is any string: the file name quotes it
    with ThreadPoolExecutor(4) as pool:  # the receiver's write threads append at once, in any order
        list(pool.map(stage.append, reversed(pieces)))
    staged = pickle.loads(pickle.dumps(stage.seal()))  # what vLLM's broadcast gives each rank
    assert isinstance(staged, StagedKv) and staged.num_tokens == TOKENS
    assert Path(staged.path).stat().st_size == k.nbytes + v.nbytes
    local = LocalKv(tuple(pieces))
    for rank in range(world):
        start, end = kv_head_range(heads, rank, world)
        for source in (staged, local):
            got = source.read(rank, world)
            assert sorted((p.layer_start, p.token_start, p.num_layers, p.num_tokens) for p in got) == sorted(
                (p.layer_start, p.token_start, p.num_layers, p.num_tokens) for p in pieces)
            assert all(p.k.dtype == np.dtype(dtype) and p.k.shape[2] == end - start for p in got)
            got_k, got_v = assemble(got, end - start, dtype)
            assert got_k.tobytes() == k[:, :, start:end].tobytes()  # bit-exact
            assert got_v.tobytes() == v[:, :, start:end].tobytes()
    staged.release()
    assert staging.files() == []


def test_a_local_stage_reads_the_received_arrays_themselves_for_one_rank():
    k, v = full_kv(2, np.float32)
    pieces = pieces_of(k, v)
    assert all(a is b for a, b in zip(LocalKv(tuple(pieces)).read(0, 1), pieces))  # TP 1: no copy


def test_an_aborted_or_refused_stage_leaves_no_file(staging):
    k, v = full_kv(2, np.float32)
    receiving, refused = staging.new("receiving"), staging.new("refused")
    receiving.append(pieces_of(k, v)[0])
    refused.append(pieces_of(k, v)[0])
    sealed = refused.seal()
    assert len(staging.files()) == 2
    receiving.discard()  # aborted while its KV arrived
    with pytest.raises(FileNotFoundError):  # a write thread still running finds the stage gone
        receiving.append(pieces_of(k, v)[1])
    sealed.release()  # vLLM refused it, or it was aborted before it was loaded
    sealed.release()  # releasing twice (the connector and the engine may both) is harmless
    assert staging.files() == []


def test_a_stage_is_released_once_every_rank_read_it(staging):
    stage = staging.new("r")
    stage.append(pieces_of(*full_kv(2, np.float32))[0])
    staged = stage.seal()
    pending = PendingReads(world=2)
    pending.sent("r", staged)
    pending.sent("missing", None)  # nothing was staged: the ranks fail its load
    assert pending.read("r", 1) == (False, None) and staging.files() != []  # rank 1 still reads it
    assert pending.read("r", 1) == (True, staged) and staging.files() == []
    assert pending.read("r", 1) == (False, None)  # a late report of a released stage
    assert pending.read("missing", 2) == (True, None) and len(pending) == 0


def test_stages_no_rank_reported_are_released_all_at_once(staging):
    stages = []
    pending = PendingReads(world=4)
    for rid in ("a", "b"):
        stage = staging.new(rid)
        stage.append(pieces_of(*full_kv(2, np.float32))[0])
        stages.append(stage.seal())
        pending.sent(rid, stages[-1])
    pending.read("a", 3)
    assert pending.release_all() == ["a", "b"] and staging.files() == [] and len(pending) == 0


def test_closing_the_staging_removes_its_directory_with_what_is_left(tmp_path):
    staging = KvStaging(shared=True, root=tmp_path)
    staging.new("r1").append(pieces_of(*full_kv(2, np.float32))[0])
    staging.new("r2")
    assert len(staging.files()) == 2
    staging.close()
    assert list(tmp_path.iterdir()) == []


def test_a_new_worker_removes_the_stages_of_dead_workers_only(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_dir = tmp_path / f"{DIR_PREFIX}{int(dead.stdout)}-0000abcd"
    dead_dir.mkdir()
    (dead_dir / "0-r1").write_bytes(b"kv")
    other = KvStaging(shared=True, root=tmp_path)  # a live worker's directory stays
    staging = KvStaging(shared=True, root=tmp_path)
    assert not dead_dir.exists() and other.dir.exists() and staging.dir.exists()
    assert remove_dead_workers_stages(tmp_path) == []
    other.close()
    staging.close()


def test_stages_live_in_shared_memory_where_the_os_has_it():
    if Path("/dev/shm").is_dir():
        assert default_root() == Path("/dev/shm")
    staging = KvStaging(shared=True)
    try:
        assert staging.dir.parent == default_root() and staging.dir.name.startswith(DIR_PREFIX)
    finally:
        staging.close()
    assert not staging.dir.exists()
    assert KvStaging(shared=False).files() == []  # one rank: in memory, no file at all
