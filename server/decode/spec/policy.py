"""How many proposed tokens a step verifies, batch-aware, from the step costs measured on this worker.

A step of B sequences with up to c proposals each costs cost(B, c + 1) seconds (measured: a moving average
per (batch bucket 1, 2, 4, ..., c + 1), never a constant guessed here) and emits B + the expected accepted
proposals, E = sum over sequences of sum_{j <= c_i} a_1 ... a_j, a_j the measured rate at which the j-th
proposal is accepted once the ones before it were. Each step takes the cap c in 0..k with the most expected
tokens per second. Where the step is bandwidth-bound (small batches) cost(B, k + 1) ~ cost(B, 1) and
speculation pays; where it is compute-bound the cost grows with c and the cap shrinks to 0.
With draft_model, a step verifying c proposals also runs the draft's c forward steps (inside the step,
`Speculator.verify`), so the measured cost(B, c + 1) is the draft's c steps plus the verify: a draft too
dear for its acceptance rate gets the cap 0 as a costly verify does.

A bucket's first step verifies the full k, its next a plain step (both measured); a (bucket, c + 1) not
measured yet is taken to cost what c = 0 does (so it gets tried, and measured). Then, so that the
estimates follow the workload and the machine, a bucket's step verifies the full k every `interval` steps
(an exploration): `explore_every` while speculation is being taken, doubling (up to `max_explore_every`)
after each exploration that was not followed by a single step taking it, so that a workload nothing is
accepted on pays for an exploration ever more rarely; while speculation is taken, the step halfway
between explorations is plain (its cost measured again). A larger cap must promise 5% more.
vLLM's `disable_by_batch_size` turns speculation off for batches at least that large.
"""

from __future__ import annotations

from dataclasses import dataclass


def bucket(batch: int) -> int:
    """The power of two holding the batch (1, 2, 4, ...)."""
    return 1 << max(0, batch - 1).bit_length()


class SpecPolicy:
    def __init__(self, k: int, disable_by_batch_size: int | None = None, explore_every: int = 32,
                 smoothing: float = 0.2, margin: float = 0.05, max_explore_every: int | None = None):
        """margin: a larger cap is taken only for at least this much more expected tokens per second (a step's
        measured cost moves by a few percent from step to step: a bet of 2% measured to pay was found, on a
        non-repetitive workload at batch 16, to cost 3%)."""
        self.k = k
        self.margin = margin
        self.disable_by_batch_size = disable_by_batch_size
        self.explore_every = explore_every
        self.max_explore_every = 16 * explore_every if max_explore_every is None else max_explore_every
        self._explore: dict[int, _Exploration] = {}
        self.smoothing = smoothing
        self.cost: dict[tuple[int, int], float] = {}
        """(batch bucket, query positions per sequence) -> a moving average of the step's seconds."""
        self.accept_rate = [0.5] * k
        """a_j for j = 1..k (index j - 1): P(the j-th proposal is accepted | the ones before it were)."""
        self._steps: dict[int, int] = {}

    def cap(self, batch: int, proposal_lens: list[int]) -> int:
        """The most proposals a sequence verifies this step (0: a plain one-token step)."""
        if not any(proposal_lens) or (self.disable_by_batch_size and batch >= self.disable_by_batch_size):
            return 0
        b = bucket(batch)
        n = self._steps[b] = self._steps.get(b, 0) + 1
        plan = self._plan(b)
        measured = [key for key in self.cost if key[0] == b]
        if not measured:
            return self.k
        if n >= plan.next:
            plan.explored(n, self.explore_every, self.max_explore_every)
            return self.k
        base = self.cost.get((b, 1))
        if base is None or (plan.taken and n == plan.next - plan.interval // 2):
            return 0  # the plain step's cost, measured (again)
        best, best_rate = 0, 0.0
        for c in range(self.k + 1):
            seconds = self._cost(b, c + 1)
            expected = batch + sum(self._expected(min(c, n)) for n in proposal_lens)
            rate = expected / max(seconds, 1e-9)
            if rate > best_rate * (1 + self.margin):
                best, best_rate = c, rate
        plan.taken = plan.taken or best > 0
        return best

    def _plan(self, b: int) -> _Exploration:
        plan = self._explore.get(b)
        if plan is None:
            plan = self._explore[b] = _Exploration(self.explore_every, self.explore_every)
        return plan

    def worth_looking(self, batch: int) -> bool:
        """Whether proposals could change this step's cap (even if every sequence had k): when not, the engine
        skips the lookup. The step count `cap` keeps is not advanced."""
        if self.disable_by_batch_size and batch >= self.disable_by_batch_size:
            return False
        b = bucket(batch)
        n = self._steps.get(b, 0) + 1
        plan = self._plan(b)
        if (b, 1) not in self.cost or n >= plan.next or (plan.taken and n == plan.next - plan.interval // 2):
            return True
        base = self.cost[(b, 1)]
        return any((batch + batch * self._expected(c)) / max(self._cost(b, c + 1), 1e-9)
                   > batch / max(base, 1e-9) * (1 + self.margin) for c in range(1, self.k + 1))

    def _cost(self, b: int, positions: int) -> float:
        """The measured cost, or for positions not measured yet the dearest measured with fewer (a step never
        costs less with more positions): optimistic, so it gets tried."""
        seconds = self.cost.get((b, positions))
        if seconds is None:
            seconds = max(v for (bb, s), v in self.cost.items() if bb == b and s < positions)
        return seconds

    def _expected(self, n: int) -> float:
        """Expected accepted tokens of n proposals."""
        total, p = 0.0, 1.0
        for j in range(n):
            p *= self.accept_rate[j]
            total += p
        return total

    def skipped(self, batch: int) -> None:
        """A step whose lookup `worth_looking` skipped: it counts towards the next exploration."""
        if not (self.disable_by_batch_size and batch >= self.disable_by_batch_size):
            b = bucket(batch)
            self._steps[b] = self._steps.get(b, 0) + 1

    def observe_step(self, batch: int, positions: int, seconds: float) -> None:
        key = (bucket(batch), positions)
        old = self.cost.get(key)
        self.cost[key] = seconds if old is None else old + self.smoothing * (seconds - old)

    def observe_acceptance(self, proposed: int, accepted: int) -> None:
        """One sequence's verify: `accepted` of its `proposed` tokens (a common prefix) were taken."""
        for j in range(min(proposed, accepted + 1)):  # positions reached: 1..accepted+1 (the last one rejected)
            hit = 1.0 if j < accepted else 0.0
            self.accept_rate[j] += self.smoothing * (hit - self.accept_rate[j])


@dataclass
class _Exploration:
    """A bucket's exploration schedule."""

    interval: int
    next: int
    """The step count at which the bucket next verifies the full k."""
    taken: bool = False
    """Whether a step since the last exploration took a cap above 0."""

    def explored(self, n: int, base: int, most: int) -> None:
        """Step n explores: the next one `base` steps on if speculation was taken since the last, else twice as
        far as this one was (at most `most`)."""
        self.interval = base if self.taken else min(2 * self.interval, most)
        self.next = n + self.interval
        self.taken = False
