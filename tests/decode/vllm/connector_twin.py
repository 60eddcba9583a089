"""pdserve's vLLM connector with two tensor-parallel ranks, in one process: run with .venv-vllm's python.

Not a pytest module (.venv-vllm has no pytest): `test_connector.py` runs it and reads its last line.
It drives the connector's real scheduler side and two real worker sides (rank 0 and 1 of 2) the way
vLLM does each step: schedule -> build_connector_meta -> (pickled to each rank) start_load_kv ->
build_connector_worker_meta -> KVOutputAggregator over the ranks -> update_connector_output. The
attention layers are twins whose `do_kv_cache_update` writes into a [2, slots, heads, D] tensor, so the
test reads back exactly what each rank's cache holds.
"""

from __future__ import annotations

import pickle
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import vllm.distributed
from prometheus_client import REGISTRY
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

from pdserve.kvcache.codec import KvPiece
from pdserve.server.decode.vllm import connector as vllm_connector
from pdserve.server.decode.vllm.connector import PARAMS_KEY, STAGED, PdserveConnector
from pdserve.server.decode.vllm.staging import KvStaging

LAYERS, HEADS, HEAD_DIM, BLOCK, SLOTS, WORLD = 2, 2, 4, 4, 64, 2


class TwinImpl:
    """An attention impl whose cache update writes K and V at their slots: cache [2, slots, heads, D]."""

    num_kv_heads = HEADS // WORLD
    fail = False

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        if self.fail:
            raise RuntimeError("this rank's cache update fails")
        kv_cache[0, slot_mapping] = key
        kv_cache[1, slot_mapping] = value


def twin_layer(impl: TwinImpl):
    backend = SimpleNamespace(forward_includes_kv_cache_update=False, get_name=lambda: "TWIN")
    return SimpleNamespace(attn_backend=backend, impl=impl)


def vllm_config(layers: dict):
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_role="kv_consumer"),
        cache_config=SimpleNamespace(block_size=BLOCK),
        parallel_config=SimpleNamespace(world_size=WORLD, tensor_parallel_size=WORLD),
        model_config=SimpleNamespace(dtype=torch.float32),
        compilation_config=SimpleNamespace(static_forward_context=layers),
    )


