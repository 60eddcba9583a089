"""The fused mixture-of-experts Triton kernels (`cuda_moe`) against the grouped loop they replace on CUDA
(`moe.MoeMlp`), run by Triton's interpreter on the CPU, on the experts of the tiny Mixtral and Qwen3-MoE
checkpoints: fp32, fp16, int8 and fp8 expert weights, batches of 1 and 5 tokens. bfloat16 is left to the GPU run
(`benchmarks/gpu.py`'s kernels stage): the interpreter's bf16 `tl.dot` is wrong on the CPU."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton is first imported

from pdserve.kvcache.layout import KvLayout
from pdserve.server.decode import cuda_moe
from pdserve.server.decode.kv_cache import PagedKvCache
from pdserve.server.decode.moe import route
from pdserve.server.decode.weights import build_model
from pdserve.server.model.config import load_config
from pdserve.server.model.weights import load_weights
from tests.decode.test_cuda_attention import needs_triton


def test_align_sorts_the_copies_by_expert_into_padded_blocks():
    """3 tokens' top-2 over 5 experts, blocks of 2 rows: expert 0 holds copies 0 and 4, expert 2 copies 1, 2, 5
    (and a pad row), expert 3 copy 3 (and a pad row); experts 1 and 4 no block; the last block is past them all.
    A pad row holds T k = 6, a block past the chosen ones the expert E = 5."""
    experts = torch.tensor([[0, 2], [2, 3], [0, 2]])
    copies, block_experts = cuda_moe.align(experts, num_experts=5, block_m=2)
    assert copies.tolist() == [0, 4, 1, 2, 5, 6, 3, 6, 6, 6]
    assert block_experts.tolist() == [0, 2, 2, 3, 5]
    assert cuda_moe.num_blocks(6, 5, 2) == 5
    one = cuda_moe.align(torch.tensor([[7, 1]]), num_experts=8, block_m=16)
    assert one[0].tolist() == [1] + [2] * 15 + [0] + [2] * 15 and one[1].tolist() == [1, 7]


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def checkpoint(request, tiny_model):
    path = tiny_model(request.param)
    return load_config(path), load_weights(path)


def _compare(mlp, x: torch.Tensor, tol: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's experts on x [T, d]: the grouped loop, then fused (the loop restored after) -> (loop, fused)."""
    with torch.inference_mode():
        want = mlp(x[None])[0]
        mlp.fuse()
        try:
            got = mlp(x[None])[0]
        finally:
            mlp.fused = None
    assert got.dtype == x.dtype and got.shape == x.shape
    err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
    assert err < tol, err
    return want, got


@needs_triton
@pytest.mark.parametrize("weight_format, dtype, tol", [
    (None, torch.float32, 1e-5), (None, torch.float16, 5e-3), ("int8", torch.float32, 1e-5),
    ("fp8", torch.float32, 1e-5),
])
@pytest.mark.parametrize("batch", [1, 5])
def test_fused_experts_compute_what_the_grouped_loop_does(checkpoint, weight_format, dtype, tol, batch):
    config, weights = checkpoint
    model = build_model(config, weights, dtype=dtype, weight_format=weight_format)
    mlp = model.layers[1].experts
    x = torch.randn(batch, config.hidden_size, generator=torch.Generator().manual_seed(batch)).to(dtype)
    _compare(mlp, x, tol)
    if weight_format is not None:
        assert mlp.gate_up[0].weight.dtype == {"int8": torch.int8, "fp8": torch.float8_e4m3fn}[weight_format]


@needs_triton
def test_experts_no_token_chose_are_not_read(checkpoint):
    """One token picks 2 of 8 experts: the other 6 hold NaN in the stacked weights, and the output is finite and
    the loop's."""
    config, weights = checkpoint
    mlp = build_model(config, weights).layers[0].experts
    x = torch.randn(1, config.hidden_size, generator=torch.Generator().manual_seed(9))
    with torch.inference_mode():
        want = mlp(x[None])[0]
        _, chosen = route(x @ mlp.router.T, mlp.moe)
        mlp.fuse()
        unchosen = [e for e in range(config.moe.num_experts) if e not in chosen[0].tolist()]
        assert len(unchosen) == config.moe.num_experts - 2
        mlp.fused.gate_up[unchosen] = float("nan")
        mlp.fused.down[unchosen] = float("nan")
        got = mlp(x[None])[0]
    assert not got.isnan().any()
    assert (got - want).abs().max().item() < 1e-5


def test_stacking_keeps_one_copy_of_the_weights(checkpoint):
    """After `fuse`, each expert's Linear holds a view of the stack: the loop reads the same memory."""
    config, weights = checkpoint
    mlp = build_model(config, weights, weight_format="int8").layers[0].experts
    mlp.fuse()
    stacked = mlp.fused
    assert stacked.gate_up.shape == (config.moe.num_experts, 2 * config.moe.intermediate_size, config.hidden_size)
    assert stacked.gate_up.dtype == torch.int8 and stacked.down_scale.shape == (config.moe.num_experts,
                                                                                 config.hidden_size, 1)
    for e in range(config.moe.num_experts):
        assert mlp.gate_up[e].weight.data_ptr() == stacked.gate_up[e].data_ptr()
        assert mlp.down[e].scale.data_ptr() == stacked.down_scale[e].data_ptr()


@needs_triton
def test_model_decode_through_the_fused_experts_matches_the_grouped_loop(checkpoint):
    """The whole model (every MoE layer fused): a prefill, then 2 decode steps of a batch of 2, against the loop's
    logits."""
    config, weights = checkpoint
    c = config
    layout = KvLayout(c.num_layers, c.num_kv_heads, c.head_dim, 4, "float32")
    prompts = [list(range(3, 12)), list(range(40, 45))]
    tables = torch.tensor([[0, 1, 2, 3], [5, 6, 7, 8]])
    logits = {}
    for fused in (False, True):
        model = build_model(config, weights)
        if fused:
            assert model.fuse_experts() == c.num_layers
        cache = PagedKvCache(layout, 10)
        for ids, table in zip(prompts, tables.tolist()):
            model.prefill(torch.tensor(ids), table, cache)
        positions = torch.tensor([len(p) for p in prompts])
        logits[fused] = torch.stack([model.decode(torch.tensor([100 + s, 7]), positions + s, tables,
                                                  positions + s + 1, cache) for s in range(2)])
    assert (logits[True] - logits[False]).abs().max().item() < 1e-4


@needs_triton
def test_the_start_up_probe_passes_where_the_kernels_run():
    ok, why = cuda_moe.runs(None, torch.float32, torch.device("cpu"))
    assert ok, why
