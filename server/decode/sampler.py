"""Batched sampling: greedy, temperature, top-k and top-p per row, reproducible per (seed, token index).

The filters run once over the whole batch (one sort). Each row then draws one uniform number and picks
by inverse CDF. Seeded rows take it from a CPU generator seeded from (seed, index), so a seeded request
gives the same tokens on any worker and device, which a migrated request needs.
"""

from __future__ import annotations

import numpy as np
import torch


def _seeded_uniform(seed: int, index: int) -> float:
    state = np.random.SeedSequence([seed & (2**64 - 1), index]).generate_state(1, np.uint64)[0]
    generator = torch.Generator().manual_seed(int(state))
    return torch.rand((), generator=generator).item()


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seeds: list[int | None],
    indices: list[int],
) -> torch.Tensor:
    """Next token ids int64 [B] from logits f32 [B, V]; temperature 0 is greedy, top_k 0 is off."""
    greedy = logits.argmax(dim=-1)  # [B]
    is_greedy = temperature <= 0  # [B]
    if bool(is_greedy.all()):
        return greedy
    B, V = logits.shape
    device = logits.device
    temperature = torch.where(is_greedy, 1.0, temperature).to(device=device, dtype=torch.float32)
    scaled = logits.float() / temperature[:, None]  # [B, V]
    sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)  # [B, V]

    ranks = torch.arange(V, device=device)  # [V]
    k = torch.where(top_k > 0, top_k.clamp(max=V), V).to(device)  # [B]
    sorted_logits = sorted_logits.masked_fill(ranks >= k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)  # [B, V]
    mass_before = probs.cumsum(dim=-1) - probs  # [B, V] (the top token always stays)
    probs = probs.masked_fill(mass_before > top_p.to(device)[:, None], 0.0)

    uniform = torch.rand(B)  # fresh randomness for unseeded rows
    for row, (seed, index) in enumerate(zip(seeds, indices)):
        if seed is not None:
            uniform[row] = _seeded_uniform(seed, index)
    cdf = probs.cumsum(dim=-1)  # [B, V]
    target = uniform.to(device)[:, None] * cdf[:, -1:]  # [B, 1] inside the kept mass
    kept = (probs > 0).sum(dim=-1, keepdim=True)  # [B, 1] the kept tokens are a prefix of the order
    pick = torch.minimum(torch.searchsorted(cdf, target, right=True), kept - 1)  # [B, 1]
    sampled = order.gather(1, pick)[:, 0]  # [B]
    return torch.where(is_greedy.to(device), greedy, sampled)


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The model's log-probabilities (raw logits, before temperature and filters) of the chosen tokens.

    logits f32 [B, V], token_ids int64 [B] -> (chosen f32 [B], top_ids int64 [B, num_top],
    top_logprobs f32 [B, num_top], most likely first).
    """
    logprobs = logits.float().log_softmax(dim=-1)  # [B, V]
    chosen = logprobs.gather(1, token_ids.to(logits.device)[:, None])[:, 0]  # [B]
    top_logprobs, top_ids = logprobs.topk(num_top, dim=-1)  # [B, num_top]
    return chosen, top_ids, top_logprobs
