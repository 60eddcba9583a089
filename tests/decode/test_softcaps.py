"""Gemma's soft-caps on the decode tier against transformers: Gemma 2's defaults where config.json omits them
(50 on the scores, 30 on the logits) and Gemma 3's final_logit_softcapping, prefilled in chunks and decoded
past the window, on the reference path and through the Triton kernel (interpreted on the CPU)."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
import transformers

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton is first imported

from pdserve.kvcache.layout import KvLayout
from pdserve.server.decode.kv_cache import PagedKvCache
from pdserve.server.decode.weights import build_model
from pdserve.server.model.config import load_config
from pdserve.server.model.tiny import WINDOW
from pdserve.server.model.weights import load_weights
from tests.decode.test_cuda_attention import needs_triton

TOL = 5e-5
"""Relative to the largest logit: these reach ~25, through scores 16 times the usual (fp32 rounding grows too)."""
NEW_TOKENS = 12
BLOCK = 4
CAPS = {"gemma2-defaults": (50.0, 30.0), "gemma3-softcapped": (None, 15.0)}


@pytest.fixture(scope="module", params=list(CAPS))
def models(request, tiny_model):
    path = tiny_model(request.param)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    config, weights = load_config(path), load_weights(path)
    uncapped = build_model(replace(config, attn_softcap=None, final_softcap=None), weights)
    return request.param, hf, build_model(config, weights), uncapped


def _run(model, prompt: torch.Tensor, kernel: bool = False) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and the logits of the last prompt position and of every decode step."""
    c = model.config
    total = len(prompt) + NEW_TOKENS
    table = torch.randperm(64, generator=torch.Generator().manual_seed(0))[: -(-total // BLOCK)].tolist()
    cache = PagedKvCache(KvLayout(c.num_layers, c.num_kv_heads, c.head_dim, BLOCK, "float32"), 64)
    for start in range(0, len(prompt), 16):
        last = model.prefill(prompt[start : start + 16], table, cache, start_pos=start)[-1]
    logits, tokens = [last], [int(last.argmax())]
    model.paged_kernel = kernel
    try:
        for step in range(NEW_TOKENS - 1):
            position = len(prompt) + step
            out = model.decode(torch.tensor([tokens[-1]]), torch.tensor([position]), torch.tensor([table]),
                               torch.tensor([position + 1]), cache)[0]
            logits.append(out)
            tokens.append(int(out.argmax()))
    finally:
        model.paged_kernel = False
    return tokens, logits


def test_greedy_decode_equals_transformers_only_with_the_caps(models):
    name, hf, model, uncapped_model = models
    c = model.config
    assert (c.attn_softcap, c.final_softcap) == CAPS[name]
    prompt = torch.randint(0, c.vocab_size, (WINDOW + 9,), generator=torch.Generator().manual_seed(3))
    tokens, logits = _run(model, prompt)
    want = hf.generate(prompt[None], attention_mask=torch.ones(1, len(prompt), dtype=torch.int64), do_sample=False,
                       max_new_tokens=NEW_TOKENS)[0, len(prompt):].tolist()
    assert tokens == want
    with torch.no_grad():
        full = hf(torch.tensor([prompt.tolist() + tokens])).logits[0, len(prompt) - 1 : -1]  # [N, V]
    tol = TOL * full.abs().max().item()
    assert (torch.stack(logits) - full).abs().max().item() < tol
    _, off = _run(uncapped_model, prompt)  # the caps matter here: uncapped, the logits are others
    assert (off[0] - full[0]).abs().max().item() > 100 * tol


@needs_triton
def test_decode_through_the_cuda_kernel_equals_the_reference(models):
    _, _, model, _ = models
    prompt = torch.randint(0, model.config.vocab_size, (WINDOW + 9,), generator=torch.Generator().manual_seed(4))
    (tokens, logits), (kernel_tokens, kernel_logits) = _run(model, prompt), _run(model, prompt, kernel=True)
    assert kernel_tokens == tokens
    assert (torch.stack(kernel_logits) - torch.stack(logits)).abs().max().item() < TOL * 30
