"""Sliding-window models on the decode tier against transformers (a windowed Mistral; Gemma 2 and 3, whose
local and global layers alternate): prompts shorter and longer than the window, prefilled in chunks on this
tier, then decoded step by step past it; and the same steps through the Triton kernel."""

from __future__ import annotations

import os

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

TOL = 1e-4
NEW_TOKENS = 20
BLOCK = 4


@pytest.fixture(scope="module", params=["mistral-windowed", "gemma2", "gemma3"])
def models(request, tiny_model):
    path = tiny_model(request.param)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return hf, build_model(load_config(path), load_weights(path))


@pytest.mark.parametrize("prompt_len", [WINDOW - 10, WINDOW + 9, 3 * WINDOW])
def test_decode_past_the_window_matches_transformers(models, prompt_len):
    hf, model = models
    c = model.config
    assert [layer.window for layer in model.layers] == list(c.layer_windows) and WINDOW in c.layer_windows
    prompt = torch.randint(0, c.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(prompt_len))
    total = prompt_len + NEW_TOKENS
    table = torch.randperm(64, generator=torch.Generator().manual_seed(0))[: -(-total // BLOCK)].tolist()
    cache = PagedKvCache(KvLayout(c.num_layers, c.num_kv_heads, c.head_dim, BLOCK, "float32"), 64)
    logits = []
    chunk = 16  # chunks of the prompt read the earlier ones' KV through the window
    for start in range(0, prompt_len, chunk):
        out = model.prefill(prompt[start : start + chunk], table, cache, start_pos=start)
        logits.append(out[-1])
    tokens = [int(logits[-1].argmax())]
    step_logits = []
    for step in range(NEW_TOKENS - 1):
        position = prompt_len + step
        out = model.decode(torch.tensor([tokens[-1]]), torch.tensor([position]), torch.tensor([table]),
                           torch.tensor([position + 1]), cache)[0]
        step_logits.append(out)
        tokens.append(int(out.argmax()))
    want = hf.generate(prompt[None], attention_mask=torch.ones(1, prompt_len, dtype=torch.int64), do_sample=False,
                       max_new_tokens=NEW_TOKENS)[0, prompt_len:].tolist()
    assert tokens == want
    with torch.no_grad():
        full = hf(torch.tensor([prompt.tolist() + tokens])).logits[0]  # [P + N, V]
    assert (logits[-1] - full[prompt_len - 1]).abs().max() < TOL
    for step, out in enumerate(step_logits):
        assert (out - full[prompt_len + step]).abs().max() < TOL, step


@needs_triton
def test_decode_through_the_cuda_kernel_equals_the_reference_past_the_window(models):
    """The windowed model's decode step through the Triton paged kernel (interpreted on the CPU) against the
    reference path, two rows longer than the window."""
    _, model = models
    c = model.config
    layout = KvLayout(c.num_layers, c.num_kv_heads, c.head_dim, BLOCK, "float32")
    prompts = [list(range(3, 3 + WINDOW + 13)), list(range(40, 40 + 2 * WINDOW))]
    tables = torch.tensor([list(range(0, 16)), list(range(16, 32))])
    logits = {}
    for kernel in (False, True):
        cache = PagedKvCache(layout, 32)
        for ids, table in zip(prompts, tables.tolist()):
            model.prefill(torch.tensor(ids), table, cache)
        model.paged_kernel = kernel
        try:
            positions = torch.tensor([len(p) for p in prompts])
            steps = [model.decode(torch.tensor([100 + step, 7]), positions + step, tables, positions + step + 1, cache)
                     for step in range(3)]
        finally:
            model.paged_kernel = False
        logits[kernel] = torch.stack(steps)  # [3, B, V]
    assert (logits[True] - logits[False]).abs().max().item() < 1e-4
