"""Routing by the KV index: each candidate's expected cost (blocks to compute, to load from another medium, load),
the exact pick for given states, the reason counted, and the rendezvous fallback when no worker publishes."""

from __future__ import annotations

from prometheus_client import REGISTRY

from pdserve.server import metrics
from pdserve.kvcache.block_hash import BlockHasher
from pdserve.kvcache.kv_events import BlockStored, KVEventBatch
from pdserve.server.coordinator.kv_index import KvIndex
from pdserve.server.coordinator.kv_routing import KvRouting
from pdserve.server.coordinator.policies import prefix_aware
from pdserve.server.coordinator.router import Router
from pdserve.server.coordinator.worker_pool import Worker, WorkerPool

from tests.coordinator.fakes import worker_info

HASHER = BlockHasher("sha256")
PROMPT = [(7 * i) % 300 + 3 for i in range(64)]  # 4 blocks of 16: 3 full ones are looked up (the last token's not)


def _decode(address: str, free: int = 100) -> Worker:
    return Worker(address, "decode", worker_info("decode", address, free=free), ready=True)


def _prefill(address: str, queued: int = 0) -> Worker:
    return Worker(address, "prefill", worker_info("prefill", address, queued_prefill_tokens=queued), ready=True)


def _index(holds: dict[str, list[tuple[int, str]]], tiers: dict[str, str] | None = None) -> KvIndex:
    """Each worker's view, live: it holds PROMPT's first n blocks on a medium, for each (n, medium)."""
    index = KvIndex()
    hashes = HASHER.hashes(PROMPT, 16)
    for worker, held in holds.items():
        index.track(worker, (tiers or {}).get(worker, "decode"), 16)
        index.snapshot(worker, lambda start: [])
        events = [BlockStored(block_hashes=hashes[:n], parent_block_hash=None, token_ids=PROMPT[: 16 * n],
                              block_size=16, lora_id=None, medium=medium, lora_name=None) for n, medium in held]
        index.receive(worker, 0, KVEventBatch(ts=1.0, events=events), None)
    return index


def _decisions(tier: str, reason: str) -> float:
    identity = dict(metrics._identity)  # whatever an earlier test in this process named it
    return REGISTRY.get_sample_value("pdserve_routing_decisions_total",
                                     {**identity, "tier": tier, "reason": reason}) or 0.0


def _rendezvous_pick(workers: list[Worker]) -> Worker:
    return prefix_aware(workers, len(PROMPT), prompt=PROMPT)


def test_decode_goes_where_the_prefix_is_even_against_the_rendezvous_hash():
    workers = [_decode("10.0.0.1:1"), _decode("10.0.0.2:1")]
    guess = _rendezvous_pick(workers)
    holder = next(w for w in workers if w is not guess)  # the index says the other one holds it
    routing = KvRouting(_index({holder.address: [(3, "GPU")], guess.address: []}), HASHER)
    hashes: dict[int, list[bytes]] = {}
    at_holder, at_guess = (routing.estimate(w, PROMPT, hashes) for w in (holder, guess))
    assert (at_holder.cached_blocks, at_holder.compute_blocks, at_holder.load_blocks, at_holder.cost) == (3, 1, 0.0, 1.0)
    assert (at_guess.cached_blocks, at_guess.compute_blocks, at_guess.cost) == (0, 4, 4.0)
    assert routing.pick_decode(workers, len(PROMPT), PROMPT) == (holder, "kv-index")


