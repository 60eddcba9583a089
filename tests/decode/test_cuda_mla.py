"""The CUDA absorbed-MLA decode kernel (`cuda_mla`) against the reference, run here by Triton's interpreter on
the CPU, and the DeepSeek model's decode steps through it against the reference path (float32; bfloat16 is
left to the GPU run of benchmarks/gpu.py: the interpreter's bf16 `tl.dot` is wrong on the CPU)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton is first imported

from pdserve.kvcache.layout import KvLayout
from pdserve.server.decode.cuda_attention import have_triton
from pdserve.server.decode.cuda_mla import paged_mla_decode, reference_mla_decode, self_check
from pdserve.server.decode.kv_cache import PagedKvCache

needs_triton = pytest.mark.skipif(not have_triton(), reason="triton is not installed here (pip install triton); "
                                  "the GPU run of benchmarks/gpu.py checks the kernel on CUDA")


def _expanded(q_nope, q_rope, latents, keys, w_uk, w_uv, scale):
    """Attention as transformers computes it, heads expanded: k = [latent W_UK^T, key], v = latent W_UV^T,
    one sequence: q_nope [H, nope], q_rope [H, R], latents [T, C], keys [T, R] -> [H, V]."""
    k_nope = torch.einsum("tc,hnc->htn", latents, w_uk)  # [H, T, nope]
    v = torch.einsum("tc,hvc->htv", latents, w_uv)  # [H, T, V]
    scores = torch.einsum("hn,htn->ht", q_nope, k_nope) + q_rope @ keys.T  # [H, T]
    return torch.einsum("ht,htv->hv", torch.softmax(scores * scale, -1), v)


@needs_triton
@pytest.mark.parametrize("C, R, H, kv_dtype, splits", [
    (32, 16, 4, "float32", 1), (32, 16, 4, "float32", 3), (48, 8, 5, "float32", 2), (32, 16, 4, "int8", 2),
    (32, 16, 4, "fp8_e4m3", 1),
])
def test_absorbed_kernel_equals_expanded_attention(C, R, H, kv_dtype, splits):
    """The kernel over the cache (W_UK folded into the query, W_UV after) equals attention with expanded heads over
    the dequantized cache's entries; C and R not powers of two, a head count not either."""
    nope, V, bs = 8, 12, 4
    g = torch.Generator().manual_seed(0)
    cache = PagedKvCache(KvLayout.of(1, 1, C + R, bs, kv_dtype, kind="mla_latent"), 24)
    entries = torch.randn(24 * bs, 1, C + R, generator=g)
    cache.store(0, torch.arange(24 * bs), entries, entries[..., :0])
    tables = torch.randperm(24, generator=g)[:18].view(3, 6)
    lens = torch.tensor([1, 10, 24])
    q_nope, q_rope = torch.randn(3, H, nope, generator=g), torch.randn(3, H, R, generator=g)
    w_uk, w_uv = torch.randn(H, nope, C, generator=g) / 4, torch.randn(H, V, C, generator=g) / 4
    q_latent = torch.einsum("bhn,hnc->bhc", q_nope, w_uk)
    scales = None if cache.k_scales is None else cache.k_scales[0]
    got = paged_mla_decode(q_latent, q_rope, cache.k[0], tables, lens, 0.2, scales, splits=splits)  # [B, H, C]
    assert got.shape == (3, H, C) and got.dtype == torch.float32
    got = torch.einsum("bhc,hvc->bhv", got, w_uv)
    for b, n in enumerate(lens.tolist()):
        blocks = tables[b, : -(-n // bs)]
        stored = cache.k[0, blocks, :, 0].float()
        if scales is not None:
            stored = stored * scales[blocks].float()[:, :, None]
        stored = stored.reshape(-1, C + R)[:n]
        want = _expanded(q_nope[b], q_rope[b], stored[:, :C], stored[:, C:], w_uk, w_uv, 0.2)
        torch.testing.assert_close(got[b], want, atol=1e-4, rtol=1e-4)


@needs_triton
def test_the_kernel_reads_no_block_past_the_context():
    g = torch.Generator().manual_seed(1)
    entries = torch.randn(12, 4, 1, 48, generator=g)
    tables, lens = torch.arange(12).view(2, 6), torch.tensor([5, 9])
    q_latent, q_rope = torch.randn(2, 4, 32, generator=g), torch.randn(2, 4, 16, generator=g)
    want = paged_mla_decode(q_latent, q_rope, entries, tables, lens, 0.3)
    entries[2:6] = entries[9:] = float("nan")  # past each context
    got = paged_mla_decode(q_latent, q_rope, entries, tables, lens, 0.3, splits=2)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, reference_mla_decode(q_latent, q_rope, entries, tables, lens, 0.3), atol=1e-5,
                               rtol=1e-5)


@needs_triton
def test_the_start_up_self_check_passes_on_deepseek_shapes():
    assert self_check(4, 32, 16, 4, torch.float32, torch.float32, torch.device("cpu")) is None
    assert self_check(16, 512, 64, 16, torch.float32, torch.int8, torch.device("cpu")) is None  # V2-Lite's
    assert "failed on this device" in self_check(4, 32, 16, 3, torch.float32, torch.float32, torch.device("cpu"))


@needs_triton
@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2"])
def test_model_decode_through_the_kernel_matches_the_reference(tiny_model, family):
    """A DeepSeek model's decode steps with `paged_kernel` (what runs on CUDA) against the reference path."""
    from pdserve.server.decode.weights import build_model
    from pdserve.server.model.config import load_config
    from pdserve.server.model.weights import load_weights

    path = tiny_model(family)
    config = load_config(path)
    model = build_model(config, load_weights(path))
    layout = KvLayout.for_model(config, 4, "float32")
    prompts = [list(range(3, 12)), list(range(40, 45))]
    tables = torch.tensor([[0, 1, 2, 3, 12, 12], [5, 6, 12, 12, 12, 12]])
    logits = {}
    for kernel in (False, True):
        cache = PagedKvCache(layout, 13)
        for ids, table in zip(prompts, tables.tolist()):
            model.prefill(torch.tensor(ids), table, cache)
        model.paged_kernel = kernel
        try:
            positions = torch.tensor([len(p) for p in prompts])
            steps = [model.decode(torch.tensor([100 + step, 7]), positions + step, tables, positions + step + 1,
                                  cache) for step in range(3)]
        finally:
            model.paged_kernel = False
        logits[kernel] = torch.stack(steps)  # [3, B, V]
    assert (logits[True] - logits[False]).abs().max().item() < 1e-4
    assert torch.equal(logits[True].argmax(-1), logits[False].argmax(-1))
