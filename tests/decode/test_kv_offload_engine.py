"""The decode engine over offload tiers: a prompt whose blocks the device cache evicted is served again from the
host tier (its KV loaded, not computed) with transformers' greedy tokens; a truncated file, a full disk and a worker
killed mid-save cost only misses; a prefill worker's prefix KV and a decode worker share blocks through the shared
directory, both ways; a conversation's tail the device cache dropped comes back from the host tier (its KV that
transformers computes), and one lost or corrupt there is computed again."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import torch

from pdserve.kvcache import disk_store
from pdserve.kvcache.block_bytes import layout_fingerprint, unpack_block
from pdserve.kvcache.block_hash import DEFAULT_HASHER
from pdserve.kvcache.disk_store import DiskStore
from pdserve.kvcache.host_store import HostStore
from pdserve.kvcache.layout import KvLayout
from pdserve.kvcache.tail_cache import TAIL_KEY_PREFIX, is_tail_key
from pdserve.kvcache.tiered_store import TieredStore
from pdserve.server.model.config import load_config
from pdserve.server.model.fingerprint import fingerprint
from pdserve.server.prefill.prefix_kv import PrefixKv

from tests.decode.test_engine import _admit, _all_back, _drain, _engine, _hf_greedy, _request

BS = 4
FIRST = list(range(3, 14))  # 11 tokens: 2 full blocks the prefix cache may reuse
OTHER = list(range(50, 78))  # 28 tokens: with 8 blocks in all, FIRST's cached blocks are evicted for these


def _fp(path) -> str:
    config = load_config(path)
    return layout_fingerprint(KvLayout.of(config.num_layers, config.num_kv_heads, config.head_dim, BS, "float32"),
                              fingerprint(path, config))


async def _serve(engine, rid: str, prompt: list[int], n: int):
    seq = await _admit(engine, rid, prompt, n)
    return seq, [seq.output_ids[0], *await _drain(seq)]


async def _evict_first(engine) -> None:
    """Serves FIRST, then OTHER (whose blocks evict FIRST's from the device cache), and waits for the saves."""
    await _serve(engine, "first", FIRST, 3)
    await _serve(engine, "other", OTHER, 2)
    assert engine.offload.store.wait_saved(10)
    assert not engine.scheduler.cache.lookup(DEFAULT_HASHER.hashes(FIRST, BS)[:1])


async def test_an_evicted_prompt_is_served_from_the_host_tier_with_the_same_tokens(tiny_model):
    path = tiny_model("llama")
    host = HostStore(1 << 20)
    engine = _engine(path, num_blocks=8, block_size=BS, offload=TieredStore([host]))
    try:
        await _evict_first(engine)
        assert len(host.keys()) >= 2
        seq, tokens = await _serve(engine, "again", FIRST, 6)
        assert (seq.num_hit_blocks, host.stats.hits) == (2, 2)  # both blocks loaded, none computed
        assert tokens == _hf_greedy(path, FIRST, 6)
        assert _all_back(engine)
    finally:
        await engine.close()


async def test_a_truncated_file_in_the_disk_tier_is_a_miss_and_the_tokens_stay_the_same(tiny_model, tmp_path):
    path = tiny_model("llama")
    disk = DiskStore(tmp_path, 1 << 20, _fp(path))
    engine = _engine(path, num_blocks=8, block_size=BS, offload=TieredStore([disk]))
    try:
        await _evict_first(engine)
        second = disk.file_for(DEFAULT_HASHER.hashes(FIRST, BS)[1])
        second.write_bytes(second.read_bytes()[:-100])
        seq, tokens = await _serve(engine, "again", FIRST, 6)
        assert seq.num_hit_blocks == 1 and disk.stats.rejected == 1 and not second.exists()
        assert tokens == _hf_greedy(path, FIRST, 6)
    finally:
        await engine.close()


async def test_a_full_disk_costs_only_misses(tiny_model, tmp_path, monkeypatch):
    path = tiny_model("llama")

    def enospc(fd, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(disk_store.os, "write", enospc)
    disk = DiskStore(tmp_path, 1 << 20, _fp(path))
    engine = _engine(path, num_blocks=8, block_size=BS, offload=TieredStore([disk]))
    try:
        await _evict_first(engine)
        assert disk.stats.save_errors >= 2 and list(tmp_path.iterdir()) == []
        seq, tokens = await _serve(engine, "again", FIRST, 6)
        assert seq.num_hit_blocks == 0
        assert tokens == _hf_greedy(path, FIRST, 6)
    finally:
        await engine.close()


KILLED_WRITER = textwrap.dedent("""
    import os, signal, sys
    from pdserve.kvcache import disk_store
    from pdserve.kvcache.disk_store import DiskStore
    real = os.write
    def half_then_die(fd, data):
        real(fd, bytes(data[: len(data) // 2]))
        os.kill(os.getpid(), signal.SIGKILL)
    disk_store.os.write = half_then_die
    DiskStore(sys.argv[1], 1 << 20, sys.argv[2]).put(bytes.fromhex(sys.argv[3]), b"x" * int(sys.argv[4]))
""")


async def test_a_worker_killed_mid_save_costs_only_a_miss(tiny_model, tmp_path):
    path = tiny_model("llama")
    fp = _fp(path)
    first_block = DEFAULT_HASHER.hashes(FIRST, BS)[0]
    config = load_config(path)
    nbytes = 2 * config.num_layers * BS * config.num_kv_heads * config.head_dim * 4
    done = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(tmp_path), fp, first_block.hex(), str(nbytes)],
                          timeout=120)
    assert done.returncode == -9
    assert [p.name.endswith(".tmp") for p in tmp_path.iterdir()] == [True]  # its half-written temporary file
    disk = DiskStore(tmp_path, 1 << 20, fp)
    engine = _engine(path, num_blocks=8, block_size=BS, offload=TieredStore([disk]))
    try:
        seq, tokens = await _serve(engine, "first", FIRST, 6)
        assert seq.num_hit_blocks == 0 and disk.stats.rejected == 0
        assert tokens == _hf_greedy(path, FIRST, 6)
    finally:
        await engine.close()


