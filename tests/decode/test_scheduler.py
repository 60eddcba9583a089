"""Scheduler: exact block ids on demand, preemption order, FIFO waiters, prefix hits and LRU eviction."""

from __future__ import annotations

import pytest

from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.server.decode.scheduler import QueueFull, Scheduler
from pdserve.server.decode.sequence import Sequence, SeqState

BS = 4


def _seq(rid: str, prompt: list[int]) -> Sequence:
    sampling = gen_pb.SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
    return Sequence(rid, prompt, sampling, frozenset(), max_model_len=4096)


def _run(s: Scheduler, seq: Sequence, first: int = 7) -> None:
    """Admitted, its KV 'arrived': it runs with its first token."""
    s.start(seq)
    seq.append(first)


def _step(s: Scheduler, token: int = 9) -> list[Sequence]:
    batch = s.schedule()
    for seq in batch:
        s.finished_step(seq)
        seq.append(token)
    return batch


def _available(s: Scheduler) -> int:
    return s.pool.num_free + s.cache.num_evictable


async def test_blocks_are_taken_when_a_token_crosses_a_block_boundary():
    s = Scheduler(num_blocks=8, block_size=BS, max_running=4, max_queue=4)
    a = _seq("a", [1, 2, 3, 4, 5, 6])  # 6 tokens: 2 blocks, not 1 + max_tokens' worth
    assert s.add(a) == [a] and a.block_table == [0, 1] and a.state is SeqState.WAITING_KV
    _run(s, a)  # 7 tokens
    assert _step(s) == [a] and a.block_table == [0, 1]  # writes position 6; 8 tokens after
    _step(s)  # writes position 7: still block 1
    assert a.block_table == [0, 1] and a.num_tokens == 9
    _step(s)  # writes position 8: the third block
    assert a.block_table == [0, 1, 2]
    s.retire(a)
    assert _available(s) == 8


async def test_the_most_recently_admitted_is_preempted_and_waits_at_the_head():
    s = Scheduler(num_blocks=4, block_size=BS, max_running=4, max_queue=4, enable_prefix_caching=False)
    a, b, c = _seq("a", [1, 2, 3]), _seq("b", [4, 5, 6]), _seq("c", [7, 8, 9])
    assert [s.add(seq) for seq in (a, b, c)] == [[a], [b], [c]]
    assert (a.block_table, b.block_table, c.block_table) == ([0], [1], [2])
    for seq in (a, b, c):
        _run(s, seq)  # 4 tokens each: the next step writes position 3, still their first block
    _step(s)  # 5 tokens each: the next step needs a second block each, one is free
    batch = s.schedule()
    assert a.block_table == [0, 3]  # a takes the last free block ...
    assert c.state is SeqState.WAITING and list(s.waiting) == [c] and c.block_table == []
    assert b.block_table == [1, 2]  # ... c, the newest, is preempted and b takes its block
    assert batch == [a, b] and s.num_preemptions == 1
    d = _seq("d", [1])
    s.add(d)
    assert list(s.waiting) == [c, d]  # c resumes first
    s.retire(a)
    assert s.admit() == [c]  # c needs 5 tokens' KV place (2 blocks): 0 and 3
    assert c.block_table == [0, 3] and c.resume_from == 0 and c.state is SeqState.RUNNING
    assert s.running == [b, c]


async def test_a_sequence_alone_preempts_itself_when_nothing_is_free():
    s = Scheduler(num_blocks=2, block_size=BS, max_running=4, max_queue=4, enable_prefix_caching=False)
    a = _seq("a", [1, 2, 3, 4, 5, 6, 7])
    s.add(a)
    _run(s, a)  # 8 tokens: fits 2 blocks
    _step(s)  # 9 tokens: a third block is needed, none exists
    assert s.schedule() == [] and list(s.waiting) == [a] and s.num_preemptions == 1


async def test_lookahead_takes_free_blocks_and_trim_gives_back_exactly_those_past_the_next_token():
    s = Scheduler(num_blocks=8, block_size=BS, max_running=4, max_queue=4)
    a = _seq("a", [1, 2, 3, 4, 5, 6])
    s.add(a)
    _run(s, a)  # 7 tokens: the next step writes position 6, in block 1
    assert s.schedule() == [a] and a.block_table == [0, 1]
    assert s.reserve_lookahead(a, 0) == 0 and a.block_table == [0, 1]  # no proposal: nothing taken
    assert s.reserve_lookahead(a, 6) == 6  # positions 7..12: blocks 2 and 3
    assert a.block_table == [0, 1, 2, 3] and s.pool.num_free == 4
    s.finished_step(a)
    a.append(7)  # one proposal accepted, then the model's own token: 9 tokens
    a.append(8)
    assert s.trim(a) == [3] and a.block_table == [0, 1, 2] and s.pool.num_free == 5  # block 2 holds position 8
    assert s.trim(a) == [] and a.block_table == [0, 1, 2]
    assert s.reserve_lookahead(a, 2) == 2 and a.block_table == [0, 1, 2]  # positions 9, 10: block 2's room
    _step(s)  # a plain step: 10 tokens, nothing past the next token's block
    assert s.trim(a) == [] and a.block_table == [0, 1, 2]
    # the full prompt block, cached at start, and block 1 once the step wrote its last position's KV (never the
    # look-ahead blocks)
    assert s.cache.num_cached == 2 and s.cache._by_hash == dict(zip(s.cache.hasher.hashes(a.token_ids, BS), [0, 1]))
    s.retire(a)
    assert _available(s) == 8


