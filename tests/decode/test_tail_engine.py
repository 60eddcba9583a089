"""Kept tails on the decode engine (fp32, against transformers): a conversation's next turn, prefilled here by
conditional disaggregation, computes only the answer's last token and its new tokens (the history's last partial
block copied from the tail), and its greedy tokens stay transformers'; a tail whose block another sequence took is
not reused; preempted sequences resume after their tails with the same tokens."""

from __future__ import annotations

import asyncio

import torch

from pdserve.kvcache.layout import KvLayout
from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.v1 import worker_pb2 as pb
from pdserve.server.decode.engine import DecodeEngine
from pdserve.server.decode.sequence import Sequence
from pdserve.server.decode.weights import build_model
from pdserve.server.model.config import load_config
from pdserve.server.model.weights import load_weights

BS = 4


def _hf_greedy(path, ids: list[int], n: int) -> list[int]:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None)
    return out[0, len(ids):].tolist()


def _engine(path, num_blocks: int, **kw) -> DecodeEngine:
    config = load_config(path)
    model = build_model(config, load_weights(path))
    layout = KvLayout(config.num_layers, config.num_kv_heads, config.head_dim, block_size=BS, dtype="float32")
    return DecodeEngine(model, layout, num_blocks=num_blocks, max_running=8, **kw)


def _request(rid: str, prompt: list[int], max_tokens: int, local: bool = False) -> pb.DecodeRequest:
    """local: the prompt is computed here whatever is cached; else conditional disaggregation's rule decides
    (Dynamo's threshold: here, with any block cached)."""
    sampling = gen_pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, top_p=1.0, top_k=0, ignore_eos=True)
    return pb.DecodeRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling, local_prefill=local,
                            local_prefill_max_uncached=0 if local else 2048)


async def _turn(engine: DecodeEngine, rid: str, prompt: list[int], n: int, local: bool = False) -> tuple[Sequence, int]:
    """The request run to its end on this engine; the sequence and the prompt tokens it found cached."""
    seq = engine.add(_request(rid, prompt, n, local))
    await seq.admitted
    assert seq.local_prefill, "the engine can only prefill here: the rule must take it"
    cached = seq.num_cached_tokens
    engine.start(seq, await engine.prefill_locally(seq))
    while await seq.events.get() is not None:
        pass
    return seq, cached


async def _prompt_kv(engine: DecodeEngine, rid: str, prompt: list[int]
                     ) -> tuple[Sequence, int, torch.Tensor, torch.Tensor]:
    """The request admitted and prefilled here (not started): the sequence, its first token, and its prompt's K and
    V [L, T, Hkv, D] in the cache."""
    seq = engine.add(_request(rid, prompt, 1, local=True))
    await seq.admitted
    first = await engine.prefill_locally(seq)
    return (seq, first, *engine.cache.read(seq.block_table, len(prompt)))


async def test_each_turn_computes_the_answers_last_token_and_its_new_tokens_with_transformers_tokens(tiny_model):
    path = tiny_model("llama")
    engine = _engine(path, num_blocks=32)
    prompt = [(7 * i + 3) % 200 + 5 for i in range(10)]
    first, _ = await _turn(engine, "t1", prompt, 6, local=True)  # 16 tokens, KV for 15: 3 blocks and a tail of 3
    assert first.output_ids == _hf_greedy(path, prompt, 6)
    assert len(engine.scheduler.cache.tails) == 1
    turn2 = prompt + first.output_ids + [101, 102, 103, 104, 105]  # 21 tokens: 15 held, the answer's last + 5 new
    second, cached = await _turn(engine, "t2", turn2, 5)
    assert cached == 15 and second.num_hit_blocks == 3
    assert second.output_ids == _hf_greedy(path, turn2, 5)
    turn3 = turn2 + second.output_ids + [106, 107, 108]  # 29 tokens, 25 held: 6 full blocks and a tail of 1
    third, cached = await _turn(engine, "t3", turn3, 4)
    assert cached == 25 and third.num_hit_blocks == 6
    assert third.output_ids == _hf_greedy(path, turn3, 4)
    # The KV of a turn prefilled after a tail is the KV of the same prompt computed whole (the tiny model's greedy
    # tokens barely depend on it: this is what catches a tail's KV missing or misplaced).
    turn4 = turn3 + third.output_ids + [109, 110]
    seq, first_token, k, v = await _prompt_kv(engine, "t4", turn4)
    assert seq.num_cached_tokens == len(turn3) + 3 and seq.tail_copy is None
    whole = _engine(path, num_blocks=32, enable_prefix_caching=False)
    ref, ref_token, k_ref, v_ref = await _prompt_kv(whole, "t4", turn4)
    assert ref.num_cached_tokens == 0 and first_token == ref_token
    torch.testing.assert_close((k, v), (k_ref, v_ref), rtol=1e-5, atol=1e-5)
    await engine.close()
    await whole.close()


async def test_a_tail_whose_block_another_prompt_took_is_not_reused(tiny_model):
    path = tiny_model("llama")
    engine = _engine(path, num_blocks=8)
    prompt = [(5 * i + 1) % 200 + 5 for i in range(10)]
    first, _ = await _turn(engine, "t1", prompt, 6, local=True)  # 3 full blocks cached, a tail in a 4th
    other = [(11 * i + 2) % 200 + 5 for i in range(20)]  # 5 blocks: the 4 free ones and the tail's
    await _turn(engine, "other", other, 1, local=True)
    assert len(engine.scheduler.cache.tails) == 0  # the tail's block holds other's KV now (5 full blocks: no tail)
    turn2 = prompt + first.output_ids + [101, 102]
    second, cached = await _turn(engine, "t2", turn2, 5)
    assert cached == 12 and second.output_ids == _hf_greedy(path, turn2, 5)
    await engine.close()


async def test_preempted_sequences_with_prefix_caching_and_tails_keep_transformers_tokens(tiny_model):
    path = tiny_model("qwen2")
    prompts = [[5, 6, 7, 8, 9], [20, 21, 22], [30, 31, 32, 33, 34, 35]]
    engine = _engine(path, num_blocks=7)  # three sequences growing to 19-22 tokens take turns
    seqs = [engine.add(_request(f"p{i}", p, 16, local=True)) for i, p in enumerate(prompts)]

    async def run(seq: Sequence) -> None:
        await seq.admitted
        engine.start(seq, await engine.prefill_locally(seq))
        while await seq.events.get() is not None:
            pass

    await asyncio.gather(*(run(s) for s in seqs))
    assert engine.scheduler.num_preemptions >= 1
    for seq, prompt in zip(seqs, prompts):
        assert seq.output_ids == _hf_greedy(path, prompt, 16), seq.request_id
    assert engine.pool.num_free + engine.scheduler.cache.num_evictable == engine.pool.num_total
    await engine.close()