def _hf_kv(path, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """transformers' K (post-RoPE) and V of the prompt, [L, n, Hkv, D] float32."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        cache = hf(torch.tensor([ids]), use_cache=True).past_key_values
    layers = [(layer.keys, layer.values) for layer in cache.layers]
    k = np.stack([kk[0].transpose(0, 1).numpy() for kk, _ in layers])  # [L, n, Hkv, D]
    v = np.stack([vv[0].transpose(0, 1).numpy() for _, vv in layers])
    return k, v


def _prefix_kv(path, shared, blocks: int = 3) -> PrefixKv:
    config = load_config(path)
    block = 2 * config.num_layers * BS * config.num_kv_heads * config.head_dim * 4
    return PrefixKv(num_layers=config.num_layers, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                    dtype=np.float32, budget_bytes=blocks * block, block_size=BS, offload=TieredStore([shared]))


async def test_a_decode_worker_loads_what_a_prefill_worker_saved_to_the_shared_directory(tiny_model, tmp_path):
    path = tiny_model("llama")
    prefill = _prefix_kv(path, DiskStore(tmp_path, 0, _fp(path), name="shared", locality="REMOTE"))
    k, v = _hf_kv(path, FIRST)
    prefill.store(FIRST, k, v)
    prefill.store(OTHER[:13], *_hf_kv(path, OTHER[:13]))  # 3 blocks: FIRST's 2 evicted, saved to the shared tier
    assert prefill.offload.wait_saved(10) and len(list(tmp_path.iterdir())) == 2
    shared = DiskStore(tmp_path, 0, _fp(path), name="shared", locality="REMOTE")  # the decode worker's view
    engine = _engine(path, num_blocks=8, block_size=BS, offload=TieredStore([HostStore(1 << 20), shared]))
    try:
        seq, tokens = await _serve(engine, "first", FIRST, 6)
        assert seq.num_hit_blocks == 2 and shared.stats.hits == 2
        assert tokens == _hf_greedy(path, FIRST, 6)
    finally:
        await engine.close()
        prefill.offload.close()


async def test_a_prefill_worker_loads_what_a_decode_worker_saved_to_the_shared_directory(tiny_model, tmp_path):
    path = tiny_model("llama")
    shared = DiskStore(tmp_path, 0, _fp(path), name="shared", locality="REMOTE")
    engine = _engine(path, num_blocks=8, block_size=BS, offload=TieredStore([shared]))
    try:
        await _evict_first(engine)
    finally:
        await engine.close()
    # a prefix KV of one block: the prompt's second block is loaded for this prompt, not kept
    prefill = _prefix_kv(path, DiskStore(tmp_path, 0, _fp(path), name="shared", locality="REMOTE"), blocks=1)
    try:
        assert prefill.lookup(FIRST) is None
        fetched = await prefill.fetch(FIRST)
        assert (fetched.start, len(fetched.blocks), prefill.cache.num_cached) == (0, 2, 1)
        k, v = prefill.lookup(FIRST, fetched=fetched)
        hk, hv = _hf_kv(path, FIRST)
        assert k.shape == (hk.shape[0], 8, *hk.shape[2:])
        np.testing.assert_allclose(k, hk[:, :8], atol=1e-4)
        np.testing.assert_allclose(v, hv[:, :8], atol=1e-4)
    finally:
        prefill.offload.close()



async def _next_turn(engine, damage=lambda: None):
    """Serves FIRST (3 answer tokens: KV for 13 tokens, 3 full blocks and a 1-token tail), then OTHER (which takes
    every block: the tail and the full blocks are saved to the tiers), `damage()`, then the conversation's next
    turn (FIRST, the answer, 3 new tokens) computed here: the turn, the tokens cached at its admission, the KV of
    its 4th block then (the tail's slot first), its prompt and its tokens."""
    _, answer = await _serve(engine, "first", FIRST, 3)
    await _serve(engine, "other", OTHER, 2)
    assert engine.offload.store.wait_saved(10) and engine.offload.tails_saved >= 1  # FIRST's tail among them
    damage()
    prompt = FIRST + answer + [90, 91, 92]
    seq = engine.add(_request("turn2", prompt, 4))
    await seq.admitted
    cached = seq.num_cached_tokens
    kv = unpack_block(engine.cache.layout, engine.cache.block_bytes([seq.block_table[3]])[0])
    engine.start(seq, await engine.prefill_locally(seq))
    return seq, cached, kv, prompt, [seq.output_ids[0], *await _drain(seq)]


async def test_a_dropped_tail_comes_back_from_the_host_tier_with_transformers_kv_and_tokens(tiny_model):
    path = tiny_model("llama")
    engine = _engine(path, num_blocks=8, block_size=BS, offload=TieredStore([host := HostStore(1 << 20)]))
    try:
        seq, cached, kv, prompt, tokens = await _next_turn(engine)
        assert any(is_tail_key(k) for k in host.keys())
        assert (seq.num_hit_blocks, cached, engine.offload.tails_loaded) == (3, 13, 1)  # 13: 3 blocks and the tail
        hk, hv = _hf_kv(path, prompt)  # the tail's KV as loaded: what transformers computes at position 12
        np.testing.assert_allclose(kv.k[:, :1], hk[:, 12:13], atol=1e-4)
        np.testing.assert_allclose(kv.v[:, :1], hv[:, 12:13], atol=1e-4)
        assert tokens == _hf_greedy(path, prompt, 4)
        assert _all_back(engine)
    finally:
        await engine.close()


async def test_a_tail_lost_from_the_host_tier_or_corrupt_on_disk_is_computed_again(tiny_model, tmp_path):
    path = tiny_model("llama")
    host = HostStore(1 << 20)
    engine = _engine(path, num_blocks=8, block_size=BS, offload=TieredStore([host]))
    real_get = host.get
    host.get = lambda key: None if is_tail_key(key) else real_get(key)  # held at admission, gone when loaded
    try:
        seq, cached, _, prompt, tokens = await _next_turn(engine)
        assert (seq.num_hit_blocks, cached, engine.offload.tails_loaded) == (3, 12, 0)
        assert tokens == _hf_greedy(path, prompt, 4)
    finally:
        await engine.close()
    disk = DiskStore(tmp_path, 1 << 20, _fp(path))
    engine = _engine(path, num_blocks=8, block_size=BS, offload=TieredStore([disk]))

    def truncate_tails():
        tails = [f for f in tmp_path.iterdir() if TAIL_KEY_PREFIX.hex() in f.name]
        assert tails
        for f in tails:
            f.write_bytes(f.read_bytes()[:-100])

    try:
        seq, cached, _, prompt, tokens = await _next_turn(engine, truncate_tails)
        assert (seq.num_hit_blocks, cached, engine.offload.tails_loaded, disk.stats.rejected) == (3, 12, 0, 1)
        assert tokens == _hf_greedy(path, prompt, 4)
    finally:
        await engine.close()