async def test_lookahead_is_cut_to_the_free_blocks_never_preempting_nor_evicting():
    s = Scheduler(num_blocks=5, block_size=BS, max_running=4, max_queue=4, max_tails=0)  # full blocks alone (tails: test_scheduler_tails.py)
    p = _seq("p", [1, 1, 1, 1, 2])
    s.add(p)
    _run(s, p)
    s.retire(p)  # block 0 stays cached (evictable), block 1 goes back to the pool
    a, b = _seq("a", [5, 6, 7, 8, 9, 10, 11]), _seq("b", [3, 4, 5])  # 7 tokens: 2 blocks; 3 tokens: 1 block
    assert s.add(a) == [a] and s.add(b) == [b]
    assert (a.block_table, b.block_table) == ([2, 3], [4])
    _run(s, a)  # 8 tokens: block 1 is the last free one
    _run(s, b)  # 4 tokens
    assert s.schedule() == [a, b] and s.pool.num_free == 1 and s.cache.num_evictable == 1  # p's block 0
    assert s.reserve_lookahead(a, 9) == 4  # 9 asked: positions 8..11 fit the one free block
    assert a.block_table == [2, 3, 1] and s.pool.num_free == 0
    assert s.reserve_lookahead(b, 2) == 0 and b.block_table == [4]  # its block is full and none is free
    assert s.cache.num_evictable == 1 and s.cache.num_cached == 2  # p's block 0 was not evicted (a's block 2: held)
    assert s.num_preemptions == 0 and s.running == [a, b] and list(s.waiting) == []
    s.finished_step(a)
    a.append(7)  # every proposal rejected: 9 tokens, its next token's input in block 1
    assert s.trim(a) == [] and a.block_table == [2, 3, 1]
    s.retire(a)
    s.retire(b)
    assert _available(s) == 5


async def test_waiters_are_admitted_in_arrival_order():
    s = Scheduler(num_blocks=4, block_size=BS, max_running=8, max_queue=2, enable_prefix_caching=False)
    a = _seq("a", list(range(8)))  # 2 blocks
    s.add(a)
    big, small = _seq("big", list(range(12))), _seq("small", [1])  # 3 blocks, 1 block
    assert s.add(big) == [] and s.add(small) == []  # small would fit, but big is first
    with pytest.raises(QueueFull):
        s.add(_seq("x", [1]))
    assert s.admit() == [] and list(s.waiting) == [big, small]
    s.retire(a)
    assert s.admit() == [big, small]
    assert (big.block_table, small.block_table) == ([2, 3, 0], [1])


async def test_a_shared_prefix_reuses_cached_blocks_and_lru_evicts():
    s = Scheduler(num_blocks=6, block_size=BS, max_running=8, max_queue=8, max_tails=0)  # full blocks alone (tails: test_scheduler_tails.py)
    system = list(range(100, 108))  # 2 full blocks
    a = _seq("a", system + [1, 2, 3])
    s.add(a)
    assert a.block_table == [0, 1, 2] and a.num_hit_blocks == 0
    _run(s, a)
    s.retire(a)  # its 2 full prompt blocks stay cached; 11 tokens' KV ... only full blocks count
    assert (s.pool.num_free, s.cache.num_cached, _available(s)) == (4, 2, 6)
    b = _seq("b", system + [4, 5, 6, 7, 8])
    assert s.add(b) == [b]
    assert b.block_table == [0, 1, 3, 4] and b.num_hit_blocks == 2 and b.num_cached_tokens == 8
    other = _seq("o", list(range(200, 208)))  # 2 blocks: the free ones; b holds 0 and 1
    assert s.add(other) == [other] and other.block_table == [5, 2]
    s.retire(other)
    s.retire(b)
    assert _available(s) == 6


