"""One draw per (seed, token index) on both tiers: the prefill tier's jitted sampler and the decode tier's
pick the same token for the same logits and settings, so a seeded request keeps its tokens whichever tier
samples them (a migrated request's first token after the migration comes from the prefill tier)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch

from pdserve.server import seeded
from pdserve.server.decode.sampler import sample as decode_sample
from pdserve.server.prefill.sampler import _uniform, sample_jit


def test_the_prefill_samplers_uniform_is_the_hosts():
    rng = np.random.default_rng(0)
    seeds = [0, 1, 2**32 - 1, 2**32, 2**64 - 1, *rng.integers(0, 2**63, 200, dtype=np.int64).tolist()]
    indices = [0, 1, 7, 2**31 - 1, *rng.integers(0, 10**6, 200).tolist()][: len(seeds)]
    indices += [3] * (len(seeds) - len(indices))
    host = [seeded.uniform(s, i) for s, i in zip(seeds, indices)]
    device = _uniform(jnp.asarray([seeded.fold(s) for s in seeds], jnp.uint32), jnp.asarray(indices, jnp.int32))
    assert np.asarray(device).tolist() == host
    assert all(0.0 <= u < 1.0 for u in host) and len(set(host)) == len(host)
    assert seeded.uniform(5, 0) != seeded.uniform(5, 1) != seeded.uniform(6, 1)


def test_both_tiers_pick_the_same_token_for_the_same_seed_and_index():
    rng = np.random.default_rng(1)
    B, V = 400, 37
    logits = (rng.normal(size=(B, V)) * rng.choice([0.5, 2.0, 6.0], size=(B, 1))).astype(np.float32)
    temperature = rng.choice([0.0, 0.3, 1.0, 2.0], size=B).astype(np.float32)
    top_k = rng.choice([0, 1, 5, V, V + 10], size=B).astype(np.int64)
    top_p = rng.choice([1.0, 0.95, 0.5, 0.1], size=B).astype(np.float32)
    min_p = rng.choice([0.0, 0.0, 0.05, 0.3], size=B).astype(np.float32)
    seeds = rng.integers(0, 2**63, B, dtype=np.int64).tolist()
    indices = rng.integers(0, 5000, B).tolist()
    on_prefill = sample_jit(jnp.asarray(logits), jnp.asarray(temperature), jnp.asarray(top_k, jnp.int32),
                            jnp.asarray(top_p), jnp.asarray([seeded.fold(s) for s in seeds], jnp.uint32),
                            jnp.asarray(indices, jnp.int32), jnp.asarray(min_p))
    on_decode = decode_sample(torch.from_numpy(logits), torch.from_numpy(temperature), torch.from_numpy(top_k),
                              torch.from_numpy(top_p), seeds, indices, torch.from_numpy(min_p))
    assert np.asarray(on_prefill).tolist() == on_decode.tolist()
    sampled = temperature > 0
    assert len(set(np.asarray(on_prefill)[sampled].tolist())) > 20  # the draws spread over the vocabulary


def test_both_tiers_pick_the_same_token_under_adversarial_masks():
    """The same (seed, index), logits and grammar mask give the same token on both tiers, for every mask and
    settings path of `tests/adversarial_draws.py` (ties, near ties, a lone allowed token, the vocabulary's ends),
    and both are allowed. (Seeds made to land within a grid step of a boundary of the law can part where the
    tiers' exp and running sums round apart: the tiers' own tests hold those to the mask.)"""
    from tests.adversarial_draws import SETTINGS, rows
    from tests.decode.test_sampler_masks import _sample as on_decode
    from tests.prefill.test_sampler_masks import _sample as on_prefill

    rng = np.random.default_rng(2)
    table = rows(256, seed=9)
    which = np.repeat(np.arange(len(table)), 500 * len(SETTINGS))
    settings = [s for _ in table for s in SETTINGS for _ in range(500)]
    seeds = rng.integers(0, 2**32, len(which), dtype=np.uint64).astype(np.uint32)
    indices = rng.integers(0, 2**31, len(which))
    prefill = on_prefill(table, which, settings, seeds, indices)
    decode = on_decode(table, which, settings, [int(s) for s in seeds], indices)
    assert np.stack([r.allowed for r in table])[which, prefill].all()
    differ = np.flatnonzero(prefill != decode)
    assert len(differ) == 0, [(table[which[n]].name, settings[n], prefill[n], decode[n]) for n in differ[:5]]


def test_a_row_with_no_finite_law_takes_argmax_on_both_tiers():
    """A +inf logit makes the softmax NaN: nothing has a positive probability, so both tiers answer as greedy
    does (the +inf token, allowed), never an arbitrary id; every path (vocabulary order, ranked)."""
    V = 80
    logits = np.zeros((4, V), np.float32)
    logits[:, 37] = np.inf
    temperature = np.ones(4, np.float32)
    top_k, top_p = np.array([0, 5, 0, 0]), np.array([1.0, 1.0, 0.9, 1.0], np.float32)
    min_p = np.array([0.0, 0.0, 0.0, 0.1], np.float32)
    seeds, indices = [1, 2, 3, 4], [0, 0, 0, 0]
    on_prefill = sample_jit(jnp.asarray(logits), jnp.asarray(temperature), jnp.asarray(top_k, jnp.int32),
                            jnp.asarray(top_p), jnp.asarray(seeds, jnp.uint32), jnp.asarray(indices, jnp.int32),
                            jnp.asarray(min_p))
    on_decode = decode_sample(torch.from_numpy(logits), torch.from_numpy(temperature), torch.from_numpy(top_k),
                              torch.from_numpy(top_p), seeds, indices, torch.from_numpy(min_p))
    assert np.asarray(on_prefill).tolist() == on_decode.tolist() == [37] * 4
