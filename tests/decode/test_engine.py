"""Continuous batching: requests join and leave between steps, and each gets transformers' tokens."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from pdserve.kvcache.layout import KvLayout
from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.v1 import worker_pb2 as pb
from pdserve.server.decode.engine import DecodeEngine, QueueFull
from pdserve.server.decode.sampling import SamplingBatch
from pdserve.server.decode.weights import build_model
from pdserve.server.decode.sequence import Sequence
from pdserve.server.model.config import load_config
from pdserve.server.model.weights import load_weights
from tests.hf_oracle import hf_greedy_tokens
from tests.decode.loop_hold import held


def _greedy(max_tokens: int) -> gen_pb.SamplingParams:
    return gen_pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, top_p=1.0, top_k=0, ignore_eos=True)


_hf_greedy = hf_greedy_tokens  # (path, ids, n): n tokens, an end-of-sequence token not ending them


async def _drain(seq: Sequence) -> list[int]:
    got = []
    while (ids := await seq.events.get()) is not None:
        got.extend(ids)
    return got


def _engine(path, num_blocks: int, block_size: int = 4, **kw) -> DecodeEngine:
    config = load_config(path)
    model = build_model(config, load_weights(path))
    layout = KvLayout(config.num_layers, config.num_kv_heads, config.head_dim, block_size=block_size, dtype="float32")
    return DecodeEngine(model, layout, num_blocks=num_blocks, **{"max_running": 8, **kw})


def _request(rid: str, prompt: list[int], max_tokens: int) -> pb.DecodeRequest:
    return pb.DecodeRequest(request_id=rid, prompt_token_ids=prompt, sampling=_greedy(max_tokens), local_prefill=True)


async def _admit(engine: DecodeEngine, rid: str, prompt: list[int], max_tokens: int) -> Sequence:
    """Queued, admitted, prompt prefilled here (standing in for the KV transfer), running."""
    seq = engine.add(_request(rid, prompt, max_tokens))
    await seq.admitted
    engine.start(seq, await engine.prefill_locally(seq))
    return seq


def _all_back(engine: DecodeEngine) -> bool:
    return engine.pool.num_free + engine.scheduler.cache.num_evictable == engine.pool.num_total


async def test_requests_join_and_leave_between_steps(tiny_model):
    path = tiny_model("mistral")
    engine = _engine(path, num_blocks=64)
    a = await _admit(engine, "a", [3, 4, 5, 6, 7, 8, 9], 12)
    drain_a = asyncio.create_task(_drain(a))
    while engine.steps < 3:
        await asyncio.sleep(0.005)
    b = await _admit(engine, "b", [40, 41, 42], 5)  # joins while a is running
    got_b = await _drain(b)
    got_a = await drain_a
    assert [a.output_ids[0], *got_a] == _hf_greedy(path, a.prompt_ids, 12)
    assert [b.output_ids[0], *got_b] == _hf_greedy(path, b.prompt_ids, 5)
    assert a.finish_reason == b.finish_reason == gen_pb.FINISH_REASON_LENGTH
    assert engine.sequences == {} and _all_back(engine)
    await engine.close()


async def test_abort_mid_run_frees_after_the_step(tiny_model):
    path = tiny_model("llama")
    engine = _engine(path, num_blocks=8, block_size=16)
    seq = await _admit(engine, "x", [1, 2, 3], 200)
    while engine.steps < 2:
        await asyncio.sleep(0.005)
    assert engine.abort("x", gen_pb.FINISH_REASON_ABORT)
    while engine._busy:
        await asyncio.sleep(0.005)
    assert _all_back(engine) and seq.block_table == []
    assert seq.finish_reason == gen_pb.FINISH_REASON_ABORT
    await engine.close()


async def test_a_cancelled_local_prefill_holds_its_blocks_until_its_thread_ends(tiny_model, monkeypatch):
    """The request ends (its Decode call cancelled, then aborted) while its prompt is computed in a thread:
    the thread runs on writing the blocks, so they are freed only when it ends, never handed on before."""
    engine = _engine(tiny_model("llama"), num_blocks=13)
    computing, finish = threading.Event(), threading.Event()
    prefill = engine._prefill

    def slow_prefill(seq: Sequence) -> int:
        computing.set()
        assert finish.wait(10)
        return prefill(seq)

    monkeypatch.setattr(engine, "_prefill", slow_prefill)
    seq = engine.add(_request("a", list(range(3, 13)), 4))  # 10 tokens: 3 blocks of 4
    await seq.admitted
    held = list(seq.block_table)
    call = asyncio.create_task(engine.prefill_locally(seq))
    assert await asyncio.to_thread(computing.wait, 10)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert engine.abort("a")
    other = engine.add(_request("b", list(range(20, 64)), 4))  # 44 tokens: 11 blocks, 1 more than are free
    assert held == [0, 1, 2] and not other.admitted.done()  # it waits for a's blocks
    finish.set()
    await asyncio.wait_for(other.admitted, 10)  # a's thread ended: its blocks go to b
    assert len(other.block_table) == 11 and set(held) & set(other.block_table)
    engine.abort("b")
    assert _all_back(engine)
    await engine.close()


async def test_a_long_max_tokens_reserves_nothing_ahead(tiny_model):
    path = tiny_model("llama")
    engine = _engine(path, num_blocks=8)  # 32 tokens of cache; each request may ask for 1000
    seqs = [engine.add(_request(f"r{i}", [10 + i, 11, 12], 1000)) for i in range(8)]
    assert all(s.admitted.done() for s in seqs)
    assert [s.block_table for s in seqs] == [[i] for i in range(8)]  # the prompt's block, nothing ahead
    assert engine.max_model_len == 32  # the model's 2048, capped by what the cache holds
    for s in seqs:
        engine.abort(s.request_id)
    while engine._busy:
        await asyncio.sleep(0.005)
    assert _all_back(engine)
    await engine.close()


async def test_preempted_sequences_resume_without_losing_or_repeating_a_token(tiny_model):
    path = tiny_model("qwen2")
    prompts = [[5, 6, 7, 8, 9], [20, 21, 22], [30, 31, 32, 33, 34, 35]]
    # 6 blocks of 4 tokens for three sequences growing to 19-22 tokens (5-6 blocks each): they must
    # take turns, preempted newest first, re-prefilled from their prompt + outputs on resume.
    engine = _engine(path, num_blocks=6, enable_prefix_caching=False)
    with held(engine):  # all three step from the first step: preempted whatever loads the machine
        seqs = [await _admit(engine, f"p{i}", p, 16) for i, p in enumerate(prompts)]
    outs = await asyncio.gather(*(_drain(s) for s in seqs))
    assert engine.scheduler.num_preemptions >= 2
    for seq, out, prompt in zip(seqs, outs, prompts):
        assert [seq.output_ids[0], *out] == seq.output_ids == _hf_greedy(path, prompt, 16)
    assert _all_back(engine)
    await engine.close()


async def test_a_cached_prefix_is_not_computed_again_and_gives_the_same_tokens(tiny_model):
    path = tiny_model("llama")
    engine = _engine(path, num_blocks=32)
    system = list(range(50, 62))  # 3 full blocks
    first = await _admit(engine, "first", system + [1, 2], 4)
    await _drain(first)
    second = engine.add(_request("second", system + [3, 4, 5], 4))
    await second.admitted
    assert second.num_hit_blocks == 3 and second.block_table[:3] == [0, 1, 2]
    assert second.num_cached_tokens == 12
    engine.start(second, await engine.prefill_locally(second))  # computes tokens 12.. only
    got = [second.output_ids[0], *await _drain(second)]
    assert got == _hf_greedy(path, system + [3, 4, 5], 4)
    assert _all_back(engine)
    await engine.close()


async def test_waiters_queue_in_order_until_blocks_free(tiny_model):
    path = tiny_model("llama")
    engine = _engine(path, num_blocks=4, max_queue=2, enable_prefix_caching=False)
    a = await _admit(engine, "a", list(range(1, 12)), 2)  # 11 tokens: 3 blocks
    big = engine.add(_request("big", list(range(1, 9)), 2))  # 2 blocks
    small = engine.add(_request("small", [1], 2))  # 1 block: fits now, but waits behind big
    with pytest.raises(QueueFull):
        engine.add(_request("x", [1], 2))
    assert not big.admitted.done() and not small.admitted.done()
    await _drain(a)  # a finishes: its 3 blocks come back, big then small are admitted
    await asyncio.wait_for(asyncio.gather(big.admitted, small.admitted), 5)
    assert (big.block_table, small.block_table) == ([3, 0], [1])
    for s in (big, small):
        engine.abort(s.request_id)
    assert _all_back(engine)
    await engine.close()


async def test_an_unset_top_p_samples_the_whole_distribution_not_its_top_token():
    """A direct caller's SamplingParams without top_p means top_p 1 (as on the prefill tier and vLLM),
    never 0, which would keep only the most likely token."""
    logits = torch.zeros(2, 50)
    logits[:, 0] = 0.5  # the most likely token, but only slightly
    seqs = [Sequence(f"r{i}", [1], gen_pb.SamplingParams(temperature=1.0), frozenset(), 64) for i in range(2)]
    picked = set()
    for _ in range(40):  # 80 draws from 50 near-equal tokens: top-1 would give one
        picked.update(SamplingBatch.of(seqs, 50).sample(logits.clone()).tolist())
    assert len(picked) > 10


async def test_steps_take_the_prefill_core_while_no_prompt_prefills_here(tiny_model):
    """--threads-while-prefill-idle: a step runs on that many torch threads while no request waits for its KV
    from the prefill tier, on --threads (torch's at construction) while one does; a local prefill is no wait."""
    path = tiny_model("llama")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = _engine(path, num_blocks=64, idle_prefill_threads=2)
    finally:
        torch.set_num_threads(before)
    assert engine.threads == (1, 2) and engine.step_threads() == 2
    seen: list[int] = []
    decode = engine._decode
    engine._decode = lambda batch: (seen.append(torch.get_num_threads()), decode(batch))[1]
    a = await _admit(engine, "a", [3, 4, 5], 40)  # a local prefill: the prefill tier is not computing for it
    while engine.steps < 2:
        await asyncio.sleep(0.001)
    remote = engine.add(pb.DecodeRequest(request_id="b", prompt_token_ids=[7, 8, 9], sampling=_greedy(4)))
    await remote.admitted  # its blocks reserved: its KV is on the way from the prefill tier
    assert engine.step_threads() == 1
    mark = len(seen)
    while len(seen) < mark + 3:
        await asyncio.sleep(0.001)
    engine.abort("b")  # the prefill failed, say: nothing waits on the prefill tier any more
    assert engine.step_threads() == 2
    mark2 = len(seen)
    got = await _drain(a)
    assert seen[:2] == [2, 2] and 1 in seen[mark:mark2] and seen[mark2 + 1:] == [2] * len(seen[mark2 + 1:])
    assert set(seen[mark + 1:mark2]) == {1}  # every step that started while b waited (the first may have begun before)
    assert [a.output_ids[0], *got] == _hf_greedy(path, a.prompt_ids, 40)  # the same tokens whatever the threads
    await engine.close()
    assert _engine(path, num_blocks=8).threads is None  # without it: torch's threads, untouched


def test_the_flags_reach_the_engine(tiny_model):
    """`pdserve decode --threads 1 --threads-while-prefill-idle 2` builds an engine with (1, 2); a negative
    count is refused by name."""
    from pathlib import Path

    from pdserve.server.decode.config import DecodeConfig
    from pdserve.server.decode.startup import build_native_engine

    before = torch.get_num_threads()
    try:
        _, engine, _ = build_native_engine(DecodeConfig(model_dir=tiny_model("llama"), device="cpu",
                                                        kv_cache_tokens=64, threads=1, threads_while_prefill_idle=2))
        assert engine.threads == (1, 2)
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="--threads-while-prefill-idle must be >= 0"):
        DecodeConfig(model_dir=Path("m"), threads_while_prefill_idle=-1)