async def test_lru_eviction_order_and_a_whole_prompt_never_hits_its_last_token():
    s = Scheduler(num_blocks=4, block_size=BS, max_running=8, max_queue=8, max_tails=0)  # full blocks alone (tails: test_scheduler_tails.py)
    p, q = [1, 1, 1, 1, 2], [3, 3, 3, 3, 4]
    for rid, prompt in (("p", p), ("q", q)):
        seq = _seq(rid, prompt)
        s.add(seq)
        _run(s, seq)
        s.retire(seq)
    # p's first block (0) and q's (2) are cached; p was used before q
    assert s.cache.num_cached == 2 and s.pool.num_free == 2
    r = _seq("r", [9] * 12)  # 3 blocks: the two free ones, then p's block (least recently used)
    s.add(r)
    assert r.block_table == [1, 3, 0] and s.cache.num_cached == 1
    hit = _seq("q2", [3, 3, 3, 3, 5])  # q's first block is cached; a second is needed and none is left
    assert s.add(hit) == [] and s.pool.ref_count(2) == 1  # the hit it looked up is given back
    s.retire(r)
    assert s.admit() == [hit] and hit.num_hit_blocks == 1 and hit.block_table == [2, 1]
    whole = _seq("q3", [3, 3, 3, 3])  # a prompt of one full cached block: its last token is computed
    assert s.add(whole) == [whole] and whole.num_hit_blocks == 0 and whole.block_table == [3]
    s.retire(hit)
    s.retire(whole)
    s.cache.clear()
    assert s.pool.num_free == 4


async def test_a_prompt_asking_prompt_logprobs_reuses_no_cached_prefix():
    """Its local prefill needs every position's logits, so its whole prompt is computed (fresh blocks)."""
    s = Scheduler(num_blocks=8, block_size=BS, max_running=8, max_queue=8)
    system = list(range(100, 108))  # 2 full blocks
    a = _seq("a", system + [1, 2, 3])
    s.add(a)
    _run(s, a)
    s.retire(a)  # blocks 0 and 1 stay cached
    b = _seq("b", system + [4, 5])
    b.sampling.prompt_logprobs = 1
    assert s.add(b) == [b]
    assert b.block_table == [3, 4, 5] and b.num_hit_blocks == 0 and b.num_cached_tokens == 0


async def test_blocks_whose_windowed_kv_never_arrived_are_not_cached_for_others():
    """A windowed model's prompt whose first 2 blocks lack the windowed layers' KV (the prefill tier sent none
    behind the window): retired, it caches only its own prefix hits, and a prompt sharing its start reuses
    nothing; a sequence without stale blocks caches as before."""
    s = Scheduler(num_blocks=8, block_size=BS, max_running=8, max_queue=8)
    system = list(range(100, 108))  # 2 full blocks
    a = _seq("a", system + list(range(8)))
    s.add(a)
    a.num_stale_blocks = 2  # (decode/first_token.py sets it, windows.stale_blocks, when the KV arrived)
    _run(s, a)
    s.retire(a)
    assert s.cache.num_cached == 0 and a.num_stale_blocks == 0
    b = _seq("b", system + [1])
    assert s.add(b) == [b] and b.num_hit_blocks == 0
    _run(s, b)
    s.retire(b)  # no stale blocks: its 2 full blocks are cached
    c = _seq("c", system + [2])
    assert s.add(c) == [c] and c.num_hit_blocks == 2


# ---- sliding windows: every layer windowed (W = 8, two blocks), so blocks behind the window go back -------

WINDOWS = (8, 8)
NULL = 8  # Scheduler(num_blocks=8).null_block: one past the pool's ids


async def test_a_windowed_sequence_returns_the_blocks_behind_its_window_as_it_grows():
    s = Scheduler(num_blocks=8, block_size=BS, max_running=4, max_queue=4, windows=WINDOWS)
    assert s.drops_blocks and s.null_block == NULL
    a = _seq("a", list(range(14)))  # its first query (position 14) reads keys 7..14: block 0 is behind
    assert s.add(a) == [a] and a.block_table == [NULL, 0, 1, 2] and a.num_dropped_blocks == 1
    a.num_stale_blocks = 1  # the prefill tier sent no KV for block 0 (decode/first_token.py sets it)
    _run(s, a)  # 15 tokens
    tables = []
    for _ in range(6):
        s.schedule()
        tables.append(list(a.block_table))
        s.finished_step(a)
        a.append(9)
    assert tables == [
        [NULL, 0, 1, 2],  # 15 tokens: the query at 14 reads 7..14
        [NULL, NULL, 1, 2],  # 16: the query at 15 reads 8..15, block 0 goes back (before any block is taken)
        [NULL, NULL, 1, 2, 3],  # 17: position 16 takes a block
        [NULL, NULL, 1, 2, 3],
        [NULL, NULL, 1, 2, 3],
        [NULL, NULL, NULL, 2, 3],  # 20: the query at 19 reads 12..19
    ]
    for _ in range(40):  # never more than ceil(W / block) + 1 = 3 blocks, whatever the length
        s.schedule()
        assert s.blocks_held(a) <= 3 and a.num_dropped_blocks == s.behind_window(a.num_tokens - 1)
        assert a.block_table[: a.num_dropped_blocks] == [NULL] * a.num_dropped_blocks
        assert NULL not in a.block_table[a.num_dropped_blocks :]
        assert s.pool.num_free == 8 - s.blocks_held(a)
        s.finished_step(a)
        a.append(9)
    s.retire(a)
    assert s.pool.num_free == 8 and s.cache.num_cached == 0  # block 0 never had KV: nothing after it is cached
    again = _seq("again", list(range(14)) + [5])
    assert s.add(again) == [again] and again.num_hit_blocks == 0  # no freed block is lent as a cached prefix


