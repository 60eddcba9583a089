"""The LoRA BGMV Triton kernels (`cuda_lora`), run by Triton's interpreter on the CPU, against the torch path they
replace on CUDA (`cuda_lora.bgmv_torch`, two bmms over the gathered matrices): random stacks of odd ranks and
widths, decode rows (one token each) and a local prefill's row (many tokens), and the tiny llama's decode step
with three adapters and the base model mixed. bfloat16 is left to the GPU run (`benchmarks/gpu.py`'s kernels
stage)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton is first imported

from pdserve.kvcache.adapter_key import AdapterKey
from pdserve.kvcache.layout import KvLayout
from pdserve.server.decode import cuda_lora
from pdserve.server.decode.kv_cache import PagedKvCache
from pdserve.server.decode.lora import LoraRows, LoraSlots
from pdserve.server.decode.weights import build_model
from pdserve.server.model.config import load_config
from pdserve.server.model.weights import load_weights
from tests.decode.test_cuda_attention import needs_triton

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _stacks(slots: int, fan_in: int, rank: int, out: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(slots, fan_in, rank, generator=g) / fan_in**0.5
    b = torch.randn(slots, rank, out, generator=g) / rank**0.5
    a[0], b[0] = 0, 0  # slot 0: the base model's zeros
    return a.to(DEVICE, dtype), b.to(DEVICE, dtype)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("rows", "tokens", "fan_in", "rank", "out"), [
    (6, 1, 96, 48, 200),  # decode rows; a fused rank of 3 x 16; a ragged last output tile
    (5, 1, 600, 8, 64),  # three slices of the input (split-K), the last ragged; a rank tile smaller than BLOCK_R
    (1, 7, 64, 96, 72),  # a local prefill's row: 7 tokens reading one slot; two rank tiles
])
def test_bgmv_gives_the_torch_paths_sums(dtype, rows, tokens, fan_in, rank, out):
    a, b = _stacks(4, fan_in, rank, out, dtype, seed=rows * 1000 + rank)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(rows, tokens, fan_in, generator=g).to(DEVICE, dtype)
    y = torch.randn(rows, tokens, out, generator=g).to(DEVICE, dtype)
    slot = torch.tensor([3, 0, 1, 2, 0, 3][:rows] if rows > 1 else [2], device=DEVICE)
    got = cuda_lora.bgmv(x, y, slot, a, b)
    want = cuda_lora.bgmv_torch(x.float(), y.float(), slot, a.float(), b.float())
    assert got.dtype == dtype and got.shape == y.shape
    err = ((got.float() - want).abs().max() / want.abs().max()).item()
    assert err < (1e-5 if dtype == torch.float32 else 5e-3), err
    base = (slot == 0).nonzero().flatten()
    assert torch.equal(got[base], y[base])  # a base row: exactly y, A and B never read
    assert not torch.allclose(got[slot != 0].float(), y[slot != 0].float())


@needs_triton
def test_runs_accepts_the_kernels_here():
    ok, why = cuda_lora.runs(torch.float32, DEVICE)
    assert ok, why


def test_pick_gives_the_torch_path_off_cuda():
    assert cuda_lora.pick(torch.float32, torch.device("cpu")) == (None, "cpu runs the torch path")


@needs_triton
def test_a_mixed_decode_step_through_the_kernels_gives_the_torch_paths_logits(tiny_loras):
    """The tiny llama's decode step, rows of adapters ada, bob, cy and the base model, every fused matmul's delta
    through the kernels then through the torch path: the same greedy tokens, logits within fp32 rounding; the
    base row bit for bit the step's without adapters."""
    base, loras = tiny_loras
    config = load_config(base)
    model = build_model(config, load_weights(base))
    cache = PagedKvCache(KvLayout(config.num_layers, config.num_kv_heads, config.head_dim, 4, "float32"), 16)
    slots = LoraSlots(config, 3, 3, 16, torch.float32, torch.device("cpu"))
    keys = [AdapterKey(i + 1, name, str(path)) for i, (name, path) in enumerate(sorted(loras.items()))]
    torch_rows = slots.rows([slots.adapter(keys[0]), None, slots.adapter(keys[1]), slots.adapter(keys[2])])
    assert torch_rows.kernel is None and torch_rows.slot.tolist() == [1, 0, 2, 3]
    kernel_rows = LoraRows(torch_rows.slot, torch_rows.stacks, cuda_lora.bgmv)
    tokens, positions = torch.tensor([5, 6, 7, 8]), torch.zeros(4, dtype=torch.int64)
    tables = torch.arange(4)[:, None]
    with torch.inference_mode():
        want = model.decode(tokens, positions, tables, positions + 1, cache, torch_rows)
        got = model.decode(tokens, positions, tables, positions + 1, cache, kernel_rows)
        plain = model.decode(tokens, positions, tables, positions + 1, cache)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-4
    assert torch.equal(got[1], plain[1])


@needs_triton
def test_a_local_prefill_through_the_kernels_applies_its_adapter(tiny_loras):
    """One adapter alone (`LoraAdapter.rows`: a local prefill's 9 tokens) sits in slot 1 of its own stacks, slot 0
    the zeros, so the kernels (which skip slot 0) apply it: the logits the dense path gives, not the base model's."""
    base, loras = tiny_loras
    config = load_config(base)
    model = build_model(config, load_weights(base))
    cache = PagedKvCache(KvLayout(config.num_layers, config.num_kv_heads, config.head_dim, 4, "float32"), 16)
    slots = LoraSlots(config, 1, 1, 16, torch.float32, torch.device("cpu"))
    dense = slots.adapter(AdapterKey(1, "bob", str(loras["bob"]))).rows(torch.device("cpu"))
    assert dense.kernel is None and dense.slot.tolist() == [1]
    kernel = LoraRows(dense.slot, dense.stacks, cuda_lora.bgmv)
    ids = torch.tensor([11, 22, 33, 44, 55, 66, 77, 88, 99])
    with torch.inference_mode():
        want = model.prefill(ids, [0, 1, 2], cache, lora=dense)
        got = model.prefill(ids, [3, 4, 5], cache, lora=kernel)
        plain = model.prefill(ids, [6, 7, 8], cache)
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-4
    assert not torch.allclose(got, plain, atol=1e-3)
