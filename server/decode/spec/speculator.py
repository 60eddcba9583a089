"""Speculative decoding in the native decode engine: propose, reserve the lookahead, verify, accept.

Each step, for the batch the scheduler gave (every sequence already holding a block for its next token):
1. `propose`: each sequence's n-gram proposal (at most k tokens, fewer where max_tokens or max_model_len
   is near); the step's cap from measured costs (`policy.py`); the blocks for the lookahead slots taken on
   demand from the free pool (never by preempting or evicting: a proposal that does not fit is shortened).
2. `verify` (the step's thread): one forward of k_i + 1 query positions per sequence (the last token, then
   its proposals; shorter rows padded, their pad entries writing a pad block no sequence reads), causal over
   the new positions; then the tokens the sampler draws at each position, accepted while they equal the
   proposals (`rejection.py`: exact for greedy, the target's distribution for sampling, seeded draws per
   token index as without speculation).
3. After the engine appended the accepted tokens (the stop rule checked on each, in order): `release`
   gives back the blocks that held only rejected slots. A rejected token's KV is never read: every later
   step writes a position before it attends it, and attends only its context's positions.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pdserve.server import metrics
from pdserve.server.decode.kv_cache import PagedKvCache
from pdserve.server.decode.model import DecoderModel
from pdserve.server.decode.scheduler import Scheduler
from pdserve.server.decode.sequence import Sequence
from pdserve.server.decode.spec.config import SpeculativeConfig
from pdserve.server.decode.spec.lookahead import Lookahead
from pdserve.server.decode.spec.ngram import NgramProposer
from pdserve.server.decode.spec.policy import SpecPolicy
from pdserve.server.decode.spec.rejection import accepted

SampleFn = Callable[[torch.Tensor, list], torch.Tensor]
"""(logits [R, V], sequences or Lookaheads) -> token ids [R]: the engine's sampler."""
LogprobsFn = Callable[[torch.Tensor, torch.Tensor, list], list]
"""(logits [R, V], token ids [R], sampling params) -> a TokenLogprob or None per row."""


