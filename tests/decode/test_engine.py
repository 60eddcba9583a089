"""Continuous batching: requests join and leave between steps, and each gets transformers' tokens."""

from __future__ import annotations

import asyncio

import torch

from pdserve.kvcache.layout import KvLayout
from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.server.decode.engine import DecodeEngine
from pdserve.server.decode.model import DecoderModel
from pdserve.server.decode.sequence import Sequence
from pdserve.server.model.config import load_config
from pdserve.server.model.weights import load_weights


def _greedy(max_tokens: int) -> gen_pb.SamplingParams:
    return gen_pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, top_p=1.0, top_k=0, ignore_eos=True)


def _hf_greedy(path, ids: list[int], n: int) -> list[int]:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None)
    return out[0, len(ids):].tolist()


async def _drain(seq: Sequence) -> list[int]:
    got = []
    while (ids := await seq.events.get()) is not None:
        got.extend(ids)
    return got


async def test_requests_join_and_leave_between_steps(tiny_model):
    path = tiny_model("mistral")
    config = load_config(path)
    model = DecoderModel(config, load_weights(path))
    layout = KvLayout(config.num_layers, config.num_kv_heads, config.head_dim, block_size=4, dtype="float32")
    engine = DecodeEngine(model, layout, num_blocks=64, max_running=8)

    def admit(rid: str, prompt: list[int], max_tokens: int) -> Sequence:
        blocks = engine.pool.allocate(engine.blocks_needed(len(prompt), max_tokens, config.max_model_len))
        seq = Sequence(rid, prompt, _greedy(max_tokens), blocks, frozenset(config.eos_token_ids), config.max_model_len)
        engine.reserve(seq)
        logits = model.prefill(torch.tensor(prompt), blocks, engine.cache)  # stands in for the KV transfer
        engine.start(seq, int(logits[-1].argmax()))
        return seq

    a = admit("a", [3, 4, 5, 6, 7, 8, 9], 12)
    drain_a = asyncio.create_task(_drain(a))
    while engine.steps < 3:
        await asyncio.sleep(0.005)
    b = admit("b", [40, 41, 42], 5)  # joins while a is running
    got_b = await _drain(b)
    got_a = await drain_a
    assert [a.output_ids[0], *got_a] == _hf_greedy(path, a.prompt_ids, 12)
    assert [b.output_ids[0], *got_b] == _hf_greedy(path, b.prompt_ids, 5)
    assert a.finish_reason == b.finish_reason == gen_pb.FINISH_REASON_LENGTH
    for seq in (a, b):
        engine.release(seq)
    assert engine.pool.num_free == engine.pool.num_total
    await engine.close()


async def test_abort_mid_run_frees_after_the_step(tiny_model):
    path = tiny_model("llama")
    config = load_config(path)
    model = DecoderModel(config, load_weights(path))
    layout = KvLayout(config.num_layers, config.num_kv_heads, config.head_dim, block_size=16, dtype="float32")
    engine = DecodeEngine(model, layout, num_blocks=8, max_running=8)
    blocks = engine.pool.allocate(2)
    seq = Sequence("x", [1, 2, 3], _greedy(200), blocks, frozenset(), config.max_model_len)
    engine.reserve(seq)
    model.prefill(torch.tensor([1, 2, 3]), blocks, engine.cache)
    engine.start(seq, 7)
    while engine.steps < 2:
        await asyncio.sleep(0.005)
    assert engine.abort("x", gen_pb.FINISH_REASON_ABORT)
    engine.release(seq)
    while engine._in_step:
        await asyncio.sleep(0.005)
    assert engine.pool.num_free == 8
    assert seq.finish_reason == gen_pb.FINISH_REASON_ABORT
    await engine.close()
