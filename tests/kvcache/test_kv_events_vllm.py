"""vLLM 0.32 itself is the oracle (in .venv-vllm): its `KVEventBatch` msgspec decoder reads the batches pdserve
publishes, and its `hash_block_tokens` names blocks as pdserve's prefix caches do, for both sha256 algorithms,
with PYTHONHASHSEED set and unset."""

from __future__ import annotations

import json
import os

import pytest

from pdserve.kvcache.block_hash import BlockHasher
from pdserve.kvcache.block_pool import BlockPool
from pdserve.kvcache.kv_event_publisher import ZmqEventPublisher
from pdserve.kvcache.kv_events import MEDIUM_GPU, KvEventRecorder
from pdserve.kvcache.kv_events_config import KvEventsConfig
from pdserve.kvcache.prefix_cache import PrefixCache

from tests.kvcache.kv_events_helpers import Subscriber
from tests.vllm_python import require_vllm_python
from tests.vllm_scripts import run_vllm_script

require_vllm_python()

ORACLE = r"""
import json, os, sys
import msgspec
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils as u

req = json.load(sys.stdin)
out = {"batches": [], "hashes": {}}
decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
for payload in req["payloads"]:
    batch = decoder.decode(bytes.fromhex(payload))
    out["batches"].append({"rank": batch.data_parallel_rank, "events": [
        {"class": type(e).__name__, **msgspec.to_builtins(e)} for e in batch.events]})
tokens, bs = req["tokens"], req["block_size"]
for seed in (req["seed"], None):
    if seed is None:
        os.environ.pop("PYTHONHASHSEED", None)
    else:
        os.environ["PYTHONHASHSEED"] = seed
    for algo in ("sha256", "sha256_cbor"):
        fn = get_hash_fn_by_name(algo)
        u.init_none_hash(fn)
        parent, chain = None, []
        for i in range(len(tokens) // bs):
            parent = u.hash_block_tokens(fn, parent, tokens[i * bs : (i + 1) * bs])
            chain.append(parent.hex())
        out["hashes"][f"{algo}/{seed}"] = chain
print("ORACLE " + json.dumps(out))
"""


def _vllm(request: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    run = run_vllm_script(code=ORACLE, stdin=json.dumps(request), env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    line = [x for x in run.stdout.splitlines() if x.startswith("ORACLE ")][-1]
    return json.loads(line.removeprefix("ORACLE "))


def test_vllm_decodes_pdserves_stream_and_hashes_blocks_alike(monkeypatch):
    tokens, bs = list(range(7, 7 + 3 * 16 + 5)), 16
    sub = Subscriber()
    publisher = ZmqEventPublisher(KvEventsConfig(enable_kv_cache_events=True, endpoint=sub.endpoint), topic="kv")
    try:
        sub.sync(publisher)
        recorder = KvEventRecorder(MEDIUM_GPU, publisher)
        cache = PrefixCache(BlockPool(3), hasher=BlockHasher("sha256"), events=recorder)
        hashes = cache.hasher.hashes(tokens, bs)
        table = cache.allocate(3)
        cache.register(table, hashes, tokens[: 3 * bs])
        cache.free(table)
        recorder.flush()
        cache.evict(1)
        cache.clear()  # two evicted one by one first: the cache is then empty, AllBlocksCleared
        recorder.flush()
        payloads = [sub.frames()[2].hex() for _ in range(2)]
    finally:
        publisher.close()
        sub.close()
    seed = "1234"
    oracle = _vllm({"payloads": payloads, "tokens": tokens, "block_size": bs, "seed": seed})
    wire = [int.from_bytes(h, "big") & ((1 << 64) - 1) for h in hashes]
    stored = {"class": "BlockStored", "type": "BlockStored", "block_hashes": wire, "parent_block_hash": None,
              "token_ids": tokens[: 3 * bs], "block_size": bs, "lora_id": None, "medium": "GPU", "lora_name": None,
              "group_idx": 0}
    assert oracle["batches"][0] == {"rank": 0, "events": [stored]}
    assert oracle["batches"][1] == {"rank": 0, "events": [
        {"class": "BlockRemoved", "type": "BlockRemoved", "block_hashes": [wire[0]], "medium": "GPU", "group_idx": 0},
        {"class": "AllBlocksCleared", "type": "AllBlocksCleared"}]}
    for algo in ("sha256", "sha256_cbor"):
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
        assert [h.hex() for h in BlockHasher(algo).hashes(tokens, bs)] == oracle["hashes"][f"{algo}/None"]
        monkeypatch.setenv("PYTHONHASHSEED", seed)
        assert [h.hex() for h in BlockHasher(algo).hashes(tokens, bs)] == oracle["hashes"][f"{algo}/{seed}"]
    assert oracle["hashes"]["sha256/None"] == [h.hex() for h in hashes]  # the default cache's names: vLLM's default


@pytest.fixture(autouse=True)
def _no_seed(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