def test_decode_cost_weighs_the_prefix_against_load_and_the_medium():
    a, b = _decode("a:1", free=96), _decode("b:1")
    routing = KvRouting(_index({"a:1": [(3, "GPU")], "b:1": []}), HASHER)
    assert routing.pick_decode([a, b], 64, PROMPT) == (b, "kv-load")  # a: 1 + 4 in use = 5 > b: 4 + 0
    a.info.load.free_kv_blocks = 98
    assert routing.pick_decode([a, b], 64, PROMPT) == (a, "kv-index")  # a: 1 + 2 = 3 < 4
    assert KvRouting(routing.index, HASHER, overlap_weight=0.0).pick_decode([a, b], 64, PROMPT) == (b, "kv-load")
    # tiers: 3 blocks on a's disk (0.3 each) against 2 on b's device
    routing = KvRouting(_index({"a:1": [(3, "DISK")], "b:1": [(2, "GPU")]}), HASHER)
    a.info.load.free_kv_blocks = 100
    hashes: dict[int, list[bytes]] = {}
    assert round(routing.estimate(a, PROMPT, hashes).cost, 6) == 1.9  # 1 to compute + 3 x 0.3 to load
    assert routing.estimate(b, PROMPT, hashes).cost == 2.0
    assert routing.pick_decode([a, b], 64, PROMPT) == (a, "kv-index")
    # a medium the router does not know costs half a compute: 1 + 1.5 > 2
    routing = KvRouting(_index({"a:1": [(3, "s3://bucket")], "b:1": [(2, "GPU")]}), HASHER)
    assert routing.pick_decode([a, b], 64, PROMPT) == (b, "kv-index")
    routing = KvRouting(_index({"a:1": [(3, "CPU"), (1, "GPU")], "b:1": [(2, "GPU")]}), HASHER)
    assert round(routing.estimate(a, PROMPT, {}).cost, 6) == 1.2  # the cheapest medium of each block: 0 + 0.1 + 0.1


def test_decode_pick_needs_room_and_says_when_a_view_is_not_exact():
    full, roomy = _decode("a:1", free=2), _decode("b:1")
    routing = KvRouting(_index({"a:1": [(3, "GPU")], "b:1": []}), HASHER)
    assert routing.pick_decode([full, roomy], 64, PROMPT) == (roomy, "kv-load")  # 4 blocks do not fit on a
    third = _decode("c:1")
    routing.index.track("c:1", "decode", 16)  # its snapshot is pending
    assert routing.pick_decode([_decode("a:1"), roomy, third], 64, PROMPT)[1] == "kv-index-partial"
    assert routing.pick_decode([_decode("x:1"), _decode("y:1")], 64, PROMPT) is None  # no view of either
    assert routing.pick_decode([roomy], 64, []) is None


def test_prefill_prefers_its_prefix_weighed_against_its_queue():
    holder, idle = _prefill("p:1", queued=40), _prefill("q:1")
    routing = KvRouting(_index({"p:1": [(3, "CPU")], "q:1": []}, tiers={"p:1": "prefill", "q:1": "prefill"}), HASHER)
    hashes: dict[int, list[bytes]] = {}
    assert routing.estimate(holder, PROMPT, hashes).cost == 16 + 40  # tokens to compute + queued tokens
    assert routing.estimate(idle, PROMPT, hashes).cost == 64
    assert routing.pick_prefill([holder, idle], PROMPT) == (holder, "kv-index")
    holder.pending_tokens = 50  # this coordinator's own prompts there, not yet reported
    assert routing.pick_prefill([holder, idle], PROMPT) == (idle, "kv-load")


async def test_router_counts_each_pick_by_reason_and_falls_back_to_rendezvous():
    pool = WorkerPool()
    workers = [pool.add(_decode("10.0.0.1:1")), pool.add(_decode("10.0.0.2:1"))]
    guess = _rendezvous_pick(workers)
    holder = next(w for w in workers if w is not guess)
    plain = Router(pool, decode_policy="prefix-aware")
    before = _decisions("decode", "rendezvous")
    assert plain.pick_decode(64, PROMPT) is guess
    assert _decisions("decode", "rendezvous") == before + 1
    kv = Router(pool, decode_policy="prefix-aware", kv=KvRouting(_index({holder.address: [(3, "GPU")], guess.address: []}), HASHER))
    before = _decisions("decode", "kv-index")
    assert kv.pick_decode(64, PROMPT) is holder
    assert _decisions("decode", "kv-index") == before + 1
    other = Router(pool, decode_policy="most-free-blocks", kv=kv.kv)  # a load policy chosen: the index stays out
    assert other.pick_decode(64, PROMPT) in workers
    p = pool.add(_prefill("p:1"))
    before = _decisions("prefill", "least-queued")
    assert kv.pick_prefill(prompt=PROMPT) is p  # no view of the prefill worker: its policy
    assert _decisions("prefill", "least-queued") == before + 1
    await pool.close()
