"""Batched sampling: greedy, temperature, top-k, top-p and min-p per row, reproducible per (seed, token
index); penalties and min_tokens shape the logits first (`apply_penalties`), as vLLM does, then the
structured-output mask (`apply_bitmask`), when a row of the batch has one.

Each row draws one uniform number and picks by inverse CDF. Rows without top-k/top-p (temperature,
min-p) walk the vocabulary in id order: no sort. Rows with them sort their logits once (together) and
walk that order. Seeded rows take the number of `server/seeded.py` for (seed, index), the one the
prefill tier's sampler draws too, and a row's path depends only on its own parameters, so a seeded
request gives the same tokens on any worker, tier, device and batch, which a migrated request needs.

`pick` never returns a token of probability 0 (masked by a grammar, filtered, blocked: -inf logits), whatever
order a device's scan adds the probabilities in (a GPU's cumsum, like XLA's, need not rise where a
probability is 0): it takes the first token of positive probability whose running sum passes the target.
"""

from __future__ import annotations

import numpy as np
import torch

from pdserve.server import seeded


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] -> the first id of each row's largest logit [B] (argmax's answer; on CPU max's indices
    come ~1.7x faster than argmax over a 152k vocabulary)."""
    return logits.max(dim=-1).indices


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seeds: list[int | None],
    indices: list[int],
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Next token ids int64 [B] from logits f32 [B, V]; temperature 0 is greedy, top_k 0 and min_p 0 are off.

    The parameters [B] come on the host (`sampling.py`'s SamplingBatch builds them from the requests), so
    choosing each row's path never waits on the device.
    """
    if not bool(torch.isfinite(temperature).all()):  # on the host: a row no validation caught fails its step
        raise ValueError(f"temperatures must be finite numbers, got {temperature.tolist()}")
    greedy_ids = greedy(logits)  # [B]
    is_greedy = temperature <= 0  # [B]
    if bool(is_greedy.all()):
        return greedy_ids
    B, V = logits.shape
    device = logits.device
    inverse = 1.0 / torch.where(is_greedy, 1.0, temperature).float()  # [B] as XLA divides: by the reciprocal
    scaled = logits.float() * inverse.to(device)[:, None]  # [B, V]
    min_p = torch.zeros(B) if min_p is None else min_p
    uniform = torch.rand(B)  # fresh randomness for unseeded rows
    for row, (seed, index) in enumerate(zip(seeds, indices)):
        if seed is not None:
            uniform[row] = seeded.uniform(seed, index)
    ranked = ((top_k > 0) & (top_k < V)) | (top_p < 1.0)  # [B] rows whose filters need the order
    sampled = greedy_ids.clone()
    for rows, draw in ((~ranked & ~is_greedy, _draw_in_vocab_order), (ranked & ~is_greedy, _draw_ranked)):
        if bool(rows.any()):
            picked = rows.nonzero()[:, 0]  # [R]
            on = picked.to(device)
            drawn = draw(scaled[on], top_k[picked], top_p[picked], min_p[picked], uniform[picked])  # [R]
            sampled[on] = torch.where(drawn >= 0, drawn, greedy_ids[on])  # -1: nothing finite, argmax's answer
    return sampled


IN_ORDER_SCANS = frozenset({"cpu"})
"""Device types whose cumsum adds in order, so its sums never fall: `pick` need not make them monotone."""


def pick(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """The inverse CDF's index per row, only ever one whose probability is > 0: probs f32 [R, V] >= 0 (any
    total), uniform [R] in [0, 1) -> int64 [R], the first index of positive probability whose running sum
    (made monotone) exceeds uniform x the total, the last such index if rounding leaves none, -1 where no
    probability is > 0 (a NaN or all -inf row). The prefill tier's `_pick` is the same rule."""
    device, V = probs.device, probs.shape[-1]
    cdf = probs.cumsum(dim=-1)  # [R, V]
    if device.type not in IN_ORDER_SCANS:  # a GPU's parallel scan need not rise where a probability is 0
        cdf = cdf.cummax(dim=-1).values
    target = uniform.to(device)[:, None] * cdf[:, -1:]  # [R, 1]
    kept = probs > 0  # [R, V]
    hit, first = ((cdf > target) & kept).max(dim=-1)  # [R] the first True (max's indices: the first maximum)
    any_kept, from_end = kept.flip(-1).max(dim=-1)  # [R]
    last = torch.where(any_kept, V - 1 - from_end, -1)  # [R]
    return torch.where(hit, first, last)


def _draw_in_vocab_order(scaled: torch.Tensor, top_k, top_p, min_p: torch.Tensor, uniform: torch.Tensor
                         ) -> torch.Tensor:
    """No top-k/top-p: the inverse CDF over the vocabulary in id order, no sort. scaled [R, V] -> [R] (-1 where
    no logit is finite)."""
    device = scaled.device
    min_p = min_p.to(device)[:, None]  # [R, 1]
    floor = scaled.amax(dim=-1, keepdim=True) + torch.log(min_p.clamp(min=1e-30))  # [R, 1]
    scaled = scaled.masked_fill((scaled < floor) & (min_p > 0), float("-inf"))
    return pick(scaled.softmax(dim=-1), uniform)


def _draw_ranked(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                 uniform: torch.Tensor) -> torch.Tensor:
    """top-k, then min-p, then top-p over the logits sorted once, most likely first; the inverse CDF in
    that order. scaled [R, V] -> [R]."""
    R, V = scaled.shape
    device = scaled.device
    sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)  # [R, V]
    ranks = torch.arange(V, device=device)  # [V]
    k = torch.where(top_k > 0, top_k.clamp(max=V), V).to(device)  # [R]
    sorted_logits = sorted_logits.masked_fill(ranks >= k[:, None], float("-inf"))
    min_p = min_p.to(device)[:, None]  # [R, 1] below min_p x the top probability: p_i / p_0 = exp(l_i - l_0)
    floor = sorted_logits[:, :1] + torch.log(min_p.clamp(min=1e-30))  # [R, 1]
    sorted_logits = sorted_logits.masked_fill((sorted_logits < floor) & (min_p > 0), float("-inf"))
    probs = sorted_logits.softmax(dim=-1)  # [R, V]
    mass_before = probs.cumsum(dim=-1) - probs  # [R, V] (the top token always stays)
    probs = probs.masked_fill(mass_before > top_p.to(device)[:, None], 0.0)
    rank = pick(probs, uniform).clamp(min=0)  # [R] nothing finite: rank 0, the argmax
    return order.gather(1, rank[:, None])[:, 0]


