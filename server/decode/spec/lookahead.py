"""A sequence seen as if some tokens had been appended: what the sampler reads of a sequence (its sampling
parameters, the index of the token it samples next, its prompt and outputs for penalties, the ids
min_tokens blocks, its grammar's state), for the verify step's later positions, without touching the sequence itself (the
event loop may read it while the step runs in its thread)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.server.decode.sequence import Sequence
from pdserve.server.finish import blocked_ids


@dataclass
class Lookahead:
    seq: Sequence
    ahead: list[int] = field(default_factory=list)
    """Tokens taken as appended after the sequence's outputs (the accepted ones so far in this step)."""

    @property
    def sampling(self):
        return self.seq.sampling

    @property
    def sample_index(self) -> int:
        return self.seq.sample_index + len(self.ahead)

    @property
    def constraint(self):
        """The sequence's grammar state: only ever read with nothing ahead (a constrained sequence gets no
        proposal, so the verify step keeps only its first position)."""
        return self.seq.constraint

    def prompt_and_outputs(self) -> tuple[list[int], list[int]]:
        prompt, outputs = self.seq.prompt_and_outputs()
        return prompt, outputs + self.ahead

    def blocked_ids(self) -> list[int]:
        return blocked_ids(self.seq.sampling, self.seq.eos_ids, self.sample_index)
