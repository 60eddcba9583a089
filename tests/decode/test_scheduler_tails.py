"""Tails on the decode scheduler: an ended (or preempted) sequence's last partial block with KV is kept, and a
sequence computed here takes it after its cached full blocks (copied into a fresh block of its own, then given
back); never across adapters, never once its block went to another sequence, never for a prompt the prefill tier
computes."""

from __future__ import annotations

from pdserve.kvcache.adapter_key import AdapterKey
from pdserve.kvcache.block_hash import BlockHasher
from pdserve.kvcache.kv_events import BlockStored, KvEventRecorder
from pdserve.server.decode.local_prefill_rule import LocalPrefillRule
from pdserve.server.decode.scheduler import Scheduler
from pdserve.server.decode.sequence import Sequence, SeqState
from pdserve.v1 import generation_pb2 as gen_pb

BS = 4
LOCAL = LocalPrefillRule(max_uncached=2048)  # conditional disaggregation with Dynamo's threshold


def _scheduler(num_blocks: int = 16, events: KvEventRecorder | None = None) -> Scheduler:
    return Scheduler(num_blocks, BS, max_running=4, max_queue=4, hasher=BlockHasher("sha256_cbor"), kv_events=events)


def _seq(rid: str, prompt: list[int], rule: LocalPrefillRule | None = LOCAL, max_tokens: int = 1000) -> Sequence:
    sampling = gen_pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return Sequence(rid, prompt, sampling, frozenset(), max_model_len=4096, local_prefill_rule=rule)


def _turn(s: Scheduler, seq: Sequence, answer: list[int]) -> None:
    """Admitted, its KV in place (the engine's copy of a taken tail done), it answers `answer` and ends."""
    s.add(seq)
    s.tail_copied(seq)
    s.start(seq)
    seq.append(answer[0])
    for token in answer[1:]:
        s.schedule()
        s.finished_step(seq)
        seq.append(token)
    s.retire(seq)


async def test_the_next_turn_takes_the_answers_partial_block_and_computes_only_the_new_tokens():
    s = _scheduler()
    a = _seq("a", [10, 11, 12, 13, 14, 15])
    _turn(s, a, [20, 21, 22])  # 9 tokens, KV for 8 (the last answer token never ran): 2 full blocks, no tail
    assert len(s.cache.tails) == 0 and s.cache.num_cached == 2
    b = _seq("b", a.token_ids + [30, 31, 32, 33])  # 13 tokens
    _turn(s, b, [40, 41])  # 15 tokens, KV for 14: 3 full blocks and a tail of 2
    assert b.num_cached_tokens == 0  # retired
    (tail,) = s.cache.tails._lru.values()
    assert tail.tokens == (33, 40) and tail.parent == s.cache.hasher.hashes(b.token_ids, BS)[2]
    tail_block = tail.block_id
    c = _seq("c", b.token_ids + [50, 51])  # 17 tokens: 14 held, 3 to compute (the answer's last and 2 new)
    s.add(c)
    assert c.local_prefill and c.num_hit_blocks == 3 and c.num_cached_tokens == 14
    assert c.tail_copy == (tail, c.block_table[3]) and c.block_table[3] != tail_block
    assert len(s.cache.tails) == 0 and s.pool.ref_count(tail_block) == 1  # held by the sequence until copied
    s.tail_copied(c)
    assert len(s.cache.tails) == 1 and c.tail_copy is None  # given back unchanged, evictable again
    s.start(c)
    assert s.cache.num_cached == 4  # the copy's block is complete now: 4 full blocks


async def test_a_prompt_the_prefill_tier_computes_takes_no_tail_and_its_block_is_sent_whole():
    s = _scheduler()
    _turn(s, a := _seq("a", [1, 2, 3, 4, 5, 6]), [7])  # KV for 6: a full block and a tail of 2
    assert [t.tokens for t in s.cache.tails._lru.values()] == [(5, 6)]
    remote = _seq("r", a.token_ids + [8, 9, 10, 11, 12], rule=LocalPrefillRule(max_uncached=3))  # 7 uncached >= 3
    s.add(remote)
    assert not remote.local_prefill and remote.tail_copy is None
    assert remote.num_hit_blocks == 1 and remote.num_cached_tokens == 4 and len(s.cache.tails) == 1
    local = _seq("l", a.token_ids + [8, 9, 10, 11, 12], rule=LocalPrefillRule(max_uncached=7))  # 6 uncached < 7
    s.add(local)
    assert local.local_prefill and local.num_cached_tokens == 6 and local.tail_copy is not None


