"""The decode tier's sampler never draws a token its grammar masks (issue 38), on the CPU and as a GPU would add:
adversarial masks, settings and seeds (`tests/adversarial_draws.py`), ~300k draws of `pick` and ~100k of
`sample`.

The CPU's cumsum adds in order, so its sums never fall; a GPU's is a parallel scan whose sums need not rise where
a probability is 0 (as XLA's on the prefill tier). `_parallel_cumsum`, a Hillis-Steele scan, stands in for it
here: the old binary-search rule draws masked tokens under it (the first test), `sample` does not."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdserve.server import seeded
from pdserve.server.decode import sampler
from pdserve.server.decode.sampler import pick, sample
from tests.adversarial_draws import (GRID, SETTINGS, Row, Settings, boundary_bits, chi_square_p, reference, rows,
                                    seeds_for)

CHUNK = 8192
_SEQUENTIAL_CUMSUM = torch.Tensor.cumsum


def _parallel_cumsum(x: torch.Tensor, dim: int, **_) -> torch.Tensor:
    """Inclusive prefix sums along the last dim by a Hillis-Steele scan: log2(V) rounds of x[i] += x[i - d],
    each element summed by its own tree, as a GPU's scan adds."""
    assert dim in (-1, x.dim() - 1)
    d = 1
    while d < x.shape[-1]:
        x = x + torch.nn.functional.pad(x[..., :-d], (d, 0))
        d *= 2
    return x


@pytest.fixture(params=["sequential", "parallel"])
def scan(request, monkeypatch) -> str:
    """Each test twice: with the CPU's cumsum and with a GPU-like parallel scan in its place."""
    if request.param == "parallel":  # and `pick` takes the path it takes on a GPU
        monkeypatch.setattr(torch.Tensor, "cumsum", _parallel_cumsum)
        monkeypatch.setattr(sampler, "IN_ORDER_SCANS", frozenset())
    return request.param


