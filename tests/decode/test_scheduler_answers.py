"""The answer's KV is kept: each block of a sequence enters the prefix cache (and a BlockStored event) the step its
KV is complete, under vLLM's hash of prompt + output tokens, so the conversation's next turn reuses it; rejected
look-ahead slots, stale blocks and dropped blocks keep their rules; conditional disaggregation's rule decides at
admission from the blocks hit."""

from __future__ import annotations

import hashlib
import os

import cbor2

from pdserve.kvcache.block_hash import BlockHasher
from pdserve.kvcache.kv_events import BlockStored, KvEventRecorder
from pdserve.server.decode.local_prefill_rule import LocalPrefillRule
from pdserve.server.decode.scheduler import Scheduler
from pdserve.server.decode.sequence import Sequence, SeqState
from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.v1 import worker_pb2 as pb

BS = 4


def vllm_hashes(tokens: list[int]) -> list[bytes]:
    """vLLM's sha256_cbor chain over the full blocks, computed here from its definition (not pdserve's hasher):
    sha256(cbor2 canonical((parent or NONE_HASH, tuple(block), None))), NONE_HASH = sha256(cbor2(seed))."""
    def h(value) -> bytes:
        return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()

    parent, out = h(os.getenv("PYTHONHASHSEED", "vllm-none-hash")), []
    for i in range(len(tokens) // BS):
        parent = h((parent, tuple(tokens[i * BS : (i + 1) * BS]), None))
        out.append(parent)
    return out


def _scheduler(num_blocks: int = 16, windows: tuple[int, ...] = ()) -> tuple[Scheduler, KvEventRecorder]:
    events = KvEventRecorder("GPU", int_hashes=False)
    return Scheduler(num_blocks, BS, max_running=4, max_queue=4, windows=windows,
                     hasher=BlockHasher("sha256_cbor"), kv_events=events), events


def _seq(rid: str, prompt: list[int], rule: LocalPrefillRule | None = None) -> Sequence:
    sampling = gen_pb.SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
    return Sequence(rid, prompt, sampling, frozenset(), max_model_len=4096, local_prefill_rule=rule)


def _step(s: Scheduler, token: int) -> None:
    for seq in s.schedule():
        s.finished_step(seq)
        seq.append(token)


def _cached(s: Scheduler) -> dict[bytes, int]:
    """hash -> block id of every block the prefix cache holds."""
    return dict(s.cache._by_hash)


def _stored(events: KvEventRecorder) -> list[tuple[list[bytes], bytes | None, list[int]]]:
    out = [(e.block_hashes, e.parent_block_hash, e.token_ids) for e in events.pending if isinstance(e, BlockStored)]
    assert len(out) == len(events.pending)  # nothing removed or cleared here
    return out


async def test_each_answer_block_is_cached_the_step_its_kv_is_complete_under_vllms_hash():
    s, events = _scheduler()
    a = _seq("a", [1, 2, 3, 4, 5, 6])
    s.add(a)
    s.start(a)  # the prompt's KV arrived: block 0 cached
    a.append(7)
    h = vllm_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
    assert _cached(s) == {h[0]: 0}
    _step(s, 8)  # wrote position 6: block 1 ([5, 6, 7, 8]) still lacks position 7's KV
    assert _cached(s) == {h[0]: 0}
    _step(s, 9)  # wrote position 7 (token 8): block 1 complete, with the answer's first two tokens
    assert _cached(s) == {h[0]: 0, h[1]: 1}
    for token in (10, 11, 12):
        _step(s, token)
    assert a.token_ids == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12] and _cached(s) == {h[0]: 0, h[1]: 1}
    _step(s, 13)  # wrote position 11: block 2, all the answer's, complete
    assert _cached(s) == {h[0]: 0, h[1]: 1, h[2]: 2}
    assert _stored(events) == [([h[0]], None, [1, 2, 3, 4]), ([h[1]], h[0], [5, 6, 7, 8]),
                               ([h[2]], h[1], [9, 10, 11, 12])]
    a.finish(gen_pb.FINISH_REASON_LENGTH)
    s.retire(a)  # nothing new: every complete block is in already
    assert len(events.pending) == 3 and _cached(s) == {h[0]: 0, h[1]: 1, h[2]: 2}

    # the next turn: the history (prompt + answer) and new text hits the answer's blocks too
    b = _seq("b", [*a.token_ids, 20, 21], LocalPrefillRule(max_uncached=4))
    assert s.add(b) == [b]
    assert b.block_table[:3] == [0, 1, 2] and b.num_hit_blocks == 3 and b.num_cached_tokens == 12
    assert b.local_prefill  # 3 tokens left to compute, fewer than 4: this worker prefills them