async def test_blocks_dropped_with_their_kv_stay_cached_for_a_prompt_sharing_them():
    """A prompt computed here (a local prefill) takes every block, caches its full ones, then drops those
    behind the window: they stay in the prefix cache (evictable). A prompt sharing them takes the hits it
    reads and gives back the ones behind its own window."""
    s = Scheduler(num_blocks=8, block_size=BS, max_running=4, max_queue=4, windows=WINDOWS)
    a = _seq("a", list(range(100, 114)))
    a.local_prefill = True
    assert s.add(a) == [a] and a.block_table == [0, 1, 2, 3] and a.num_dropped_blocks == 0
    _run(s, a)  # its 3 full prompt blocks cached
    s.schedule()  # the query at 14 reads 7..14: block 0 goes back to the cache
    assert a.block_table == [NULL, 1, 2, 3] and s.cache.num_cached == 3 and s.cache.num_evictable == 1
    b = _seq("b", list(range(100, 112)) + [7] * 6)  # 18 tokens, its first 3 blocks cached; its window: 11..18
    assert s.add(b) == [b]
    assert b.block_table == [NULL, NULL, 2, 4, 5] and b.num_hit_blocks == 3 and b.num_cached_tokens == 12
    assert (s.pool.ref_count(0), s.pool.ref_count(1), s.pool.ref_count(2)) == (1, 2, 3)  # cache, a, b
    s.retire(b)
    s.retire(a)
    assert _available(s) == 8


async def test_a_preempted_windowed_sequence_is_readmitted_with_its_window_only():
    s = Scheduler(num_blocks=6, block_size=BS, max_running=4, max_queue=4, windows=WINDOWS)  # null block: 6
    a = _seq("a", list(range(100, 114)))
    a.local_prefill = True
    s.add(a)
    _run(s, a)
    for _ in range(6):
        _step(s)  # 21 tokens
    s.schedule()
    assert a.block_table == [6, 6, 6, 3, 4, 5] and a.num_tokens == 21
    s.preempt(a)  # blocks 3, 4 (full, with KV) cached beside 0-2: the chain of its first 20 tokens
    assert s.cache.num_cached == 5 and s.pool.num_free == 1 and a.block_table == []
    assert s.admit() == [a]  # 20 tokens' KV cached; the query at 20 reads 13..20: blocks 3, 4 and one fresh
    assert a.block_table == [6, 6, 6, 3, 4, 5] and a.resume_from == 20 and a.num_dropped_blocks == 3
    s.retire(a)
    assert _available(s) == 6


async def test_more_windowed_sequences_fit_a_fixed_cache_than_full_attention_ones():
    """12 blocks, prompts of 30 tokens (8 blocks): one fits with full attention; with a window of 8 each holds
    at most 3 blocks, so four run side by side, for ever, without a preemption."""
    admitted = {}
    for windows in ((), WINDOWS, (8, 0)):  # (8, 0): a global layer reads every block, so none is dropped
        s = Scheduler(num_blocks=12, block_size=BS, max_running=8, max_queue=8, windows=windows,
                      enable_prefix_caching=False)
        seqs = [_seq(f"s{i}", list(range(i * 50, i * 50 + 30))) for i in range(5)]
        admitted[windows] = [taken.request_id for seq in seqs for taken in s.add(seq)]
        if windows == WINDOWS:
            for seq in seqs[:4]:
                _run(s, seq)
            for _ in range(24):
                assert _step(s) == seqs[:4]
                assert max(s.blocks_held(seq) for seq in seqs[:4]) <= 3
            assert s.num_preemptions == 0 and seqs[4].state is SeqState.WAITING
    assert admitted == {(): ["s0"], WINDOWS: ["s0", "s1", "s2", "s3"], (8, 0): ["s0"]}
