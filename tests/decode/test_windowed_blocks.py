"""The decode engine on a model whose every layer is windowed (the tiny Mistral, window 24, blocks of 4 tokens):
blocks behind the window go back to the pool as sequences grow, and greedy tokens still equal transformers' —
with the prompt's KV handed over without the blocks behind the window, computed here, preempted and
recomputed, and with speculation's lookahead blocks."""

from __future__ import annotations

import asyncio

import torch

from pdserve.kvcache.codec import KvPiece
from pdserve.kvcache.layout import KvLayout
from pdserve.v1 import worker_pb2 as pb
from pdserve.server.decode.engine import DecodeEngine
from pdserve.server.decode.kv_cache import PagedKvCache
from pdserve.server.decode.sequence import Sequence
from pdserve.server.decode.spec.config import SpeculativeConfig
from pdserve.server.decode.weights import build_model
from pdserve.server.decode.windows import stale_blocks
from pdserve.server.model.config import load_config
from pdserve.server.model.tiny import WINDOW
from pdserve.server.model.weights import load_weights
from tests.decode.test_engine import _all_back, _drain, _greedy, _hf_greedy

BLOCK = 4
MOST_HELD = -(-WINDOW // BLOCK) + 1  # 7 blocks: a window's worth, one of them partly behind it
PROMPTS = [list(range(3, 63)), [7, 8, 9] * 10, list(range(100, 110))]  # 60, 30 and 10 tokens
NEW_TOKENS = 40


def _engine(path, num_blocks: int, **kw) -> DecodeEngine:
    c = load_config(path)
    layout = KvLayout.of(c.num_layers, c.num_kv_heads, c.head_dim, BLOCK, "float32", c.layer_windows)
    return DecodeEngine(build_model(c, load_weights(path)), layout, num_blocks=num_blocks,
                        **{"max_running": 8, **kw})


def _most_held(engine: DecodeEngine) -> dict[str, int]:
    """Records, after every schedule, the most blocks each running sequence held."""
    scheduler, most = engine.scheduler, {}
    schedule = scheduler.schedule

    def recording() -> list[Sequence]:
        batch = schedule()
        for seq in batch:
            most[seq.request_id] = max(most.get(seq.request_id, 0), scheduler.blocks_held(seq))
        return batch

    scheduler.schedule = recording
    return most


async def _computed_here(engine: DecodeEngine, rid: str, prompt: list[int]) -> Sequence:
    seq = engine.add(pb.DecodeRequest(request_id=rid, prompt_token_ids=prompt, sampling=_greedy(NEW_TOKENS),
                                      local_prefill=True))
    await seq.admitted
    engine.start(seq, await engine.prefill_locally(seq))
    return seq


async def _handed_over(engine: DecodeEngine, rid: str, prompt: list[int]) -> Sequence:
    """As the prefill tier hands it over: the prompt's KV (computed in a scratch cache) written from the first
    block inside the window on, as the KV sender skips the rest (`KvLayout.stale_tokens`)."""
    seq = engine.add(pb.DecodeRequest(request_id=rid, prompt_token_ids=prompt, sampling=_greedy(NEW_TOKENS)))
    await seq.admitted
    layout = engine.layout
    stale = layout.stale_tokens(len(prompt))
    assert seq.num_dropped_blocks == min(stale) // BLOCK and seq.block_table[: seq.num_dropped_blocks] == \
        [engine.scheduler.null_block] * seq.num_dropped_blocks
    table = list(range(layout.num_blocks(len(prompt))))
    scratch = PagedKvCache(layout, len(table))
    logits = engine.model.prefill(torch.tensor(prompt), table, scratch)  # [S, V]
    k, v = scratch.read(table, len(prompt))  # [L, S, Hkv, D]
    first = min(stale)
    engine.write(rid, KvPiece(0, first, k[:, first:].numpy(), v[:, first:].numpy(), None, None))
    seq.num_stale_blocks = stale_blocks(layout, len(prompt))  # as decode/first_token.py sets it once the KV is in
    assert seq.num_stale_blocks == max(stale) // BLOCK
    engine.start(seq, int(logits[-1].argmax()))
    return seq


async def _run_all(engine: DecodeEngine, admit, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    seqs = [await admit(engine, f"r{i}", p) for i, p in enumerate(prompts)]
    outs = await asyncio.gather(*(_drain(s) for s in seqs))
    return [[s.output_ids[0], *out] for s, out in zip(seqs, outs)]


async def test_handed_over_and_computed_here_sequences_hold_a_window_of_blocks_and_match_transformers(tiny_model):
    path = tiny_model("mistral-windowed")
    want = [_hf_greedy(path, p, NEW_TOKENS) for p in PROMPTS]
    for admit in (_handed_over, _computed_here):
        engine = _engine(path, num_blocks=64)
        assert engine.scheduler.drops_blocks and engine.cache.num_blocks == 65  # the null block beside the pool
        most = _most_held(engine)
        assert await _run_all(engine, admit) == want, admit.__name__
        assert most == {"r0": MOST_HELD, "r1": MOST_HELD, "r2": MOST_HELD}, admit.__name__
        assert _all_back(engine) and engine.scheduler.num_preemptions == 0
        await engine.close()


async def test_a_tight_cache_preempts_and_recomputes_windowed_sequences_with_the_same_tokens(tiny_model):
    """26 blocks (the longest sequence's 100 tokens fit: a recompute may need them all): the 60-token prompt
    computed here takes 15 of them, then 7; four sequences of up to 7 blocks each do not fit side by side, so
    they preempt, and a readmitted one recomputes from its cached prefix."""
    path = tiny_model("mistral-windowed")
    engine = _engine(path, num_blocks=26)
    prompts = PROMPTS + [list(range(200, 230))]
    got = await _run_all(engine, _computed_here, prompts)
    assert got == [_hf_greedy(path, p, NEW_TOKENS) for p in prompts]
    assert engine.scheduler.num_preemptions >= 1
    assert _all_back(engine)
    await engine.close()


async def test_speculation_takes_its_lookahead_blocks_past_the_dropped_ones(tiny_model):
    path = tiny_model("mistral-windowed")
    engine = _engine(path, num_blocks=64, speculative=SpeculativeConfig("ngram", 3, 1, 3))
    most = _most_held(engine)
    got = await _run_all(engine, _computed_here)
    assert got == [_hf_greedy(path, p, NEW_TOKENS) for p in PROMPTS]
    assert engine.speculator.num_accepted > 0  # the repeating prompt's proposals were taken
    assert max(most.values()) <= MOST_HELD + 1  # a window, and the lookahead's block
    assert _all_back(engine)
    await engine.close()