def distribution(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """The probabilities f32 [B, V], in vocabulary order, that `sample` draws each row from: temperature, then
    top-k, min-p and top-p as `_draw_ranked` applies them (a row without them keeps the whole vocabulary, as
    `_draw_in_vocab_order` does); a greedy row (temperature 0) is one-hot at `greedy`'s id. What the general
    speculative rule (`spec/rejection.py`) reads as the target's p and the draft's q; equal to the draws' law,
    not to their last bit."""
    B, V = logits.shape
    device = logits.device
    is_greedy = (temperature <= 0).to(device)  # [B]
    inverse = 1.0 / torch.where(temperature <= 0, 1.0, temperature).float()  # [B] as `sample` scales
    scaled = logits.float() * inverse.to(device)[:, None]  # [B, V]
    sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)  # [B, V]
    k = torch.where(top_k > 0, top_k.clamp(max=V), V).to(device)  # [B]
    sorted_logits = sorted_logits.masked_fill(torch.arange(V, device=device) >= k[:, None], float("-inf"))
    min_p = torch.zeros(B) if min_p is None else min_p
    min_p = min_p.to(device)[:, None]  # [B, 1]
    floor = sorted_logits[:, :1] + torch.log(min_p.clamp(min=1e-30))  # [B, 1]
    sorted_logits = sorted_logits.masked_fill((sorted_logits < floor) & (min_p > 0), float("-inf"))
    probs = sorted_logits.softmax(dim=-1)  # [B, V]
    mass_before = probs.cumsum(dim=-1) - probs  # [B, V]
    probs = probs.masked_fill(mass_before > top_p.to(device)[:, None], 0.0)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    out = torch.zeros_like(probs).scatter_(1, order, probs)  # [B, V] back in vocabulary order
    one_hot = torch.zeros_like(out).scatter_(1, greedy(logits)[:, None], 1.0)
    return torch.where(is_greedy[:, None], one_hot, out)


_BITS = {}
"""Per device: int32 [32], bit i's value (the unpacking's shifts)."""


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits f32 [B, V] with the tokens each row's packed mask int32 [B, ceil(V / 32)] (on the host) leaves
    out at -inf (bit i of word w: token 32w + i), the whole batch in one select; an all-ones row is unchanged.
    On the CPU the bits are unpacked by numpy (one pass in C); on a device, the packed words go over and
    are unpacked there."""
    device, vocab = logits.device, logits.shape[-1]
    if device.type == "cpu":
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")  # [B, 32W]
        allowed = torch.from_numpy(np.ascontiguousarray(bits[:, :vocab]).view(np.bool_))  # [B, V]
    else:
        shifts = _BITS.get(device)
        if shifts is None:
            shifts = _BITS[device] = torch.arange(32, dtype=torch.int32, device=device)
        words = bitmask.to(device, non_blocking=True)  # [B, W]
        allowed = ((words[:, :, None] >> shifts) & 1).bool().flatten(1)[:, :vocab]  # [B, V]
    return torch.where(allowed, logits, float("-inf"))


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


def apply_penalties(
    logits: torch.Tensor,
    prompt_ids: list[list[int]],
    output_ids: list[list[int]],
    presence: list[float],
    frequency: list[float],
    repetition: list[float],
    blocked: list[list[int]],
) -> torch.Tensor:
    """The logits f32 [B, V] with vLLM's penalties per row: repetition over prompt and output tokens
    (positive logits / r, negative x r), then frequency x count and presence over output tokens;
    `blocked` ids (EOS and stop ids before min_tokens) get -inf."""
    out = logits.float().clone()  # [B, V]
    V = out.shape[-1]
    for row in range(out.shape[0]):
        outputs = torch.tensor(output_ids[row], dtype=torch.int64, device=out.device)
        if repetition[row] != 1.0:
            seen = torch.zeros(V, dtype=torch.bool, device=out.device)
            seen[torch.tensor(prompt_ids[row], dtype=torch.int64, device=out.device)] = True
            seen[outputs] = True
            r = out[row]
            out[row] = torch.where(seen, torch.where(r > 0, r / repetition[row], r * repetition[row]), r)
        if (frequency[row] or presence[row]) and len(output_ids[row]):
            counts = torch.bincount(outputs, minlength=V)[:V].float()  # [V]
            out[row] -= frequency[row] * counts + presence[row] * (counts > 0).float()
        if blocked[row]:
            out[row, torch.tensor(blocked[row], dtype=torch.int64, device=out.device)] = float("-inf")
    return out
