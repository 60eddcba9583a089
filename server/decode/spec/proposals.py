"""What one speculative step verifies, per sequence of its batch."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Proposals:
    lengths: list[int]
    """Lookahead slots each sequence's blocks hold for this step (0: it samples one token, as without speculation)."""
    tokens: list[list[int]]
    """The proposed tokens, lengths[i] of them: the n-gram's, known before the step; a draft model's, drawn inside it
    (`draft.py`)."""
    q: list[torch.Tensor | None] = field(default_factory=list)
    """For a draft drawn from a distribution (an unseeded sampled request): that distribution, f32 [lengths[i], V],
    which the general rule (`rejection.accept_or_resample`) reads; None elsewhere."""

    @classmethod
    def of(cls, tokens: list[list[int]]) -> Proposals:
        """Tokens known before the step (the n-gram proposer's)."""
        return cls([len(t) for t in tokens], tokens, [None] * len(tokens))

    def __bool__(self) -> bool:
        return any(self.lengths)
