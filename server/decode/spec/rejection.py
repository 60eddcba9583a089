"""Which proposed tokens a verify step accepts: exact for greedy, and for sampling the target's own law.

For one sequence with proposals d_1..d_k verified in one step, the step gives the target's logits at k + 1
positions: position j's (j = 0..k) are those after the tokens so far and d_1..d_j. Walk j = 0, 1, ...:

    t_j = the token the sampler draws at position j, exactly as a one-token step would draw it there
          (penalties and min_tokens over the outputs so far plus t_0..t_{j-1}, the request's temperature,
          top-k, top-p, min-p, and, for a seeded request, the uniform number of (seed, token index));
    emit t_j; go on to j + 1 only while t_j == d_{j+1} (d_{j+1} accepted) and j < k.

The step emits t_0..t_m, m the number of accepted proposals (0..k): at least one token, at most k + 1.

Why this is exact. Greedy: t_j is the argmax a one-token step would take, and each position attends
exactly the tokens a one-token step would have (the accepted ones equal the t's), so the output is the
same token for token. Sampling: an n-gram proposal is a point mass q = δ_x (x = d_{j+1}). Speculative
sampling (Leviathan et al. 2023; Chen et al. 2023) accepts x with probability min(1, p(x) / q(x)) = p(x),
p the target's distribution at that position (after temperature and filters), and on rejection draws
from norm(max(0, p - q)), which for q = δ_x is p with x removed and renormalised: p(y) / (1 - p(x)), y ≠ x.
Drawing t ~ p by the sampler's inverse CDF from one uniform u and accepting iff t == x is that very
rule: P(accept) = P(t = x) = p(x), and given a rejection, t is distributed as p conditioned on t ≠ x.
So every emitted token has the target's distribution given the tokens before it, and, since t_j is drawn
from the same uniform number of (seed, token index) as without speculation, a seeded request gives the
same tokens with speculation on or off, on any worker and batch (what migration relies on).

A draft model's proposals (draft_model): for greedy and seeded requests the same rule. The draft draws d_{j+1}
with the request's own sampler and the same uniform number of (seed, token index) from its distribution q
(greedy: its argmax), so where q is close to p it lands on the target's draw t_j, and the emitted tokens are
the t's, as without speculation, whatever the draft proposes (and so migration stays reproducible). For an
unseeded sampled request the general rule (`accept_or_resample`): d ~ q, accepted with probability
min(1, p(d) / q(d)); on a rejection the token is drawn from norm(max(0, p - q)); after k acceptances the
bonus token is drawn from p. Every emitted token then has law p given the ones before it (Leviathan et al.,
Theorem 1), p being `sampler.distribution` of the logits with the request's penalties, min_tokens and filters.
A token p gives 0 (filtered, blocked) is never emitted: its acceptance needs u q(d) < 0, and the residual's
draw is `sampler.pick`, which only returns tokens of positive mass, and max(0, p - q) is 0 wherever p is.
"""

from __future__ import annotations

import torch

from pdserve.server.decode.sampler import pick


def accepted(drafts: list[int], sampled: list[int]) -> int:
    """How many of `drafts` the sampled tokens t_0.. accept: the length of their common prefix."""
    m = 0
    while m < len(drafts) and m < len(sampled) and sampled[m] == drafts[m]:
        m += 1
    return m


def accept_or_resample(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, uniform: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling's rule for rows whose draft token was drawn from q: p, q f32 [R, V] (target's,
    draft's), drafts int64 [R], uniform [R] in [0, 1) -> (accepted bool [R], token int64 [R]: the draft where
    accepted, else a draw from norm(max(0, p - q)))."""
    drafts = drafts.to(p.device)[:, None]  # [R, 1]
    p_d, q_d = p.gather(1, drafts)[:, 0], q.gather(1, drafts)[:, 0]  # [R]
    accept = uniform.to(p.device) * q_d < p_d  # P = min(1, p(d) / q(d)); q(d) > 0 as d ~ q
    residual = (p - q).clamp(min=0)  # [R, V]
    mass = residual.sum(dim=-1, keepdim=True)  # [R, 1] 0 only where p = q, where nothing is rejected
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p)
    resampled = pick(residual, torch.rand(residual.shape[0]))  # [R] never a token of residual 0
    return accept, torch.where(accept, drafts[:, 0], resampled)