async def test_rejected_lookahead_slots_never_enter_the_cache():
    s, events = _scheduler()
    a = _seq("a", [1, 2, 3, 4])
    s.add(a)
    s.start(a)
    a.append(5)  # 5 tokens: the next step writes position 4, in block 1
    s.schedule()
    assert s.reserve_lookahead(a, 6) == 6 and a.block_table == [0, 1, 2]  # positions 5..10
    # the verify step wrote positions 4..10 (the last token and 6 proposals), which would fill block 1; none was
    # accepted: the model's own token (50) follows
    s.finished_step(a)
    a.append(50)
    assert s.trim(a) == [2] and _cached(s) == {vllm_hashes([1, 2, 3, 4])[0]: 0}
    for token in (51, 52, 53):  # positions 5, 6, 7 rewritten with the accepted tokens' KV
        _step(s, token)
    h = vllm_hashes([1, 2, 3, 4, 5, 50, 51, 52])
    assert a.token_ids[:8] == [1, 2, 3, 4, 5, 50, 51, 52] and _cached(s) == {h[0]: 0, h[1]: 1}
    assert [stored[0] for stored in _stored(events)] == [[h[0]], [h[1]]]


async def test_a_sequence_with_stale_blocks_caches_none_of_its_own():
    s, events = _scheduler()
    a = _seq("a", [1, 2, 3, 4, 5, 6, 7, 8])
    s.add(a)
    a.num_stale_blocks = 1  # a windowed layer got no KV for block 0 (KvArrival notes it before start)
    s.start(a)
    a.append(9)
    for token in range(10, 20):
        _step(s, token)
    assert a.num_tokens == 19 and _cached(s) == {} and events.pending == []
    s.retire(a)
    assert _cached(s) == {} and s.cache.num_available == 16


async def test_blocks_dropped_behind_every_window_were_cached_when_complete():
    s, events = _scheduler(windows=(8, 8))  # every layer windowed: blocks behind the window go back to the pool
    a = _seq("a", [1, 2, 3, 4])
    s.add(a)
    s.start(a)
    a.append(5)
    for token in range(6, 18):
        _step(s, token)
    tokens = list(range(1, 18))
    assert a.token_ids == tokens
    h = vllm_hashes(tokens)  # 4 full blocks
    # the next query is position 16: blocks 0 and 1 are behind the window of 8 (2 dropped at the next schedule)
    s.schedule()
    assert a.num_dropped_blocks == 2 and a.block_table[:2] == [s.null_block] * 2
    assert sorted(_cached(s)) == sorted(h) and [stored[0] for stored in _stored(events)] == [[x] for x in h]
    assert s.cache.num_evictable == 2  # the dropped ones: cached, held by no sequence


async def test_the_rule_takes_a_short_uncached_suffix_of_a_cached_prompt():
    s, _ = _scheduler()
    history = list(range(1, 13))  # 3 full blocks, cached by a first sequence
    first = _seq("first", history + [99])
    s.add(first)
    s.start(first)
    s.retire(first)

    def admitted(rid: str, prompt: list[int], rule: LocalPrefillRule | None, local: bool = False) -> Sequence:
        seq = _seq(rid, prompt, rule)
        seq.local_prefill = local
        assert s.add(seq) == [seq] and seq.state is SeqState.WAITING_KV
        s.retire(seq)
        return seq

    rule = LocalPrefillRule(max_uncached=4)
    short = admitted("short", history + [20, 21, 22], rule)  # 12 cached, 3 to compute
    assert (short.num_hit_blocks, short.local_prefill) == (3, True)
    assert not admitted("long", history + [20, 21, 22, 23], rule).local_prefill  # 4 to compute: the prefill tier
    assert not admitted("cold", [50, 51, 52], rule).local_prefill  # nothing cached here
    assert admitted("cold-any", [50, 51, 52], LocalPrefillRule(max_uncached=4, min_cached=0)).local_prefill
    assert not admitted("held", history + [20], LocalPrefillRule(max_uncached=4, min_cached=13)).local_prefill
    assert not admitted("none", history + [20], None).local_prefill
    assert admitted("asked", [60, 61] * 10, None, local=True).local_prefill  # no prefill worker: always


async def test_a_sequence_decided_when_admitted_not_while_it_waits():
    s, _ = _scheduler(num_blocks=4)
    history = [1, 2, 3, 4]
    a = _seq("a", history + [5])  # 2 blocks
    s.add(a)
    s.start(a)
    filler = _seq("filler", [7, 8, 9, 10, 11])  # 2 more: the pool is full
    s.add(filler)
    b = _seq("b", history + [30, 31], LocalPrefillRule(max_uncached=3))
    assert s.add(b) == [] and not b.local_prefill  # waits: one block short
    s.retire(filler)
    assert s.admit() == [b] and b.block_table[0] == 0 and b.local_prefill  # block 0 hit, 2 tokens to compute


def test_the_rule_comes_from_the_request():
    assert LocalPrefillRule.of(pb.DecodeRequest()) is None
    assert LocalPrefillRule.of(pb.DecodeRequest(local_prefill=True, local_prefill_max_uncached=8)) is None
    assert LocalPrefillRule.of(pb.DecodeRequest(local_prefill_max_uncached=8, local_prefill_min_cached=16)) \
        == LocalPrefillRule(8, 16)
