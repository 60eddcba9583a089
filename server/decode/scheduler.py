"""Which sequences hold blocks and which decode each step: a FIFO waiting queue, blocks on demand, preemption.

A sequence's life here:
1. `add`: admitted at once if it fits and nobody waits; else it waits in the queue (at most
   `max_queue` new sequences wait; one more is QueueFull).
2. `admit` takes sequences from the head of the queue, in order, while the running cap allows and
   their blocks fit: the prompt's blocks (cached prefix blocks reused, the rest fresh). The head that
   does not fit blocks everyone behind it, so a big request is never starved by small ones. A request
   with a `local_prefill_rule` (conditional disaggregation) is marked `local_prefill` here when the
   rule takes what the cache holds of its prompt: this worker then computes the rest. With offload tiers
   (`kv_offload.py`), the blocks after the device cache's hits that a tier holds count as hits too: they get fresh
   blocks, listed in `offload_loads`, which the engine loads before it announces the sequence admitted. A sequence
   computed here (a local prefill, a readmitted one) also takes a kept tail (`kvcache/tail_cache.py`) whose tokens
   follow those blocks: its KV is copied into the sequence's next fresh block (`tail_copy`, done by the engine, then
   `tail_copied`) and the prompt is computed from after it; a new prompt with offload tiers whose device cache
   lacks that tail takes one the tiers hold (`offload_tail`, loaded with `offload_loads`). (A prompt the prefill
   tier computes takes none: the prefill worker computes and sends that block whole.)
3. `start`: its KV arrived; it runs. Its full prompt blocks enter the prefix cache, and each later block (the
   answer's) as soon as its KV is complete (`finished_step`: the step after its last token ran), so the next
   turn of a conversation finds its history, the model's own answers included, cached here. Only accepted tokens
   count: a rejected look-ahead slot's KV never completes a block.
4. `schedule` before each step: every running sequence takes the next block when its next token
   crosses a block boundary. None free: the most recently admitted running sequence is preempted:
   its full blocks go to the prefix cache, the rest back to the pool, and it returns to the head of
   the queue. Readmitted, it reuses what the cache still holds and re-prefills the rest locally.
   With speculation, `reserve_lookahead` then gives a sequence blocks for the step's look-ahead slots from the
   free ones (never preempting, never evicting a cached block: a proposal that does not fit is shortened), and
   `trim`, after the step's tokens are appended, takes back those that held only rejected slots.
5. `retire`: finished or aborted; its full blocks with KV are cached, its last partial block with KV kept as a
   tail (as on preemption), every other reference dropped.

Sliding windows: when every layer of the model is windowed (Mistral with `sliding_window`), a block wholly
behind the widest window is never read again. Admission takes no block for a new prompt's blocks behind the
window (the prefill tier sends none), and `schedule` returns each running sequence's blocks as they fall
behind (a complete one enters the prefix cache first), so a sequence holds at most ceil(W / block_size) + 1
blocks, whatever its length. The table keeps its positions: `null_block`, one physical block past the pool's
that no layer reads, stands in each dropped entry (vLLM's null block). A prompt computed here (a local
prefill, a preempted sequence's recompute) takes every block its forward writes and drops them at its next
step. A model whose local and global layers alternate (Gemma 2 and 3) keeps every block: its global layers
read them all, and every layer's KV of a token shares one block id (`PagedKvCache`).
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

from pdserve.kvcache.adapter_key import extra_keys
from pdserve.kvcache.block_hash import DEFAULT_HASHER, BlockHasher
from pdserve.kvcache.block_pool import BlockPool
from pdserve.kvcache.kv_events import KvEventRecorder
from pdserve.kvcache.layout import blocks_behind_windows
from pdserve.kvcache.prefix_cache import PrefixCache
from pdserve.kvcache.tail_cache import Tail
from pdserve.server.decode.sequence import Sequence, SeqState


class Offload(Protocol):
    """The offload tiers as the scheduler sees them (`kv_offload.KvOffload`)."""

    def held(self, hashes: list[bytes]) -> int: ...

    def spill(self, evicted: list[tuple[int, bytes]]) -> None: ...

    def held_tail(self, parent: bytes | None, extra_keys: tuple | None, tokens: list[int]) -> Tail | None: ...

    def spill_tails(self, tails: list[Tail]) -> None: ...


class QueueFull(Exception):
    """The waiting queue holds `max_queue` new sequences already."""


class Scheduler:
    def __init__(self, num_blocks: int, block_size: int, max_running: int, max_queue: int,
                 enable_prefix_caching: bool = True, windows: tuple[int, ...] = (), *,
                 hasher: BlockHasher = DEFAULT_HASHER, kv_events: KvEventRecorder | None = None,
                 max_tails: int | None = None):
        """windows: each layer's sliding window (0: full attention), as `KvLayout.windows`; hasher: names the
        prefix cache's blocks (vLLM's hash); kv_events: records what the prefix cache stores and evicts;
        max_tails: ended sequences' partial blocks kept (None: a quarter of the blocks; none when every layer is
        windowed)."""
        self.block_size = block_size
        self.windows = windows
        self._widest = (max(windows),) if windows and all(windows) else ()
        """What `blocks_behind_windows` reads of the windows (the widest, when every layer has one), kept so that
        a step's per-sequence checks do not walk every layer's window."""
        self.null_block = num_blocks
        """The block id that stands in a dropped entry of a block table: one past the pool's, so the paged cache
        holds one more block (the engine's pad block) when `drops_blocks`; never handed out, never read."""
        self.max_running = max_running
        self.max_queue = max_queue
        self.pool = BlockPool(num_blocks)
        if max_tails is None:
            max_tails = 0 if self._widest else num_blocks // 4
        self.cache = PrefixCache(self.pool, enable_prefix_caching, hasher=hasher, events=kv_events,
                                 max_tails=max_tails)
        self.waiting: deque[Sequence] = deque()
        self.loading: list[Sequence] = []
        """Admitted, waiting for their prompt's KV (never preempted: the KV is on its way)."""
        self.running: list[Sequence] = []
        """Decoding, in admission order (the last is preempted first)."""
        self.num_preemptions = 0
        self.offload: Offload | None = None

    def use_offload(self, offload: Offload) -> None:
        """Evicted blocks go to the offload tiers; a new prompt's blocks they hold are loaded back (module step 2).
        Not for a model whose every layer is windowed (its dropped blocks are never read again)."""
        if self.cache.enabled and not self.drops_blocks:
            self.offload = offload
            self.cache.spill = offload.spill
            self.cache.tails.spill = offload.spill_tails

    @property
    def num_free_blocks(self) -> int:
        """Free blocks plus cached blocks no sequence holds (evicted on demand)."""
        return self.cache.num_available

    @property
    def num_waiting_new(self) -> int:
        return sum(1 for s in self.waiting if not s.output_ids)  # preempted ones hold outputs

    def position(self, seq: Sequence) -> int:
        """The sequence's place in the waiting queue (0: next); 0 when it does not wait."""
        return self.waiting.index(seq) if seq in self.waiting else 0

    @property
    def drops_blocks(self) -> bool:
        """Every layer is windowed: blocks behind the window go back to the pool as sequences grow."""
        return bool(self._widest)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def behind_window(self, first_query: int) -> int:
        """Leading blocks no layer reads once queries start at position first_query."""
        return blocks_behind_windows(self._widest, self.block_size, first_query)

    def blocks_held(self, seq: Sequence) -> int:
        """Blocks of the pool the sequence holds (its table's entries, less the dropped ones)."""
        return len(seq.block_table) - seq.num_dropped_blocks

    # ---- the queue -------------------------------------------------------------

    def add(self, seq: Sequence) -> list[Sequence]:
        """Queues the sequence and admits what fits; the sequences admitted (see `admit`)."""
        self.waiting.append(seq)
        admitted = self.admit()
        if seq.state is SeqState.WAITING and self.num_waiting_new > self.max_queue:
            self.waiting.remove(seq)
            raise QueueFull(f"{self.max_queue} requests already wait for KV blocks on this decode worker")
        return admitted

    def admit(self) -> list[Sequence]:
        """Admits from the head of the queue while it fits; the sequences admitted, in order."""
        admitted = []
        while self.waiting and len(self.loading) + len(self.running) < self.max_running:
            seq = self.waiting[0]
            resuming = bool(seq.output_ids)
            # A resumed sequence needs KV for every token but the last (the next step's input).
            kv_tokens = seq.num_tokens - 1 if resuming else len(seq.prompt_ids)
            need = self.blocks_for(seq.num_tokens if resuming else len(seq.prompt_ids))
            # A new prompt's last token is always computed: its logits give the first token; a prompt whose
            # logprobs are asked is computed whole (a local prefill needs every position's logits).
            reusable = kv_tokens if resuming else 0 if seq.sampling.HasField("prompt_logprobs") else kv_tokens - 1
            hashes = self.cache.hasher.hashes(seq.token_ids[:reusable], self.block_size,
                                              extra_keys=extra_keys(seq.adapter_key))
            hits = self.cache.lookup(hashes)
            offloaded = self.offload.held(hashes[len(hits):]) if self.offload is not None and not resuming else 0
            held = len(hits) + offloaded
            tail = self.cache.take_tail(hashes[held - 1] if held else None, extra_keys(seq.adapter_key),
                                        seq.token_ids[held * self.block_size : reusable])
            saved_tail = None  # one the device cache dropped, that the tiers hold (loaded for a prompt computed here)
            if tail is None and self.offload is not None and not resuming and self.cache.tails.max_blocks:
                saved_tail = self.offload.held_tail(hashes[held - 1] if held else None, extra_keys(seq.adapter_key),
                                                    seq.token_ids[held * self.block_size : reusable])
            found = tail or saved_tail
            num_cached = min(held * self.block_size + (len(found.tokens) if found else 0), kv_tokens)
            # Conditional disaggregation: a prompt this worker mostly holds is computed here.
            local = seq.local_prefill or (not resuming and seq.local_prefill_rule is not None
                                          and seq.local_prefill_rule.local(len(seq.prompt_ids), num_cached))
            # No block behind the windows of its first query: the prompt's first output when the prefill tier
            # sends the KV (it sends none there), else the first token computed here.
            computed_here = resuming or local
            if found is not None and not computed_here:  # the prefill tier computes and sends its block whole
                if tail is not None:
                    self.cache.keep_tail(tail)
                tail, saved_tail, num_cached = None, None, min(held * self.block_size, kv_tokens)
            dropped = self.behind_window(num_cached if computed_here else len(seq.prompt_ids))
            if need - max(len(hits), dropped) > self.cache.num_available:
                self.cache.free(hits)
                if tail is not None:
                    self.cache.keep_tail(tail)
                break
            self.waiting.popleft()
            self.cache.free(hits[:dropped])  # cached, but behind the window: this sequence reads none of them
            fresh = self.cache.allocate(need - max(len(hits), dropped))
            seq.block_table = [self.null_block] * dropped + hits[dropped:] + fresh
            seq.num_dropped_blocks = dropped
            seq.num_cached_tokens = num_cached
            seq.tail_copy = None if tail is None else (tail, seq.block_table[held])
            if resuming:
                seq.resume_from = seq.num_cached_tokens
                seq.state = SeqState.RUNNING
                self.running.append(seq)
            else:
                seq.num_hit_blocks = len(hits) + offloaded
                seq.offload_loads = list(zip(fresh[:offloaded], hashes[len(hits) : len(hits) + offloaded]))
                seq.offload_tail = None if saved_tail is None else (seq.block_table[held], saved_tail)
                seq.local_prefill = local
                seq.state = SeqState.WAITING_KV
                self.loading.append(seq)
            admitted.append(seq)
        return admitted

    def tail_copied(self, seq: Sequence) -> None:
        """The engine copied the sequence's tail (`tail_copy`) into its block: the tail goes back to the cache."""
        if seq.tail_copy is not None:
            self.cache.keep_tail(seq.tail_copy[0])
            seq.tail_copy = None

    # ---- running -----------------------------------------------------------------

    def start(self, seq: Sequence) -> None:
        """The prompt's KV is in place: the sequence runs from the next step."""
        self.loading.remove(seq)
        seq.num_cached_tokens = len(seq.prompt_ids)
        self._cache_full_blocks(seq)
        seq.state = SeqState.RUNNING
        self.running.append(seq)

    def schedule(self) -> list[Sequence]:
        """The running sequences that decode this step, each holding a block for its next token (and none
        behind the windows)."""
        if self.drops_blocks:
            for seq in self.running:
                self._drop_behind_window(seq)
        for seq in list(self.running):
            if seq.state is not SeqState.RUNNING:
                continue  # preempted while an older sequence took a block
            while len(seq.block_table) < self.blocks_for(seq.num_tokens):
                if self.cache.num_available:
                    seq.block_table.extend(self.cache.allocate(1))
                    continue
                victim = self.running[-1]
                self.preempt(victim)
                if victim is seq:
                    break
        return list(self.running)

    def reserve_lookahead(self, seq: Sequence, n: int) -> int:
        """How many of n look-ahead slots (the positions after the sequence's next token's) its blocks hold for
        this step: the blocks past its table are taken from the free ones, as many as are free (never by
        preempting or evicting), so fewer slots than asked when the pool is short."""
        if not n:
            return 0
        short = self.blocks_for(seq.num_tokens + n) - len(seq.block_table)
        take = min(short, self.pool.num_free)
        if take > 0:
            seq.block_table.extend(self.cache.allocate(take))
        return min(n, len(seq.block_table) * self.block_size - seq.num_tokens)

    def trim(self, seq: Sequence) -> list[int]:
        """Gives back the blocks past the one the sequence's next token needs (after a speculative step: those
        that held only rejected look-ahead slots); the block ids given back (none after a plain step)."""
        keep = self.blocks_for(seq.num_tokens)
        extra = seq.block_table[keep:]
        if extra:
            del seq.block_table[keep:]
            self.cache.free(extra)
        return extra

    def preempt(self, seq: Sequence) -> None:
        """Frees the sequence's blocks (its full ones stay cached) and puts it at the head of the queue."""
        self.running.remove(seq)
        self._release_blocks(seq)
        seq.state = SeqState.WAITING
        seq.resume_from = None
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finished_step(self, seq: Sequence) -> None:
        """The step wrote the KV of every token so far (call it before appending the token it sampled): a block
        it completed (the answer's too) enters the prefix cache now, so a later prompt (the conversation's next
        turn) reuses it."""
        before = self._complete_blocks(seq)
        seq.num_cached_tokens = seq.num_tokens
        seq.resume_from = None
        start, end = max(before, seq.num_dropped_blocks), self._complete_blocks(seq)
        if end > start:
            self._register(seq, start, end)

    def retire(self, seq: Sequence, keep_kv: bool = True) -> None:
        """Takes the sequence out of every list and drops its blocks (its written full blocks cached)."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        for group in (self.loading, self.running):
            if seq in group:
                group.remove(seq)
        if not keep_kv:
            seq.num_cached_tokens = 0
        self._release_blocks(seq)

    def _drop_behind_window(self, seq: Sequence) -> None:
        """Returns the sequence's blocks that fall behind every layer's window before its next forward (whose
        first query is the last token, or a readmitted sequence's first token to recompute); those holding
        complete KV enter the prefix cache first, so a later prompt can still reuse its prefix."""
        first_query = seq.num_tokens - 1 if seq.resume_from is None else seq.resume_from
        start, end = seq.num_dropped_blocks, min(self.behind_window(first_query), len(seq.block_table))
        if end <= start:
            return
        complete = min(end, self._complete_blocks(seq))
        if complete > start:
            self._register(seq, start, complete)
        self.cache.free(seq.block_table[start:end])
        seq.block_table[start:end] = [self.null_block] * (end - start)
        seq.num_dropped_blocks = end

    def _release_blocks(self, seq: Sequence) -> None:
        if seq.tail_copy is not None:  # never copied: its block lacks the tail's KV (the tail itself is intact)
            seq.num_cached_tokens -= seq.num_cached_tokens % self.block_size
            self.tail_copied(seq)
        self._cache_full_blocks(seq)
        tail = self._tail(seq)
        if seq.block_table:
            self.cache.free([b for b in seq.block_table[seq.num_dropped_blocks :] if tail is None or b != tail.block_id])
        if tail is not None:
            self.cache.keep_tail(tail)
        seq.block_table = []
        seq.num_dropped_blocks = 0
        seq.num_cached_tokens = 0
        seq.draft_len = 0  # a draft model's KV in those blocks goes with them
        seq.num_stale_blocks = 0  # readmitted, it recomputes here (every layer) what the prefix cache lacks

    def _complete_blocks(self, seq: Sequence) -> int:
        """Leading blocks whose KV is complete in every layer (what the prefix cache may hold of it)."""
        full = seq.num_cached_tokens // self.block_size
        if seq.num_stale_blocks > seq.num_hit_blocks:  # its own blocks lack KV behind the windows: keep the hits
            full = min(full, seq.num_hit_blocks)
        return full

    def _tail(self, seq: Sequence) -> Tail | None:
        """The sequence's last partial block with KV as a tail: when the cache keeps tails, the block is the
        sequence's alone and every block before it is complete."""
        full, n = divmod(seq.num_cached_tokens, self.block_size)
        if (not n or not self.cache.tails.max_blocks or not self.cache.enabled or full < seq.num_dropped_blocks
                or full >= len(seq.block_table) or self._complete_blocks(seq) != full or seq.num_stale_blocks):
            return None
        block_id = seq.block_table[full]
        if block_id == self.null_block or self.pool.ref_count(block_id) != 1:
            return None
        keys = extra_keys(seq.adapter_key)
        hashes = self.cache.hasher.extend(seq.block_hashes, seq.token_ids, self.block_size, full, keys)
        return Tail(block_id, hashes[full - 1] if full else None, keys,
                    tuple(seq.token_ids[full * self.block_size : seq.num_cached_tokens]))

    def _cache_full_blocks(self, seq: Sequence) -> None:
        start, full = seq.num_dropped_blocks, self._complete_blocks(seq)  # dropped ones: cached when dropped
        if full > start:
            self._register(seq, start, full)

    def _register(self, seq: Sequence, start: int, end: int) -> None:
        """The sequence's blocks start..end (KV complete) enter the prefix cache under their hashes."""
        hashes = self.cache.hasher.extend(seq.block_hashes, seq.token_ids, self.block_size, end,
                                          extra_keys(seq.adapter_key))
        bs = self.block_size
        self.cache.register(seq.block_table[start:end], hashes[start:end], seq.token_ids[start * bs : end * bs],
                            hashes[start - 1] if start else None, seq.adapter_key)
