"""The speculative verifier's general rule (`spec/rejection.py`: a draft token d ~ q accepted with min(1, p/q),
else a draw from norm(max(0, p - q))) never emits a token the target's law gives 0 (blocked, filtered: -inf
logits), whatever the draft's q, its tokens and the uniform numbers (issue 38): adversarial masks
(`tests/adversarial_draws.py`), drafts that put their mass on exactly the forbidden tokens, residuals that are
rounding noise, uniform numbers at every boundary of the residual's CDF, with the CPU's scan and a GPU-like one.
Greedy and seeded requests emit the target's own draw (`sample`, `test_sampler_masks.py`).

The residual used to be drawn by torch.multinomial, which has drawn zero-weight categories in several torch
releases (pytorch/pytorch#13867, #48841; this CPU build passes these tests with it); `sampler.pick` cannot."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdserve.server.decode import sampler
from pdserve.server.decode.sampler import distribution
from pdserve.server.decode.spec.rejection import accept_or_resample
from tests.adversarial_draws import Row, Settings, boundary_bits, chi_square_p, rows
from tests.decode.test_sampler_masks import _parallel_cumsum


@pytest.fixture(params=["sequential", "parallel"])
def scan(request, monkeypatch) -> str:
    if request.param == "parallel":  # and `pick` takes the path it takes on a GPU
        monkeypatch.setattr(torch.Tensor, "cumsum", _parallel_cumsum)
        monkeypatch.setattr(sampler, "IN_ORDER_SCANS", frozenset())
    return request.param


def _law(row: Row, s: Settings | None = None) -> torch.Tensor:
    """The target's p over row's allowed tokens: `distribution` of the masked logits -> f32 [1, V]."""
    s = s or Settings()
    masked = torch.from_numpy(np.where(row.allowed, row.logits, -np.inf).astype(np.float32))[None]
    return distribution(masked, torch.tensor([s.temperature]), torch.tensor([s.top_k]), torch.tensor([s.top_p]),
                        torch.tensor([s.min_p]))


def _drafts_q(row: Row, p: torch.Tensor, rng: np.random.Generator) -> list[tuple[str, torch.Tensor]]:
    """Draft laws q [1, V] against the target's p: most mass on the forbidden tokens, one-hot on a forbidden
    token, p nudged by rounding noise (a residual of ulps), and p itself (no residual: the rule falls back to p)."""
    V = p.shape[-1]
    forbidden = torch.from_numpy(~row.allowed)
    logits = torch.from_numpy(row.logits.astype(np.float32)) + 30.0 * forbidden  # [V]
    heavy = logits.softmax(-1)[None]
    one_hot = torch.zeros(1, V)
    one_hot[0, int(forbidden.nonzero()[0, 0]) if forbidden.any() else 0] = 1.0
    noise = p * (1 + torch.from_numpy(rng.normal(size=V).astype(np.float32)) * 1e-6) + 1e-9 * forbidden
    return [("on the forbidden", heavy), ("one-hot forbidden", one_hot),
            ("p plus noise", noise / noise.sum()), ("p", p.clone())]


def test_the_verifier_never_emits_a_token_the_target_gives_zero(scan):
    rng = np.random.default_rng(0)
    draws = 0
    for row in rows(512, seed=7):
        for s in (Settings(), Settings(top_k=40, top_p=0.9)):
            p = _law(row, s)  # [1, V]
            zero = (p[0] == 0).numpy()
            for name, q in _drafts_q(row, p, rng):
                n = 2048
                drafts = torch.cat([torch.multinomial(q, n // 2, replacement=True)[0],  # d ~ q
                                    torch.from_numpy(rng.integers(0, p.shape[-1], n // 2))])  # any token at all
                _, tokens = accept_or_resample(p.expand(n, -1), q.expand(n, -1), drafts, torch.rand(n))
                bad = zero[tokens.numpy()]
                assert not bad.any(), (scan, row.name, s, name, tokens[torch.from_numpy(bad)][:5])
                draws += n
    assert draws > 200_000


def test_the_residual_draw_is_never_a_zero_token_at_any_boundary(scan, monkeypatch):
    """The residual's uniform numbers (drawn inside `accept_or_resample`) put at every boundary of its CDF."""
    rng = np.random.default_rng(1)
    draws = 0
    for row in rows(512, seed=8):
        p = _law(row)
        zero = (p[0] == 0).numpy()
        for name, q in _drafts_q(row, p, rng)[:3]:
            residual = (p - q).clamp(min=0)[0].double().numpy()
            if residual.sum() == 0:
                continue
            bits = boundary_bits(residual, reach=4)
            u = torch.from_numpy(bits.astype(np.float32) * np.float32(2.0**-24))
            monkeypatch.setattr(torch, "rand", lambda n, _u=u: _u[:n])
            drafts = torch.full((len(u),), int(q[0].argmax()))
            accept, tokens = accept_or_resample(p.expand(len(u), -1), q.expand(len(u), -1), drafts,
                                                torch.ones(len(u)) * 0.999999)
            assert not zero[tokens[~accept].numpy()].any(), (scan, row.name, name)
            draws += len(u)
    assert draws > 20_000


def test_the_verifiers_tokens_follow_the_targets_law():
    """Chi-square: d ~ q, accepted or replaced by the rule, is distributed as p (Leviathan et al., Theorem 1),
    with p masked and q's mass mostly on the masked tokens."""
    rng = np.random.default_rng(2)
    torch.manual_seed(2)  # the draws below (multinomial, rand): a fixed sample, not a 1-in-500 failure per run
    V, n = 48, 60_000
    ids = np.arange(V)
    row = Row("mild", (rng.normal(size=V) * 1.5).astype(np.float32), ids % 4 != 2)
    p = _law(row)
    for name, q in (("q near p", (p + torch.from_numpy(rng.random(V).astype(np.float32)) * 0.02)),
                    ("q on the forbidden", _drafts_q(row, p, rng)[0][1])):
        q = q / q.sum()
        drafts = torch.multinomial(q, n, replacement=True)[0]
        _, tokens = accept_or_resample(p.expand(n, -1), q.expand(n, -1), drafts, torch.rand(n))
        counts = np.bincount(tokens.numpy(), minlength=V)
        law = p[0].double().numpy()
        assert counts[law == 0].sum() == 0
        assert chi_square_p(counts, law / law.sum()) > 1e-3, (name, counts)
