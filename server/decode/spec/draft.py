"""The draft model of draft_model speculation (vLLM's method): a small checkpoint sharing the served model's
tokenizer proposes k tokens per sequence in k batched paged forwards, which the target then verifies in one.

Its KV: a `PagedKvCache` of the draft's own layout (its layers, kv heads, head dim; its compute dtype) with
as many blocks as the target's cache, indexed by the same block ids. A sequence's one block table serves both
models, so the draft's KV is taken, kept in the prefix cache, preempted, freed on finish or abort and dropped
on migration with the target's, by the same code, and no draft block is ever stranded; the cache budget pays
for both (`startup.cache_blocks` counts both caches' bytes per block). The pad block is the target's too.

`Sequence.draft_len` says how many leading tokens have their draft KV in place. Where it comes from:
1. The prompt: when a sequence is admitted (its blocks held, its prompt's KV on the way from the prefill tier),
   the speculator (`Speculator.admitted`) runs `prefill_prompt` in a thread beside the transfer
   (`prefill_in_background`), from the prompt ids the worker already
   has: the prefill tier and the wire are unchanged and the first token (the prefill tier's) waits for
   nothing. Until it is done the sequence gets no proposal (it decodes plainly).
2. Each speculative step writes the draft KV of the step's input tokens and of its proposals but the last;
   the accepted ones stay valid (`Speculator.verify` sets draft_len). Steps without speculation, a prompt
   prefill that failed, or a readmission after preemption (draft_len back to 0, as the target's KV) leave a
   lag, caught up at the sequence's next speculative step: a few tokens in the step's first draft forward,
   a longer lag first in a prefill of its own.
A block shared through the prefix cache gets its draft KV written again by every sequence holding it, with
the same values (the same tokens at the same positions through the same weights). The draft only proposes:
whatever its KV or its tokens, the emitted tokens are decided by the target (`rejection.py`), so a draft that
reads a poorer KV proposes worse, never wrongly.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from pdserve.kvcache.layout import KvLayout
from pdserve.server.decode.kv_cache import PagedKvCache
from pdserve.server.decode.model import DecoderModel
from pdserve.server.decode.sampler import pick
from pdserve.server.decode.sampling import SamplingBatch
from pdserve.server.decode.sequence import Sequence

log = logging.getLogger("pdserve.decode")


def draft_layout(model: DecoderModel, block_size: int) -> KvLayout:
    """The draft cache's layout: the draft's shapes, in its compute dtype."""
    return KvLayout.for_model(model.config, block_size, str(model.dtype).removeprefix("torch."))


def drawn_from_q(seq: Sequence) -> bool:
    """Whether the sequence's drafts are drawn from the draft's distribution and verified by the general rule:
    sampled and unseeded. Greedy and seeded requests draw by the target's own draw rule (`rejection.py`)."""
    p = seq.sampling
    return p.temperature > 0 and not p.HasField("seed")


