"""Routing a LoRA adapter's requests where the adapter is (lora_routing.py): the decode workers report the adapters
in their device slots and host memory; without the KV index the holders are preferred over the rendezvous hash
(device, then host; spilling past their share of the load), with it the adapter's load cost joins its prefix's,
looked up under the adapter's own block hashes."""

from __future__ import annotations

from pdserve.kvcache.adapter_key import AdapterKey
from pdserve.kvcache.kv_events import BlockStored, KVEventBatch
from pdserve.server.coordinator.adapters import Adapter
from pdserve.server.coordinator.kv_index import KvIndex
from pdserve.server.coordinator.kv_routing import KvRouting
from pdserve.server.coordinator.lora_routing import ADAPTER_LOAD_COST, holders, residency
from pdserve.server.coordinator.router import Router
from pdserve.server.coordinator.worker_pool import Worker, WorkerPool
from pdserve.v1 import worker_pb2

from tests.coordinator.fakes import worker_info
from tests.coordinator.test_kv_routing import HASHER, PROMPT, _decisions, _rendezvous_pick

ADA = Adapter("ada", 1, "/adapters/ada")
BOB = Adapter("bob", 2, "/adapters/bob")


def _decode(address: str, device: tuple[Adapter, ...] = (), host: tuple[Adapter, ...] = (), free: int = 100) -> Worker:
    loras = {"device_loras": [a.proto() for a in device], "host_loras": [a.proto() for a in (*device, *host)]}
    return Worker(address, "decode", worker_info("decode", address, free=free, **loras), ready=True)


def _pair(**holder_loras) -> tuple[list[Worker], Worker, Worker]:
    """Two decode workers; the one the rendezvous hash would not pick for PROMPT holds what holder_loras say."""
    plain = [_decode("10.0.0.1:1"), _decode("10.0.0.2:1")]
    guess = _rendezvous_pick(plain)
    holder = _decode(next(w for w in plain if w is not guess).address, **holder_loras)
    return [guess, holder], guess, holder


async def test_an_adapters_requests_go_to_the_worker_holding_it_not_where_the_hash_points():
    pool = WorkerPool()
    (guess, holder), _, _ = _pair(device=(ADA,))
    guess, holder = pool.add(guess), pool.add(holder)
    router = Router(pool, decode_policy="prefix-aware")
    assert router.pick_decode(64, PROMPT) is guess  # the base model's request: the rendezvous hash
    before = _decisions("decode", "lora-device")
    for _ in range(3):
        assert router.pick_decode(64, PROMPT, adapter=ADA) is holder
    assert _decisions("decode", "lora-device") == before + 3
    assert router.pick_decode(64, PROMPT, adapter=BOB) is guess  # held nowhere: the policy alone
    moved = Adapter("ada", 3, "/adapters/ada-v2")  # the name re-pointed at other weights: another adapter
    assert residency(holder, moved) == "disk" and router.pick_decode(64, PROMPT, adapter=moved) is guess
    await pool.close()


def test_a_device_slot_beats_host_memory_which_beats_disk_and_a_hot_adapter_spills():
    on_device, in_host, without = _decode("a:1", device=(ADA,)), _decode("b:1", host=(ADA,)), _decode("c:1")
    workers = [without, in_host, on_device]
    assert [residency(w, ADA) for w in workers] == ["disk", "host", "device"]
    assert holders(workers, ADA, 64) == ([on_device], "device")
    assert holders([without, in_host], ADA, 64) == ([in_host], "host")
    assert holders([without], ADA, 64) == ([without], "disk")
    on_device.inflight = 3  # bound: ceil(1.25 x (3 + 1) / 3) = 2 in flight; it has 3
    assert holders(workers, ADA, 64) == ([in_host], "host")
    full = _decode("d:1", device=(ADA,), free=0)  # no room for the prompt's blocks
    assert holders([full, without], ADA, 64) == ([full, without], "disk")


def _adapter_index(holds: dict[str, tuple[int, Adapter | None]]) -> KvIndex:
    """Each worker holds PROMPT's first n blocks as computed with the adapter (None: the base model), on its GPU."""
    index = KvIndex()
    for worker, (n, adapter) in holds.items():
        key = None if adapter is None else AdapterKey(adapter.id, adapter.name, adapter.path)
        hashes = HASHER.hashes(PROMPT, 16, extra_keys=None if key is None else key.extra_keys)
        index.track(worker, "decode", 16)
        index.snapshot(worker, lambda start: [])
        stored = BlockStored(block_hashes=hashes[:n], parent_block_hash=None, token_ids=PROMPT[: 16 * n],
                             block_size=16, lora_id=None if key is None else key.id, medium="GPU",
                             lora_name=None if key is None else key.name)
        index.receive(worker, 0, KVEventBatch(ts=1.0, events=[stored]), None)
    return index


def test_with_the_kv_index_the_adapters_prefix_is_found_under_its_own_hashes_and_its_load_costs():
    workers, guess, holder = _pair(device=(ADA,))
    # the rendezvous guess holds PROMPT's prefix for the base model only; nobody holds ada's
    routing = KvRouting(_adapter_index({guess.address: (3, None), holder.address: (0, None)}), HASHER)
    base = routing.estimate(guess, PROMPT, {})
    assert base.cached_blocks == 3 and base.adapter == ""
    at_guess, at_holder = (routing.estimate(w, PROMPT, {}, ADA) for w in (guess, holder))
    assert (at_guess.cached_blocks, at_guess.adapter) == (0, "disk")  # the base prefix is not ada's
    assert at_guess.cost - at_holder.cost == ADAPTER_LOAD_COST["disk"]
    assert routing.pick_decode(workers, 64, PROMPT, ADA) == (holder, "lora-device")
    assert routing.pick_decode(workers, 64, PROMPT) == (guess, "kv-index")
    # ada's own prefix on the guess (3 blocks, 4 to compute elsewhere) does not outweigh reading ada from disk
    routing = KvRouting(_adapter_index({guess.address: (3, ADA), holder.address: (0, None)}), HASHER)
    at_guess = routing.estimate(guess, PROMPT, {}, ADA)
    assert at_guess.cached_blocks == 3 and at_guess.cost == ADAPTER_LOAD_COST["disk"] + 1
    assert routing.pick_decode(workers, 64, PROMPT, ADA) == (holder, "lora-device")
    in_host = _decode(guess.address, host=(ADA,))  # ada in its host memory: 1 block + a copy vs 4 blocks
    assert routing.estimate(in_host, PROMPT, {}, ADA).cost == 1 + ADAPTER_LOAD_COST["host"]
    assert routing.pick_decode([in_host, holder], 64, PROMPT, ADA) == (holder, "lora-device")
    both = _decode(guess.address, device=(ADA,))  # ada in a device slot and its prefix there: 1 block vs 4
    assert routing.pick_decode([both, holder], 64, PROMPT, ADA) == (both, "kv-index")


def test_the_load_report_message_carries_the_adapters():
    load = worker_pb2.WorkerLoad(device_loras=[ADA.proto()], host_loras=[ADA.proto(), BOB.proto()])
    again = worker_pb2.WorkerLoad.FromString(load.SerializeToString())
    assert [a.name for a in again.device_loras] == ["ada"] and [a.path for a in again.host_loras] == \
        ["/adapters/ada", "/adapters/bob"]