def _old_pick(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """The rule before issue 38: a binary search of the cumulative sums, clamped to the last kept token."""
    cdf = probs.cumsum(dim=-1)  # [R, V]
    ids = torch.arange(probs.shape[-1])
    last_kept = torch.where(probs > 0, ids, 0).amax(dim=-1, keepdim=True)  # [R, 1]
    return torch.minimum(torch.searchsorted(cdf, uniform[:, None] * cdf[:, -1:], right=True), last_kept)[:, 0]


def _uniforms(bits: np.ndarray) -> torch.Tensor:
    """The seeded draws of seeds made to give bits [N] (random output indices): f32 [N]."""
    indices = np.random.default_rng(len(bits)).integers(0, 2**31, len(bits))
    seeds = seeds_for(bits, indices)
    return torch.tensor([seeded.uniform(int(s), int(i)) for s, i in zip(seeds, indices)], dtype=torch.float32)


def _picks(rule, probs: torch.Tensor, bits: np.ndarray) -> np.ndarray:
    """rule(probs [V] for each draw, u) for the seeded u of bits [N] -> [N]."""
    u = _uniforms(bits)
    return torch.cat([rule(probs.expand(len(part), -1), part) for part in u.split(CHUNK)]).numpy()


def _vocab_order_probs(row: Row) -> torch.Tensor:
    """What the sampler picks from without top-k/top-p at temperature 1: the softmax over the allowed."""
    return torch.from_numpy(np.where(row.allowed, row.logits, -np.inf).astype(np.float32)).softmax(dim=-1)


def test_the_old_rule_draws_masked_tokens_under_a_parallel_scan(monkeypatch):
    monkeypatch.setattr(torch.Tensor, "cumsum", _parallel_cumsum)
    forbidden = 0
    for row in rows(512):
        bits = boundary_bits(reference(row, Settings())[1], reach=2)
        forbidden += int((~row.allowed[_picks(_old_pick, _vocab_order_probs(row), bits)]).sum())
    assert forbidden > 0  # the harness finds the old rule's failure under a GPU-like scan


def test_the_cpus_cumsum_adds_in_order():
    """What `pick` relies on to skip cummax on the CPU (`sampler.IN_ORDER_SCANS`): over a large vocabulary the
    CPU's running sums never fall, and stay put where a probability is 0."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 151936, generator=g) * 6
    logits[torch.rand(4, 151936, generator=g) < 0.5] = float("-inf")
    probs = logits.softmax(dim=-1)
    steps = probs.cumsum(dim=-1).diff(dim=-1)  # [4, V - 1]
    assert (steps >= 0).all() and (steps[probs[:, 1:] == 0] == 0).all()
    assert "cpu" in sampler.IN_ORDER_SCANS


def test_pick_never_lands_on_a_masked_token_at_every_boundary(scan):
    rng = np.random.default_rng(0)
    draws = 0
    for row in rows(512, seed=5):
        probs = _vocab_order_probs(row)
        bits = np.unique(np.concatenate([boundary_bits(reference(row, Settings())[1], reach=16),
                                         rng.integers(0, GRID, 4096).astype(np.uint32)]))
        picked = _picks(pick, probs, bits)
        assert row.allowed[picked].all(), (scan, row.name, np.flatnonzero(~row.allowed[picked])[:5])
        assert (probs.numpy()[picked] > 0).all(), (scan, row.name)
        draws += len(bits)
    assert draws > 100_000


def _sample(table: list[Row], which: np.ndarray, settings: list[Settings], seeds: list[int | None],
            indices: np.ndarray) -> np.ndarray:
    """`sample` over draws of the rows in `table`, masked (-inf where not allowed, as `apply_bitmask` leaves
    them): draw n takes table[which[n]] with settings[n] and (seeds[n], indices[n]) -> tokens [N]."""
    masked = torch.from_numpy(np.stack([np.where(r.allowed, r.logits, -np.inf) for r in table]).astype(np.float32))
    column = lambda f, dt: torch.tensor([f(s) for s in settings], dtype=dt)
    temperature, top_k = column(lambda s: s.temperature, torch.float32), column(lambda s: s.top_k, torch.int64)
    top_p, min_p = column(lambda s: s.top_p, torch.float32), column(lambda s: s.min_p, torch.float32)
    out = []
    for start in range(0, len(which), CHUNK):
        part = slice(start, start + CHUNK)
        out.append(sample(masked[torch.from_numpy(which[part])], temperature[part], top_k[part], top_p[part],
                          seeds[part], indices[part].tolist(), min_p[part]))
    return torch.cat(out).numpy()


def test_sample_never_draws_a_masked_token_at_adversarial_seeds_and_settings(scan):
    """Every mask, every settings path (vocabulary order, min-p, temperature, top-k, top-p, all four), seeds at
    every boundary of the row's law, random seeds and unseeded draws."""
    rng = np.random.default_rng(1)
    table = rows(512, seed=6)
    which, settings, bits, unseeded = [], [], [], []
    for t, row in enumerate(table):
        for s in SETTINGS:
            b = np.unique(np.concatenate([boundary_bits(reference(row, s)[1], reach=1),
                                          rng.integers(0, GRID, 128).astype(np.uint32)]))
            b = np.append(b, np.zeros(128, np.uint32))  # and 128 unseeded draws
            which.append(np.full(len(b), t))
            settings += [s] * len(b)
            bits.append(b)
            unseeded.append(np.arange(len(b)) >= len(b) - 128)
    which, bits, unseeded = np.concatenate(which), np.concatenate(bits), np.concatenate(unseeded)
    indices = rng.integers(0, 2**31, len(bits))
    seeds = [None if u else int(s) for s, u in zip(seeds_for(bits, indices), unseeded)]
    tokens = _sample(table, which, settings, seeds, indices)
    allowed = np.stack([r.allowed for r in table])[which, tokens]  # [N]
    bad = np.flatnonzero(~allowed)
    assert len(bad) == 0, [(scan, table[which[n]].name, settings[n], tokens[n]) for n in bad[:5]]
    assert len(tokens) > 50_000


def test_masked_draws_follow_the_law_over_the_allowed_tokens():
    """Chi-square of 20,000 draws (seeded, and unseeded) against the float64 law (mask, temperature, filters)."""
    rng = np.random.default_rng(2)
    V = 64
    ids = np.arange(V)
    row = Row("mild", (rng.normal(size=V) * 1.5).astype(np.float32), (ids % 3 != 1) & (ids != 0))
    n = 20_000
    for s in (Settings(), Settings(temperature=0.8, min_p=0.05), Settings(top_k=12, top_p=0.9)):
        order, probs = reference(row, s)
        law = np.zeros(V)
        law[order] = probs
        for seeds in (rng.integers(0, 2**63, n).tolist(), [None] * n):
            counts = np.bincount(_sample([row], np.zeros(n, int), [s] * n, seeds, rng.integers(0, 2**31, n)),
                                 minlength=V)
            assert counts[law == 0].sum() == 0
            assert chi_square_p(counts, law) > 1e-3, (s, seeds[0], counts, law)
