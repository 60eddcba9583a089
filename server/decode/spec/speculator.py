"""Speculative decoding in the native decode engine: the engine's one seam to it, `step`, proposes, has the step
verify and measures it.

Each step, for the batch the scheduler gave (every sequence already holding a block for its next token):
1. `propose`: each sequence's proposal length (at most k tokens, fewer where max_tokens or max_model_len
   is near; with ngram, the n-gram proposal itself); the step's cap from measured costs (`policy.py`); the
   scheduler's `reserve_lookahead` holds the blocks of the look-ahead slots, from the free ones (never by
   preempting or evicting: a proposal that does not fit is shortened).
2. `verify` (the step's thread, handed to the engine's run as its verifier): with draft_model, first the draft's
   tokens (`draft.py`: k batched paged draft forwards, inside the step, so the measured step cost the cap is
   chosen by includes them); then one forward of k_i + 1 query positions per sequence (the last token, then its
   proposals; shorter rows padded, their pad entries writing a pad block no sequence reads), causal over the new
   positions; then the tokens the sampler draws at each position, accepted while they equal the proposals
   (`rejection.py`: exact for greedy, the target's distribution for sampling, seeded draws per token index as
   without speculation; a draft drawn from q by the general rule). Every draw reads the step's one sampling batch
   (`decode/sampling.py`), which the engine builds and hands to the verifier: at a later position, its rows with
   the tokens accepted before it (`take`), or every position at once where no earlier token shapes the logits
   (`positions`).
3. `observe_step`: the step's seconds go to the policy. After the engine appended the accepted tokens (the stop
   rule checked on each, in order), the scheduler's `trim` gives back the blocks that held only rejected slots. A
   rejected token's KV is never read: every later step writes a position before it attends it, and attends only
   its context's positions.
Besides the steps, with a draft model: `admitted` starts a sequence's draft prompt prefill (`draft.py`), during
which `in_use` keeps its blocks; `close` stops the thread those prefills run in.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from functools import partial

import torch

from pdserve.server import metrics
from pdserve.server.decode.kv_cache import PagedKvCache
from pdserve.server.decode.model import DecoderModel
from pdserve.server.decode.model_runner import CudaGraphRunner, EagerRunner
from pdserve.server.decode.sampling import SamplingBatch
from pdserve.server.decode.scheduler import Scheduler
from pdserve.server.decode.sequence import Sequence, SeqState
from pdserve.server.decode.spec.config import SpeculativeConfig
from pdserve.server.decode.spec.draft import DraftProposer
from pdserve.server.decode.spec.ngram import NgramProposer
from pdserve.server.decode.spec.policy import SpecPolicy
from pdserve.server.decode.spec.proposals import Proposals
from pdserve.server.decode.spec.rejection import accept_or_resample, accepted

StepOut = tuple[list[list[int]], list[list]]
"""The tokens each sequence of a step emits, and their logprobs (None where not asked)."""
VerifyFn = Callable[[list[Sequence], SamplingBatch], StepOut]
"""(the step's batch, its sampling batch) -> what it emits: the verify step of a plan, run by the engine in the step's
thread."""
RunFn = Callable[[list[Sequence], VerifyFn | None], Awaitable[StepOut]]
"""(batch, verifier or None for a plain step) -> what the engine's run of the step emits."""


class Speculator:
    def __init__(self, config: SpeculativeConfig, model: DecoderModel, cache: PagedKvCache, scheduler: Scheduler,
                 pad_block: int, draft_model: DecoderModel | None = None,
                 runner: EagerRunner | CudaGraphRunner | None = None, released: Callable[[], None] = lambda: None):
        """draft_model: method draft_model's draft, already on the target's device; runner: what runs the verify
        forward (the engine's: CUDA graphs per (bucket, new tokens) there); None: the model eagerly; released:
        called on the event loop when a draft prompt prefill ends (its sequence's blocks no longer `in_use`)."""
        if (config.method == "draft_model") != (draft_model is not None):
            raise ValueError(f"speculative method {config.method!r} {'needs' if draft_model is None else 'takes no'} "
                             f"draft model")
        if draft_model is not None and draft_model.config.vocab_size != model.config.vocab_size:
            raise ValueError(f"the draft's vocab_size {draft_model.config.vocab_size} differs from the served "
                             f"model's {model.config.vocab_size}")
        self.config = config
        self.model = model
        self.runner = runner or EagerRunner(model, cache)
        self.cache = cache
        self.scheduler = scheduler
        self.pad_slot = pad_block * cache.block_size
        k = config.num_speculative_tokens
        self.proposer = NgramProposer(k, config.prompt_lookup_min, config.prompt_lookup_max) \
            if draft_model is None else None
        self.draft = None if draft_model is None else DraftProposer(draft_model, pad_block, cache.block_size)
        self.released = released
        self.policy = SpecPolicy(k, config.disable_by_batch_size)
        self.num_drafts = self.num_draft_tokens = self.num_accepted = 0
        self.accepted_per_pos = [0] * k

    # ---- the engine's seam --------------------------------------------------------

    async def step(self, batch: list[Sequence], run: RunFn) -> StepOut:
        """One step of the batch: its proposals (their look-ahead blocks reserved), the engine's `run` with their
        verifier (a plain step where nothing is proposed), its seconds observed."""
        plan = self.propose(batch)
        started = time.perf_counter()
        out = await run(batch, self.verifier(plan))
        self.observe_step(batch, plan, time.perf_counter() - started)
        return out

    def admitted(self, seq: Sequence) -> None:
        """The sequence holds its blocks: with a draft model, its draft prompt prefill starts (`draft.py`), unless
        it is constrained (never proposed for) or readmitted after a preemption (its steps catch the draft up)."""
        if self.draft is not None and seq.state is SeqState.WAITING_KV and seq.constraint is None:
            self.draft.prefill_in_background(seq, self.released)

    def in_use(self, rid: str) -> bool:
        """Whether a draft prompt prefill writes the request's blocks now."""
        return self.draft is not None and rid in self.draft.prefilling

    def close(self) -> None:
        if self.draft is not None:
            self.draft.executor.shutdown(wait=False)

    # ---- 1. on the event loop, before the step ----------------------------------

    def propose(self, batch: list[Sequence]) -> Proposals:
        """Each sequence's proposal for this step (maybe none), its lookahead blocks held; a draft model's tokens
        are drawn in the step (`verify`)."""
        k = self.config.num_speculative_tokens
        # A constrained sequence is not proposed for: its grammar's state would have to follow each proposed token
        # (and roll back the rejected ones); it samples its one token per step under its mask, beside the others.
        if self.draft is not None:  # every sequence may be drafted for, but one whose prompt's draft KV is on its way
            lengths = [0 if s.constraint is not None or s.request_id in self.draft.prefilling else room(s, k)
                       for s in batch]
            cap = self.policy.cap(len(batch), lengths)
            return Proposals([self.scheduler.reserve_lookahead(s, min(n, cap)) for s, n in zip(batch, lengths)],
                             [[] for _ in batch], [None] * len(batch))
        if not self.policy.worth_looking(len(batch)):
            self.policy.skipped(len(batch))
            return Proposals.of([[] for _ in batch])  # not even looked up (disable_by_batch_size, or not paying)
        proposals = [[] if s.constraint is not None else self.proposer.propose(s.token_ids, room(s, k))
                     for s in batch]
        cap = self.policy.cap(len(batch), [len(p) for p in proposals])
        return Proposals.of([p[: self.scheduler.reserve_lookahead(s, len(p[:cap]))] for s, p in zip(batch, proposals)])

    def verifier(self, plan: Proposals) -> VerifyFn | None:
        """What the step's thread runs for the plan in place of a plain step; None when nothing is proposed."""
        return partial(self.verify, plan=plan) if plan else None

    # ---- 2. in the step's thread ---------------------------------------------------

    def verify(self, batch: list[Sequence], sampling: SamplingBatch, plan: Proposals) -> StepOut:
        """The tokens each sequence emits (1 to len(proposal) + 1) and their logprobs (None where not asked)."""
        if self.draft is not None:
            plan.tokens, plan.q = self.draft.propose(batch, plan.lengths, sampling)
        proposals = plan.tokens
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
        logits = self.runner.verify(tokens, positions, tables, context_lens, pad, self.pad_slot)  # [B, S, V]

        if sampling.plain and all(q is None for q in plan.q):
            out, lps = self._accept_at_once(sampling, proposals, logits)
        else:
            out, lps = self._accept_in_order(sampling, proposals, logits, plan.q)
        self._count(proposals, out)
        if self.draft is not None:  # the draft KV of the accepted tokens stays; of its last proposal, never written
            for s, p, emitted in zip(batch, proposals, out):
                if p:
                    s.draft_len = s.num_tokens + min(len(emitted) - 1, len(p) - 1)
        return out, lps

    @staticmethod
    def _accept_at_once(sampling: SamplingBatch, proposals: list[list[int]], logits: torch.Tensor
                        ) -> tuple[list[list[int]], list[list]]:
        """No penalty or min_tokens shapes any position's logits: what the sampler draws at a position depends on
        the request and the token index alone, so all B x S positions are drawn in one call."""
        B, S, V = logits.shape
        flat = logits.reshape(B * S, V)  # [B S, V]
        at = sampling.positions(S)  # row i's position j: row i * S + j
        picked = at.sample(flat)  # [B S]
        rows = picked.view(B, S).tolist()
        row_lps = at.logprobs(flat, picked)
        out, lps = [], []
        for i, p in enumerate(proposals):
            n = accepted(p, rows[i]) + 1
            out.append(rows[i][:n])
            lps.append(row_lps[i * S : i * S + n])
        return out, lps

    @staticmethod
    def _accept_in_order(sampling: SamplingBatch, proposals: list[list[int]], logits: torch.Tensor,
                         qs: list[torch.Tensor | None]) -> tuple[list[list[int]], list[list]]:
        """Position by position, each drawn with the penalties and min_tokens of the tokens accepted before it;
        a draft token drawn from q accepted or replaced by the general rule."""
        out: list[list[int]] = [[] for _ in proposals]
        lps: list[list] = [[] for _ in proposals]
        alive = list(range(len(proposals)))
        for j in range(logits.shape[1]):
            rows = torch.tensor(alive)
            at = logits[rows.to(logits.device), j]  # [R, V]
            here = sampling.take(alive, [out[i] for i in alive])  # each row after the tokens it accepted
            picked = here.sample(at)  # [R]
            general = [n for n, i in enumerate(alive) if qs[i] is not None and j < len(proposals[i])]
            if general:  # d ~ q: accepted with min(1, p / q), else drawn from norm(max(0, p - q))
                index = torch.tensor(general, device=at.device)
                p = here.take(general).distribution(at[index])  # [G, V]
                q = torch.stack([qs[alive[n]][j] for n in general]).to(p.device)  # [G, V]
                drafts = torch.tensor([proposals[alive[n]][j] for n in general])
                _, tokens = accept_or_resample(p, q, drafts, torch.rand(len(general)))
                picked = picked.clone()
                picked[index] = tokens.to(picked.device)
            row_lps = here.logprobs(at, picked)
            still = []
            for i, t, lp in zip(alive, picked.tolist(), row_lps):
                out[i].append(t)
                lps[i].append(lp)
                if j < len(proposals[i]) and t == proposals[i][j]:
                    still.append(i)
            alive = still
            if not alive:
                break
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

    def observe_step(self, batch: list[Sequence], plan: Proposals | None, seconds: float) -> None:
        """The step's seconds (a draft's forwards included) under its bucket and its query positions."""
        positions = 1 + max(plan.lengths if plan else (), default=0)
        self.policy.observe_step(len(batch), positions, seconds)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_draft_tokens if self.num_draft_tokens else 0.0


def room(seq: Sequence, k: int) -> int:
    """The most proposals worth verifying: a step emits up to k + 1 tokens, within max_tokens and max_model_len."""
    left = min(seq.sampling.max_tokens - seq.sample_index, seq.max_model_len - seq.num_tokens)
    return max(0, min(k, left - 1))
