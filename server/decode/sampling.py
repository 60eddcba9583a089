"""One step's sampling batch: everything the sampler reads of each row, built once a step from its sequences.

`SamplingBatch.of(seqs, vocab_size)` reads each sequence once: its temperature, top-k, top-p and min-p (tensors on
the host, so choosing a row's path never waits on the device), its seed and the index of the token it samples
next (with the seed, its draw: `server/seeded.py`), its penalties and the ids min_tokens blocks (over its prompt
and outputs), its grammar's next-token mask, and how many logprobs it asks. `sample`, `distribution` and
`logprobs` apply that to the step's logits with `sampler.py`'s math. What a batch does not need is skipped: no
penalty pass when no row's logits are shaped, no mask when no row is constrained, no min-p filter when no row
asks, no draw when every row is greedy (the argmax), no log-softmax when no row asks logprobs.

The engine's plain step samples its logits with it. The speculative step reads the same batch at its later
positions: `positions(n)` (every row at each of its next n positions, for a batch no earlier token shapes) and
`take(rows, ahead)` (some rows, each as if tokens had been appended: its index, penalties and min_tokens
follow them; its temperature, filters, seed, mask and logprobs asked are the row's).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.server import logprobs
from pdserve.server.decode import sampler
from pdserve.server.decode.sequence import Sequence
from pdserve.server.finish import blocked_ids
from pdserve.server.sampling_rules import repetition_penalty_of, top_p_of
from pdserve.server.structured.bitmask import unconstrained


@dataclass(frozen=True)
class Penalties:
    """`sampler.apply_penalties`' arguments, per row: a batch has them when some row's logits are shaped."""

    prompts: list[list[int]]
    outputs: list[list[int]]
    """The request's outputs so far (a migration's included), then the tokens taken as appended."""
    presence: list[float]
    frequency: list[float]
    repetition: list[float]
    blocked: list[list[int]]
    """The ids min_tokens keeps from being sampled at the row's index (EOS, stop ids)."""

    @classmethod
    def of(cls, seqs: list[Sequence], indices: list[int], ahead: list[list[int]]) -> Penalties | None:
        """The rows' penalties with `ahead[i]` appended after sequence i's outputs; None when no row's are shaped."""
        params = [s.sampling for s in seqs]
        blocked = [blocked_ids(p, s.eos_ids, i) for p, s, i in zip(params, seqs, indices)]
        if not any(_shapes(p.presence_penalty, p.frequency_penalty, repetition_penalty_of(p), b)
                   for p, b in zip(params, blocked)):
            return None
        prompts, outputs = [], []
        for s, more in zip(seqs, ahead):
            prompt, outs = s.prompt_and_outputs()
            prompts.append(prompt)
            outputs.append(outs + more)
        return cls(prompts, outputs, [p.presence_penalty for p in params], [p.frequency_penalty for p in params],
                   [repetition_penalty_of(p) for p in params], blocked)

    def take(self, rows: list[int]) -> Penalties | None:
        """These rows' penalties; None when none of them shapes its logits."""
        if not any(_shapes(self.presence[r], self.frequency[r], self.repetition[r], self.blocked[r]) for r in rows):
            return None
        return Penalties(*([column[r] for r in rows] for column in (
            self.prompts, self.outputs, self.presence, self.frequency, self.repetition, self.blocked)))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits f32 [B, V] -> the shaped logits f32 [B, V] (a new tensor)."""
        return sampler.apply_penalties(logits, self.prompts, self.outputs, self.presence, self.frequency,
                                       self.repetition, self.blocked)


@dataclass
class SamplingBatch:
    """What the sampler reads of each row of a step's logits [B, V] (row i: seqs[i] at its token indices[i])."""

    seqs: list[Sequence]
    """Each row's sequence."""
    temperature: torch.Tensor  # f32 [B] 0: greedy
    top_k: torch.Tensor  # int64 [B] 0: off
    top_p: torch.Tensor  # f32 [B] 1: off
    min_p: torch.Tensor | None  # f32 [B]
    """None when no row asks (the filter is skipped)."""
    seeds: list[int | None]
    indices: list[int]
    """The output token (counted from the request's start) each row samples: with its seed, its draw."""
    penalties: Penalties | None
    """None when no row's logits are shaped (no pass over the logits)."""
    bitmask: torch.Tensor | None  # int32 [B, ceil(V / 32)], on the host
    """Each constrained row's next-token mask, all ones for the others; None when no row is constrained."""
    num_logprobs: list[int | None]
    """How many top alternatives each row asks beside its token's logprob; None: no logprobs."""
    greedy: bool = field(init=False)
    """Every row greedy (temperature 0): `sample` takes the argmax and draws nothing."""

    def __post_init__(self) -> None:
        self.greedy = bool(((self.temperature <= 0) & torch.isfinite(self.temperature)).all())

    @classmethod
    def of(cls, seqs: list[Sequence], vocab_size: int) -> SamplingBatch:
        """The batch sampling each sequence's next token, over logits [len(seqs), vocab_size]."""
        params = [s.sampling for s in seqs]
        indices = [s.sample_index for s in seqs]
        return cls(
            seqs,
            torch.tensor([p.temperature for p in params], dtype=torch.float32),
            torch.tensor([p.top_k for p in params], dtype=torch.int64),
            torch.tensor([top_p_of(p) for p in params], dtype=torch.float32),
            torch.tensor([p.min_p for p in params], dtype=torch.float32) if any(p.min_p for p in params) else None,
            [p.seed if p.HasField("seed") else None for p in params],
            indices,
            Penalties.of(seqs, indices, [[] for _ in seqs]),
            _bitmask(seqs, vocab_size),
            [p.logprobs if p.HasField("logprobs") else None for p in params],
        )

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def plain(self) -> bool:
        """No row's logits depend on the tokens before its position (no penalty, min_tokens met): each row samples
        any later position alike but for its index (`positions`)."""
        params = [s.sampling for s in self.seqs]
        return not any(p.presence_penalty or p.frequency_penalty or repetition_penalty_of(p) != 1.0 or i < p.min_tokens
                       for p, i in zip(params, self.indices))

    # ---- the math, on the step's logits ------------------------------------------

    def shaped(self, logits: torch.Tensor) -> torch.Tensor:
        """logits f32 [B, V] with the rows' penalties and min_tokens applied (the same logits when none asks)."""
        return logits if self.penalties is None else self.penalties.apply(logits)

    def sample(self, logits: torch.Tensor) -> torch.Tensor:
        """Token ids int64 [B] from logits f32 [B, V]: penalties and min_tokens, then the grammar masks (one masked
        fill for the batch), then each row's draw."""
        shaped = self.shaped(logits)
        if self.bitmask is not None:
            shaped = sampler.apply_bitmask(shaped, self.bitmask)
        if self.greedy:
            return sampler.greedy(shaped)
        return sampler.sample(shaped, self.temperature, self.top_k, self.top_p, self.seeds, self.indices, self.min_p)

    def distribution(self, logits: torch.Tensor) -> torch.Tensor:
        """The probabilities f32 [B, V] `sample` draws each row from (penalties and min_tokens applied; no grammar
        mask: a constrained sequence is never proposed for)."""
        return sampler.distribution(self.shaped(logits), self.temperature, self.top_k, self.top_p, self.min_p)

    def logprobs(self, logits: torch.Tensor, token_ids: torch.Tensor) -> list[gen_pb.TokenLogprob | None]:
        """A TokenLogprob of the raw logits f32 [B, V] for each row whose request asked for logprobs, else None;
        token_ids int64 [B]: the tokens sampled."""
        wanted = self.num_logprobs
        if all(w is None for w in wanted):
            return [None] * len(wanted)
        top = min(max(w for w in wanted if w is not None), logits.shape[-1])
        chosen, top_ids, top_lps = (t.cpu() for t in sampler.token_logprobs(logits, token_ids, top))
        return [None if w is None else logprobs.token_logprob(t, c, ids.tolist(), lps.tolist(), w)
                for w, t, c, ids, lps in zip(wanted, token_ids.tolist(), chosen.tolist(), top_ids, top_lps)]

    # ---- a verify step's later positions -------------------------------------------

    def take(self, rows: list[int], ahead: list[list[int]] | None = None) -> SamplingBatch:
        """Rows of this batch (indexes into it), in that order; with `ahead`, each row's sequence as if ahead[i]
        had been appended after its outputs (the tokens a verify step accepted, or a draft drew, before the
        position): its index, penalties and min_tokens follow them. A constrained row keeps its mask: it is never
        proposed for, so only its first position is ever kept."""
        seqs = [self.seqs[r] for r in rows]
        if ahead is None:
            indices = [self.indices[r] for r in rows]
            penalties = None if self.penalties is None else self.penalties.take(rows)
        else:
            indices = [s.sample_index + len(more) for s, more in zip(seqs, ahead)]
            penalties = Penalties.of(seqs, indices, ahead)
        return self._rows(rows, indices, penalties)

    def positions(self, n: int) -> SamplingBatch:
        """Each row at its next n positions, row i's j-th as row i * n + j (its index j further on): for a plain
        batch, where no token before a position shapes what is sampled there."""
        if not self.plain:
            raise ValueError("a batch with penalties or min_tokens to meet samples its positions in order (`take`)")
        rows = [r for r in range(len(self)) for _ in range(n)]
        return self._rows(rows, [i + j for i in self.indices for j in range(n)], None)

    def _rows(self, rows: list[int], indices: list[int], penalties: Penalties | None) -> SamplingBatch:
        index = torch.tensor(rows, dtype=torch.int64)  # [R]
        seqs = [self.seqs[r] for r in rows]
        min_p = None if self.min_p is None else self.min_p[index]
        constrained = self.bitmask is not None and any(s.constraint is not None for s in seqs)
        return SamplingBatch(
            seqs, self.temperature[index], self.top_k[index], self.top_p[index],
            min_p if min_p is not None and bool(min_p.any()) else None,
            [self.seeds[r] for r in rows], indices, penalties,
            self.bitmask[index] if constrained else None,
            [self.num_logprobs[r] for r in rows],
        )


def _shapes(presence: float, frequency: float, repetition: float, blocked: list[int]) -> bool:
    """Whether a row's penalties or min_tokens change its logits."""
    return bool(presence or frequency or blocked or repetition != 1.0)


def _bitmask(seqs: list[Sequence], vocab_size: int) -> torch.Tensor | None:
    """int32 [B, ceil(V / 32)]: each constrained sequence's next-token mask, all ones for the others; None when no
    sequence is constrained."""
    if all(s.constraint is None for s in seqs):
        return None
    masks = unconstrained(len(seqs), vocab_size)
    for row, s in zip(masks, seqs):
        if s.constraint is not None:
            s.constraint.fill(row)
    return torch.from_numpy(masks)