async def test_a_tail_is_never_taken_under_another_adapter():
    s = _scheduler()
    ada, bob = AdapterKey(1, "ada", "/a"), AdapterKey(2, "bob", "/b")
    a = _seq("a", [1, 2, 3, 4, 5, 6])
    a.lora = type("Lora", (), {"key": ada})()
    _turn(s, a, [7])
    for key in (bob, None):
        other = _seq(f"other-{key}", a.token_ids + [8, 9])
        if key is not None:
            other.lora = type("Lora", (), {"key": key})()
        s.add(other)
        assert other.tail_copy is None and other.num_cached_tokens == 0, key  # not even ada's full block
        s.retire(other, keep_kv=False)
    again = _seq("again", a.token_ids + [8, 9])
    again.lora = type("Lora", (), {"key": ada})()
    s.add(again)
    assert again.num_cached_tokens == 6 and again.tail_copy[0].extra_keys == ada.extra_keys


async def test_a_tail_whose_block_went_to_another_sequence_is_gone():
    s = _scheduler(num_blocks=4)
    _turn(s, a := _seq("a", [1, 2, 3, 4, 5, 6]), [7])  # block 0 cached, block 1 a tail of (5, 6)
    assert s.pool.num_free == 2 and len(s.cache.tails) == 1
    other = _seq("o", [90] * 12, rule=None)  # 3 blocks: the 2 free ones, then the tail's (before the cached one)
    s.add(other)
    assert other.block_table == [2, 3, 1] and len(s.cache.tails) == 0 and s.cache.num_cached == 1
    s.retire(other, keep_kv=False)
    b = _seq("b", a.token_ids + [8])
    s.add(b)
    assert b.num_cached_tokens == 4 and b.tail_copy is None  # the full block alone


async def test_a_preempted_sequence_keeps_its_tail_and_resumes_after_it():
    s = _scheduler()
    a = _seq("a", [1, 2, 3, 4, 5], rule=None)
    s.add(a)
    s.start(a)
    a.append(6)
    s.schedule()
    s.finished_step(a)
    a.append(7)  # 7 tokens, KV for 6: a full block and (5, 6)
    s.preempt(a)
    assert [t.tokens for t in s.cache.tails._lru.values()] == [(5, 6)]
    assert s.admit() == [a] and a.resume_from == 6 and a.num_cached_tokens == 6  # recomputes token 7's KV alone
    assert a.tail_copy[0].tokens == (5, 6) and a.tail_copy[1] == a.block_table[1]


async def test_the_tail_dies_first_when_a_preemption_needs_its_block():
    """Preempted because no block was left, a sequence's tail is the first block the next allocation takes."""
    s = _scheduler(num_blocks=3)
    a, b = _seq("a", [1, 2, 3], rule=None), _seq("b", [5, 6, 7, 8, 9], rule=None)
    for seq, first in ((a, 4), (b, 10)):
        s.add(seq)
        s.start(seq)
        seq.append(first)
    batch = s.schedule()
    for seq, token in zip(batch, (11, 12)):
        s.finished_step(seq)
        seq.append(token)  # a: 5 tokens (its next token needs block 2), b: 7 tokens, KV for 6
    assert s.schedule() == [a] and b.state is SeqState.WAITING and s.num_preemptions == 1
    assert a.block_table == [0, 2] and len(s.cache.tails) == 0 and s.cache.num_cached == 2  # b's tail (9, 10) went


async def test_tails_publish_no_kv_event():
    events = KvEventRecorder("GPU", int_hashes=False)
    s = _scheduler(events=events)
    _turn(s, a := _seq("a", [1, 2, 3, 4, 5, 6]), [7])
    _turn(s, _seq("b", a.token_ids + [8, 9]), [10])
    stored = [e.token_ids for e in events.pending if isinstance(e, BlockStored)]
    assert stored == [[1, 2, 3, 4], [5, 6, 7, 8]] and len(s.cache.tails) == 2  # (5, 6) and (9,)


async def test_a_tail_never_copied_is_given_back_and_the_block_holding_no_kv_is_not_kept():
    s = _scheduler()
    _turn(s, a := _seq("a", [1, 2, 3, 4, 5, 6]), [7])
    b = _seq("b", a.token_ids + [8, 9])
    s.add(b)
    assert b.tail_copy is not None
    s.retire(b)  # aborted before the engine copied: num_cached_tokens rounds down to the full block
    assert [t.tokens for t in s.cache.tails._lru.values()] == [(5, 6)] and s.pool.num_free == 14