class Rank:
    """One tensor-parallel rank's worker-side connector and its KV cache."""

    def __init__(self, rank: int, kv_cache_config=None):
        self.impl = TwinImpl()
        names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
        self.connector = PdserveConnector(vllm_config({n: twin_layer(self.impl) for n in names}),
                                          KVConnectorRole.WORKER, kv_cache_config)
        self.caches = {n: torch.zeros(2, SLOTS, HEADS // WORLD, HEAD_DIM) for n in names}
        vllm.distributed.get_tensor_model_parallel_rank = lambda: rank
        self.connector.register_kv_caches(self.caches)

    def step(self, meta) -> ModelRunnerOutput:
        self.connector.bind_connector_metadata(pickle.loads(pickle.dumps(meta)))  # vLLM's broadcast
        self.connector.start_load_kv(None)
        out = KVConnectorOutput(invalid_block_ids=self.connector.get_block_ids_with_load_errors(),
                                kv_connector_worker_meta=self.connector.build_connector_worker_meta())
        self.connector.clear_connector_metadata()
        return ModelRunnerOutput(req_ids=[], req_id_to_index={}, kv_connector_output=out)

    def kv_at(self, slots: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """[L, n, heads of this rank, D] as the cache holds them."""
        caches = [self.caches[f"model.layers.{i}.self_attn.attn"] for i in range(LAYERS)]
        return (np.stack([c[0, slots].numpy() for c in caches]), np.stack([c[1, slots].numpy() for c in caches]))


def counter(name: str) -> float:
    return sum(s.value for f in REGISTRY.collect() for s in f.samples if s.name == name)


def request(vllm_id: str, num_tokens: int):
    # the prompt plus pdserve's first token: vLLM computes that one's KV itself
    return SimpleNamespace(request_id=f"{vllm_id}-vllm", prompt_token_ids=list(range(num_tokens + 1)),
                           kv_transfer_params={PARAMS_KEY: vllm_id})


def stage(staging: KvStaging, vllm_id: str, k: np.ndarray, v: np.ndarray) -> None:
    s = staging.new(vllm_id)
    for t0 in range(0, k.shape[1], 5):  # pieces of 5 tokens, as a stream would send them
        s.append(KvPiece(0, t0, k[:, t0:t0 + 5].copy(), v[:, t0:t0 + 5].copy()))
    STAGED[vllm_id] = s.seal()


def schedule(scheduler: PdserveConnector, req, block_ids: list[int], *more_groups: list[int]):
    assert scheduler.get_num_new_matched_tokens(req, 0) == (len(req.prompt_token_ids) - 1, False)
    scheduler.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (block_ids, *more_groups)),
                                       len(req.prompt_token_ids) - 1)
    return scheduler.build_connector_meta(None)


def step(scheduler: PdserveConnector, ranks: list[Rank], meta, aggregator: KVOutputAggregator) -> KVConnectorOutput:
    out = aggregator.aggregate([r.step(meta) for r in ranks]).kv_connector_output
    scheduler.update_connector_output(out)
    return out


def slots_of(block_ids: list[int], num_tokens: int) -> list[int]:
    return [block_ids[t // BLOCK] * BLOCK + t % BLOCK for t in range(num_tokens)]


def main() -> int:
    root = Path(tempfile.mkdtemp())
    staging = KvStaging(shared=True, root=root)
    scheduler = PdserveConnector(vllm_config({}), KVConnectorRole.SCHEDULER)
    ranks = [Rank(0), Rank(1)]
    aggregator = KVOutputAggregator(WORLD)
    rng = np.random.default_rng(0)
    checks = 0

    # 1. each rank writes exactly its kv head of every token, and the stage goes once both read it
    n = 13
    k = rng.standard_normal((LAYERS, n, HEADS, HEAD_DIM)).astype(np.float32)
    v = rng.standard_normal((LAYERS, n, HEADS, HEAD_DIM)).astype(np.float32)
    stage(staging, "a", k, v)
    loaded = counter("pdserve_vllm_kv_tokens_loaded_total")
    blocks = [7, 2, 11, 5]
    out = step(scheduler, ranks, schedule(scheduler, request("a", n), blocks), aggregator)
    for r, rank in enumerate(ranks):
        got_k, got_v = rank.kv_at(slots_of(blocks, n))
        assert got_k.tobytes() == k[:, :, r:r + 1].tobytes(), f"rank {r}'s K"
        assert got_v.tobytes() == v[:, :, r:r + 1].tobytes(), f"rank {r}'s V"
    assert out.kv_connector_worker_meta.reads == {"a": 2} and not out.invalid_block_ids
    assert staging.files() == [] and STAGED == {} and len(scheduler._pending) == 0
    assert counter("pdserve_vllm_kv_tokens_loaded_total") - loaded == n
    checks += 1

    # 2. a rank that cannot write reports the request's blocks (vLLM recomputes them); the stage still goes
    stage(staging, "b", k, v)
    failures = counter("pdserve_vllm_kv_load_failures_total")
    ranks[1].impl.fail = True
    out = step(scheduler, ranks, schedule(scheduler, request("b", n), [3, 4, 6, 8]), aggregator)
    ranks[1].impl.fail = False
    assert out.invalid_block_ids == {3, 4, 6, 8} and out.kv_connector_worker_meta.failed == {"b"}
    assert staging.files() == [] and counter("pdserve_vllm_kv_load_failures_total") - failures == 1
    checks += 1

    # 3. a request finished (aborted) before vLLM gave it blocks releases its stage
    stage(staging, "c", k, v)
    assert len(staging.files()) == 1
    scheduler.request_finished(request("c", n), [])
    assert staging.files() == [] and STAGED == {}
    checks += 1

    # 4. nothing staged (the engine lost it): every rank fails the load, vLLM recomputes it
    out = step(scheduler, ranks, schedule(scheduler, request("d", n), [9, 10, 12, 13]), aggregator)
    assert out.invalid_block_ids == {9, 10, 12, 13} and out.kv_connector_worker_meta.failed == {"d"}
    assert counter("pdserve_vllm_kv_load_failures_total") - failures == 2
    checks += 1

    # 5. a step whose reports never came back: the next schedule releases what it sent
    stage(staging, "e", k, v)
    schedule(scheduler, request("e", n), [1, 14, 15, 0])
    assert len(staging.files()) == 1
    scheduler.build_connector_meta(None)
    assert staging.files() == []
    checks += 1

    # 6. vLLM's hybrid allocator: layer 0 in a full-attention group, layer 1 in a sliding-window group (window
    # 5) whose first two blocks are null (behind the window of a 13-token prompt: KvLayout.stale_tokens, 8,
    # which the prefill tier did not send); each layer lands in its own table, the null block stays untouched
    hybrid = SimpleNamespace(kv_cache_groups=[
        SimpleNamespace(layer_names=["model.layers.0.self_attn.attn"], kv_cache_spec=SimpleNamespace(block_size=BLOCK)),
        SimpleNamespace(layer_names=["model.layers.1.self_attn.attn"],
                        kv_cache_spec=SimpleNamespace(block_size=BLOCK, sliding_window=5))])
    ranks = [Rank(0, hybrid), Rank(1, hybrid)]
    stale = 8
    s = staging.new("f")
    s.append(KvPiece(0, 0, k[:1].copy(), v[:1].copy()))
    s.append(KvPiece(1, stale, k[1:, stale:].copy(), v[1:, stale:].copy()))
    STAGED["f"] = s.seal()
    full, windowed = [7, 2, 11, 5], [0, 0, 3, 9]
    loaded = counter("pdserve_vllm_kv_tokens_loaded_total")
    out = step(scheduler, ranks, schedule(scheduler, request("f", n), full, windowed), aggregator)
    assert not out.invalid_block_ids and out.kv_connector_worker_meta.reads == {"f": 2}
    for r, rank in enumerate(ranks):
        layer0, layer1 = (rank.caches[f"model.layers.{i}.self_attn.attn"] for i in range(LAYERS))
        assert layer0[0, slots_of(full, n)].numpy().tobytes() == k[0, :, r:r + 1].tobytes()
        assert layer1[1, slots_of(windowed, n)[stale:]].numpy().tobytes() == v[1, stale:, r:r + 1].tobytes()
        assert not layer1[:, :BLOCK].any() and not layer0[:, [3 * BLOCK, 9 * BLOCK]].any()  # nothing elsewhere
    assert counter("pdserve_vllm_kv_tokens_loaded_total") - loaded == n and staging.files() == []
    checks += 1

    # 7. vLLM's prefix cache held the prompt's first block (on with --kv-events-config): the connector offers the
    # rest, and writes nothing into the held block (another request's too), every later token as in 1.
    ranks = [Rank(0), Rank(1)]
    stage(staging, "g", k, v)
    req = request("g", n)
    assert scheduler.get_num_new_matched_tokens(req, BLOCK) == (n - BLOCK, False)
    blocks = [7, 2, 11, 5]
    scheduler.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (blocks,)), n - BLOCK)
    out = step(scheduler, ranks, scheduler.build_connector_meta(None), aggregator)
    assert not out.invalid_block_ids and out.kv_connector_worker_meta.reads == {"g": 2}
    for r, rank in enumerate(ranks):
        got_k, got_v = rank.kv_at(slots_of(blocks, n))
        assert not got_k[:, :BLOCK].any() and not got_v[:, :BLOCK].any(), f"rank {r} wrote the held block"
        assert got_k[:, BLOCK:].tobytes() == k[:, BLOCK:, r:r + 1].tobytes(), f"rank {r}'s K"
        assert got_v[:, BLOCK:].tobytes() == v[:, BLOCK:, r:r + 1].tobytes(), f"rank {r}'s V"
    checks += 1

    staging.close()
    assert list(root.iterdir()) == []
    print(f"ok: {checks} checks")
    return 0


if __name__ == "__main__":
    vllm_connector.log.setLevel("CRITICAL")  # the failures above are on purpose
    sys.exit(main())