class Speculator:
    def __init__(self, config: SpeculativeConfig, model: DecoderModel, cache: PagedKvCache, scheduler: Scheduler,
                 pad_block: int, sample: SampleFn, logprobs: LogprobsFn):
        self.config = config
        self.model = model
        self.cache = cache
        self.scheduler = scheduler
        self.pad_slot = pad_block * cache.block_size
        self.sample = sample
        self.logprobs = logprobs
        k = config.num_speculative_tokens
        self.proposer = NgramProposer(k, config.prompt_lookup_min, config.prompt_lookup_max)
        self.policy = SpecPolicy(k, config.disable_by_batch_size)
        self.num_drafts = self.num_draft_tokens = self.num_accepted = 0
        self.accepted_per_pos = [0] * k

    # ---- 1. on the event loop, before the step ----------------------------------

    def propose(self, batch: list[Sequence]) -> list[list[int]]:
        """Each sequence's proposal for this step (maybe []), its lookahead blocks held."""
        proposals = [self.proposer.propose(s.token_ids, room(s, self.config.num_speculative_tokens)) for s in batch]
        cap = self.policy.cap(len(batch), [len(p) for p in proposals])
        return [self._reserve(s, p[:cap]) for s, p in zip(batch, proposals)]

    def _reserve(self, seq: Sequence, proposal: list[int]) -> list[int]:
        """The proposal as far as free blocks hold its slots (the sequence takes those blocks)."""
        if not proposal:
            return proposal
        scheduler = self.scheduler
        short = scheduler.blocks_for(seq.num_tokens + len(proposal)) - len(seq.block_table)
        take = min(short, scheduler.pool.num_free)
        if take > 0:
            seq.block_table.extend(scheduler.cache.allocate(take))
        return proposal[: len(seq.block_table) * scheduler.block_size - seq.num_tokens]

    # ---- 2. in the step's thread ---------------------------------------------------

    def verify(self, batch: list[Sequence], proposals: list[list[int]]) -> tuple[list[list[int]], list[list]]:
        """The tokens each sequence emits (1 to len(proposal) + 1) and their logprobs (None where not asked)."""
        B, S = len(batch), 1 + max(len(p) for p in proposals)
        tokens = torch.zeros(B, S, dtype=torch.int64)  # [B, S]
        positions = torch.zeros(B, S, dtype=torch.int64)  # [B, S]
        pad = torch.zeros(B, S, dtype=torch.bool)  # [B, S]
        steps = torch.arange(S)  # [S]
        for i, (s, p) in enumerate(zip(batch, proposals)):
            n = len(p)
            tokens[i, : n + 1] = torch.tensor([s.token_ids[-1], *p], dtype=torch.int64)
            positions[i] = s.num_tokens - 1 + steps.clamp(max=n)  # pad entries repeat the last position
            pad[i, n + 1 :] = True
        context_lens = torch.tensor([s.num_tokens + len(p) for s, p in zip(batch, proposals)])  # [B]
        width = max(len(s.block_table) for s in batch)
        tables = torch.tensor([s.block_table + [s.block_table[0]] * (width - len(s.block_table)) for s in batch],
                              dtype=torch.int64)  # [B, M]
        logits = self.model.verify(tokens, positions, tables, context_lens, self.cache, pad, self.pad_slot)  # [B, S, V]

        views = [Lookahead(s) for s in batch]
        out: list[list[int]] = [[] for _ in batch]
        lps: list[list] = [[] for _ in batch]
        alive = list(range(B))
        for j in range(S):
            rows = torch.tensor(alive)
            at = logits[rows.to(logits.device), j]  # [R, V]
            picked = self.sample(at, [views[i] for i in alive])  # [R]
            row_lps = self.logprobs(at, picked, [batch[i].sampling for i in alive])
            still = []
            for i, t, lp in zip(alive, picked.tolist(), row_lps):
                out[i].append(t)
                lps[i].append(lp)
                views[i].ahead.append(t)
                if j < len(proposals[i]) and t == proposals[i][j]:
                    still.append(i)
            alive = still
            if not alive:
                break
        self._count(proposals, out)
        return out, lps

    def _count(self, proposals: list[list[int]], out: list[list[int]]) -> None:
        for p, emitted in zip(proposals, out):
            if not p:
                continue
            m = accepted(p, emitted)
            self.num_drafts += 1
            self.num_draft_tokens += len(p)
            self.num_accepted += m
            metrics.spec_decode_num_drafts.inc()
            metrics.spec_decode_num_draft_tokens.inc(len(p))
            metrics.spec_decode_num_accepted_tokens.inc(m)
            for j in range(m):
                self.accepted_per_pos[j] += 1
                metrics.spec_decode_num_accepted_tokens_per_pos.labels(str(j)).inc()
            self.policy.observe_acceptance(len(p), m)

    # ---- 3. after the step -----------------------------------------------------------

    def observe_step(self, batch: list[Sequence], proposals: list[list[int]] | None, seconds: float) -> None:
        positions = 1 + max((len(p) for p in proposals or ()), default=0)
        self.policy.observe_step(len(batch), positions, seconds)

    def release(self, seq: Sequence) -> None:
        """Blocks past the one the sequence's next token needs go back (they held only rejected slots)."""
        keep = self.scheduler.blocks_for(seq.num_tokens)
        if len(seq.block_table) > keep:
            extra = seq.block_table[keep:]
            del seq.block_table[keep:]
            self.scheduler.cache.free(extra)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_draft_tokens if self.num_draft_tokens else 0.0


def room(seq: Sequence, k: int) -> int:
    """The most proposals worth verifying: a step emits up to k + 1 tokens, within max_tokens and max_model_len."""
    left = min(seq.sampling.max_tokens - seq.sample_index, seq.max_model_len - seq.num_tokens)
    return max(0, min(k, left - 1))
