"""A decode step that fails because of one sequence fails that sequence alone; the rest of the batch
gets transformers' tokens as if nothing happened."""

from __future__ import annotations

import asyncio

import torch

from pdserve.kvcache.layout import KvLayout
from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.v1 import worker_pb2 as pb
from pdserve.server.decode.engine import DecodeEngine
from pdserve.server.decode.weights import build_model
from pdserve.server.decode.sequence import Sequence
from pdserve.server.model.config import load_config
from pdserve.server.model.weights import load_weights
from tests.decode.test_engine import _drain, _greedy, _hf_greedy


async def test_poisoned_sequences_fail_alone(tiny_model):
    path = tiny_model("llama")
    config = load_config(path)
    model = build_model(config, load_weights(path))
    layout = KvLayout(config.num_layers, config.num_kv_heads, config.head_dim, block_size=4, dtype="float32")
    engine = DecodeEngine(model, layout, num_blocks=64, max_running=8)

    def admit(rid: str, prompt: list[int], sampling: gen_pb.SamplingParams, first: int | None = None) -> Sequence:
        seq = engine.add(pb.DecodeRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling))
        logits = model.prefill(torch.tensor(prompt), seq.block_table, engine.cache)
        engine.start(seq, int(logits[-1].argmax()) if first is None else first)
        return seq

    nan = _greedy(6)
    nan.temperature = float("nan")  # what a worker that skipped validation would let in
    # Joined in one step: two good sequences between a NaN temperature and a token past the vocabulary.
    seqs = [admit("good-a", [3, 4, 5, 6], _greedy(6)), admit("nan", [7, 8, 9], nan),
            admit("oov", [10, 11], _greedy(6), first=config.vocab_size + 5), admit("good-b", [40, 41, 42], _greedy(6))]
    got = await asyncio.gather(*(_drain(s) for s in seqs))
    by_id = {s.request_id: (s, g) for s, g in zip(seqs, got)}
    for rid in ("good-a", "good-b"):
        seq, tokens = by_id[rid]
        assert seq.finish_reason == gen_pb.FINISH_REASON_LENGTH
        assert [seq.output_ids[0], *tokens] == _hf_greedy(path, seq.prompt_ids, 6)
    for rid in ("nan", "oov"):
        seq, tokens = by_id[rid]
        assert seq.finish_reason == gen_pb.FINISH_REASON_ERROR and tokens == []
    while engine._busy:
        await asyncio.sleep(0.005)
    assert engine.sequences == {}
    assert engine.pool.num_free + engine.scheduler.cache.num_evictable == engine.pool.num_total
    await engine.close()