class DraftProposer:
    def __init__(self, model: DecoderModel, num_blocks: int, block_size: int, max_ragged: int = 8):
        """num_blocks: the target cache's (the draft's gets the same, plus the pad block at num_blocks);
        max_ragged: a lag of more tokens than this is prefilled alone before the step's first draft forward."""
        self.model = model
        self.layout = draft_layout(model, block_size)
        self.cache = PagedKvCache(self.layout, num_blocks + 1, device=model.embed.device)
        self.pad_slot = num_blocks * block_size
        self.max_ragged = max_ragged
        self.prefilling: set[str] = set()
        """Request ids whose prompt `prefill_prompt` computes now, or queued (the engine keeps their blocks)."""
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="draft-prefill")
        """Where prompt prefills run, one at a time: a burst of admissions never holds up the decode steps'
        threads (asyncio's default executor)."""

    def prefill_in_background(self, seq: Sequence, done: Callable[[], None]) -> None:
        """Runs `prefill_prompt` in the draft's thread (from the event loop); the request stays in `prefilling`, its
        blocks the sequence's (an abort frees them after), until it ends; then `done` is called on the loop. A
        failure is logged: the draft catches up in a step."""
        rid = seq.request_id
        self.prefilling.add(rid)

        def ended(work: asyncio.Future) -> None:
            self.prefilling.discard(rid)
            if not work.cancelled() and work.exception() is not None:
                log.warning("request %s: the draft's prompt prefill failed (%r); the draft catches up in a step",
                            rid, work.exception())
            done()

        loop = asyncio.get_running_loop()
        loop.run_in_executor(self.executor, self.prefill_prompt, seq).add_done_callback(ended)

    def prefill_prompt(self, seq: Sequence) -> None:
        """The draft KV of the prompt (runs in a thread while the target's KV arrives). The sequence's draft_len
        is set only if its blocks are still those written (not preempted and readmitted elsewhere meanwhile)."""
        table = list(seq.block_table)
        prompt = list(seq.prompt_ids)
        self.model.prefill(torch.tensor(prompt, dtype=torch.int64), table, self.cache)
        if seq.block_table[: len(table)] == table and seq.draft_len == 0:
            seq.draft_len = len(prompt)

    def propose(self, batch: list[Sequence], lengths: list[int], sampling: SamplingBatch
                ) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """In the step's thread: lengths[i] draft tokens for each sequence (their lookahead slots held), drawn with
        the step's sampling batch (the batch's rows), and for those drawn from q (`drawn_from_q`) the distributions
        [lengths[i], V] they were drawn from."""
        tokens: list[list[int]] = [[] for _ in batch]
        qs: list[list[torch.Tensor] | None] = [[] if n and drawn_from_q(s) else None for s, n in zip(batch, lengths)]
        rows = [i for i, n in enumerate(lengths) if n]
        if not rows:
            return tokens, [None] * len(batch)
        seqs = [batch[i] for i in rows]
        for s in seqs:
            if s.num_tokens - s.draft_len > self.max_ragged:
                ids = torch.tensor(s.token_ids[s.draft_len : s.num_tokens - 1], dtype=torch.int64)
                self.model.prefill(ids, s.block_table, self.cache, start_pos=s.draft_len)
                s.draft_len = s.num_tokens - 1
        logits = self._first_forward(seqs)  # [R, V] after each sequence's last token
        live = list(range(len(seqs)))  # the rows of `logits`: indexes into seqs (and rows)
        for j in range(max(lengths)):
            here = sampling.take([rows[r] for r in live], [tokens[rows[r]] for r in live])  # after their drafts so far
            drafted = self._draw(logits, here, [qs[rows[r]] for r in live])
            for r, t in zip(live, drafted):
                tokens[rows[r]].append(t)
            more = [(n, r) for n, r in enumerate(live) if lengths[rows[r]] > j + 1]
            if not more:
                break
            logits = self._next_forward([seqs[r] for _, r in more], [drafted[n] for n, _ in more], j)
            live = [r for _, r in more]
        return tokens, [None if q is None else torch.stack(q) for q in qs]

    def _first_forward(self, seqs: list[Sequence]) -> torch.Tensor:
        """One forward over each sequence's tokens from its draft_len to its last (1 + its lag), padded rows
        writing the pad slot: the draft logits after each last token, [R, V]."""
        lags = [s.num_tokens - s.draft_len for s in seqs]
        R, S = len(seqs), max(lags)
        tokens = torch.zeros(R, S, dtype=torch.int64)  # [R, S]
        positions = torch.zeros(R, S, dtype=torch.int64)  # [R, S]
        pad = torch.zeros(R, S, dtype=torch.bool)  # [R, S]
        for r, (s, n) in enumerate(zip(seqs, lags)):
            tokens[r, :n] = torch.tensor(s.token_ids[s.draft_len :], dtype=torch.int64)
            positions[r] = s.draft_len + torch.arange(S).clamp(max=n - 1)  # pad entries repeat the last position
            pad[r, n:] = True
        context_lens = torch.tensor([s.num_tokens for s in seqs])  # [R]
        logits = self.model.verify(tokens, positions, _tables(seqs), context_lens, self.cache, pad,
                                   self.pad_slot)  # [R, S, V]
        last = torch.tensor([n - 1 for n in lags], device=logits.device)
        return logits[torch.arange(R, device=logits.device), last]  # [R, V]

    def _next_forward(self, seqs: list[Sequence], drafted: list[int], j: int) -> torch.Tensor:
        """The draft logits after each sequence's (j + 1)-th draft token, at position num_tokens + j: [R, V]."""
        positions = torch.tensor([s.num_tokens + j for s in seqs], dtype=torch.int64)  # [R]
        return self.model.decode(torch.tensor(drafted, dtype=torch.int64), positions, _tables(seqs), positions + 1,
                                 self.cache)

    @staticmethod
    def _draw(logits: torch.Tensor, sampling: SamplingBatch, qs: list[list | None]) -> list[int]:
        """Each row's next draft token: by the request's sampler and draw (greedy, seeded), or from q (its
        distribution appended to the row's list)."""
        out = sampling.sample(logits).tolist()
        general = [r for r, q in enumerate(qs) if q is not None]
        if general:
            index = torch.tensor(general, device=logits.device)
            q = sampling.take(general).distribution(logits[index])  # [G, V]
            picked = pick(q, torch.rand(len(general))).tolist()  # never a token of q 0
            for g, r in enumerate(general):
                out[r] = picked[g]
                qs[r].append(q[g])
        return out


def _tables(seqs: list[Sequence]) -> torch.Tensor:
    width = max(len(s.block_table) for s in seqs)
    return torch.tensor([s.block_table + [s.block_table[0]] * (width - len(s.block_table)) for s in seqs],
                        dtype=torch.int64)  # [R, M]
