"""Gemma's soft-caps on the prefill tier against transformers: Gemma 2's defaults where config.json omits them
(50 on the scores, 30 on the logits) and Gemma 3's final_logit_softcapping, on checkpoints whose scores and
logits are large enough that each cap changes them (server/model/tiny.py `_sharpened`)."""

from __future__ import annotations

import json
from dataclasses import replace

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from pdserve.server.model.config import load_config
from pdserve.server.model.tiny import WINDOW
from pdserve.server.model.weights import load_weights
from pdserve.server.prefill.model import forward_logits, load_params

TOL = 5e-5
"""Relative to the largest logit: these reach ~25, through scores 16 times the usual (fp32 rounding grows too)."""

CAPS = {"gemma2-defaults": (50.0, 30.0), "gemma3-softcapped": (None, 15.0)}


@pytest.fixture(scope="module", params=list(CAPS))
def capped(request, tiny_model):
    path = tiny_model(request.param)
    config = load_config(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return request.param, path, config, load_params(config, load_weights(path)), hf


def test_logits_and_greedy_tokens_match_transformers_only_with_the_caps(capped):
    name, path, config, params, hf = capped
    written = json.loads((path / "config.json").read_text())
    if name == "gemma2-defaults":  # omitted: transformers' Gemma2Config defaults apply
        assert "attn_logit_softcapping" not in written and "final_logit_softcapping" not in written
    assert (config.attn_softcap, config.final_softcap) == CAPS[name]
    assert (hf.config.attn_logit_softcapping, hf.config.final_logit_softcapping) == CAPS[name]
    ids = np.random.default_rng(5).integers(0, config.vocab_size, 2 * WINDOW + 5, dtype=np.int32)
    with torch.no_grad():
        want = hf(torch.tensor(ids[None], dtype=torch.long)).logits[0].numpy()  # [S, V]
    tol = TOL * np.abs(want).max()
    got = np.asarray(forward_logits(params, jnp.asarray(ids[None]), config=config))[0]
    assert np.abs(got - want).max() < tol
    assert (got.argmax(-1) == want.argmax(-1)).all()
    # Each cap matters here: without it the logits and greedy tokens are others.
    for uncapped in ({"attn_softcap": None}, {"final_softcap": None}):
        if all(getattr(config, k) is None for k in uncapped):
            continue
        off = np.asarray(forward_logits(params, jnp.asarray(ids[None]), config=replace(config, **uncapped)))[0]
        assert np.abs(off - want).max() > 100 * tol, uncapped
    if config.attn_softcap is not None:  # (a final cap is monotone: it changes logprobs, not the greedy token)
        off = np.asarray(forward_logits(params, jnp.asarray(ids[None]), config=replace(config, attn_softcap=None)))[0]
        assert (off.argmax(-1) != want.argmax(-1)).any()
