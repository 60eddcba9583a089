"""The CUDA paged-attention kernel against the reference paged attention (`attention.paged_attention`), run
here by Triton's interpreter on the CPU. bfloat16 is left to the GPU run (`benchmarks/gpu.py`, its
correctness section): the interpreter's bf16 `tl.dot` is wrong on the CPU."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton is first imported

from pdserve.kvcache.layout import KvLayout
from pdserve.server.decode.attention import PagedContext, paged_attention
from pdserve.server.decode.cuda_attention import have_triton, num_splits, paged_decode_attention
from pdserve.server.decode.kv_cache import PagedKvCache
from pdserve.server.decode.model_runner import CudaGraphRunner, EagerRunner

needs_triton = pytest.mark.skipif(not have_triton(), reason="triton is not installed here (pip install triton); "
                                  "the GPU run of benchmarks/gpu.py checks the kernel on CUDA")


def test_splits_follow_the_shapes_alone():
    # 256 programs wanted: batch 1 x 8 kv heads -> 32 splits, no more than the 64-token tiles of the table.
    assert num_splits(1, 8, 256, 16) == 32
    assert num_splits(1, 8, 4, 16) == 1  # a 64-token table is one tile
    assert num_splits(64, 8, 256, 16) == 1  # 512 programs already
    assert num_splits(4, 8, 256, 16) == 8
    assert num_splits(2, 2, 10, 4) == 1  # 40 tokens: one tile
    assert num_splits(1, 1, 4096, 16) == 64  # 256 wanted, capped for the combining kernel


def _reference(q, cache: PagedKvCache, tables: torch.Tensor, lens: torch.Tensor, window: int | None = None
               ) -> torch.Tensor:
    """The reference paged attention (`attention.paged_attention`) of one new token per row at its context's
    last position (through a sliding window, when given): q [B, H, D] -> [B, H, D]."""
    context = PagedContext.build((lens - 1)[:, None], tables, lens, cache.block_size, q.device, q.dtype,
                                 groups=q.shape[1] // cache.layout.num_kv_heads, window=window)
    return paged_attention(q[:, None], cache, 0, context if window is None else context.local)[:, 0]


def _filled_cache(dtype: str, num_blocks: int = 40, block_size: int = 4) -> PagedKvCache:
    cache = PagedKvCache(KvLayout.of(1, 2, 32, block_size, dtype), num_blocks)
    g = torch.Generator().manual_seed(1)
    k = torch.randn(num_blocks * block_size, 2, 32, generator=g)
    v = torch.randn(num_blocks * block_size, 2, 32, generator=g)
    slots = torch.arange(num_blocks * block_size)
    cache.store(0, slots, k, v)  # quantizes per block for int8/fp8
    return cache


@needs_triton
@pytest.mark.parametrize("kv_dtype, q_dtype, splits, tol", [
    ("float32", torch.float32, 1, 1e-5),
    ("float32", torch.float32, 3, 1e-5),
    ("float16", torch.float16, None, 2e-3),
    ("int8", torch.float32, 2, 1e-5),
    ("fp8_e4m3", torch.float32, 1, 1e-5),
])
def test_kernel_matches_the_reference(kv_dtype, q_dtype, splits, tol):
    cache = _filled_cache(kv_dtype)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(3, 4, 32, generator=g).to(q_dtype)  # 4 query heads share 2 kv heads
    tables = torch.randperm(40, generator=g)[:30].view(3, 10)  # scattered blocks
    lens = torch.tensor([1, 17, 40])  # one token, part of a block, the whole table
    got = paged_decode_attention(q, cache.k[0], cache.v[0], tables, lens,
                                 None if cache.k_scales is None else cache.k_scales[0],
                                 None if cache.v_scales is None else cache.v_scales[0], splits=splits)
    assert got.dtype == q_dtype and got.shape == (3, 4, 32)
    assert (got.float() - _reference(q, cache, tables, lens).float()).abs().max().item() < tol


@needs_triton
def test_kernel_reads_no_block_past_the_context():
    """Blocks beyond each context hold NaN and the table past it points at them: nothing changes."""
    cache = _filled_cache("float32")
    q = torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(3))
    tables = torch.arange(20).view(2, 10)
    lens = torch.tensor([5, 9])  # blocks 0-1 and 10-12 hold the contexts
    expected = paged_decode_attention(q, cache.k[0], cache.v[0], tables, lens)
    for b, used in ((0, 2), (1, 3)):
        cache.k[0, tables[b, used:]] = float("nan")
        cache.v[0, tables[b, used:]] = float("nan")
    got = paged_decode_attention(q, cache.k[0], cache.v[0], tables, lens, splits=2)
    assert torch.equal(got, expected) or (got - expected).abs().max().item() < 1e-6
    assert not got.isnan().any()


@needs_triton
@pytest.mark.parametrize("kv_dtype, window, splits", [
    ("float32", 1, 1), ("float32", 7, 1), ("float32", 30, 3), ("float32", 100, 2), ("int8", 13, 2),
])
def test_windowed_kernel_matches_the_reference_and_reads_only_the_window(kv_dtype, window, splits):
    """A sliding window: the kernel walks only the tiles of each row's last `window` tokens (blocks wholly
    before it hold NaN) and equals the reference's windowed view."""
    cache = _filled_cache(kv_dtype, num_blocks=40, block_size=4)
    g = torch.Generator().manual_seed(4)
    q = torch.randn(3, 4, 32, generator=g)
    tables = torch.randperm(40, generator=g)[:30].view(3, 10)
    lens = torch.tensor([1, 17, 40])
    want = _reference(q, cache, tables, lens, window)
    for b, n in enumerate(lens.tolist()):
        stale = tables[b, : max(0, n - window) // 4]
        cache.k[0, stale] = cache.v[0, stale] = float("nan") if kv_dtype == "float32" else 127
        if cache.k_scales is not None:
            cache.k_scales[0, stale] = cache.v_scales[0, stale] = float("nan")
    got = paged_decode_attention(q, cache.k[0], cache.v[0], tables, lens,
                                 None if cache.k_scales is None else cache.k_scales[0],
                                 None if cache.v_scales is None else cache.v_scales[0], splits=splits, window=window)
    assert not got.isnan().any()
    assert (got - want).abs().max().item() < 1e-5


@pytest.fixture(scope="module")
def llama(tiny_model):
    from pdserve.server.decode.weights import build_model
    from pdserve.server.model.config import load_config
    from pdserve.server.model.weights import load_weights

    path = tiny_model("llama")
    return build_model(load_config(path), load_weights(path))


@needs_triton
@pytest.mark.parametrize("kv_dtype, tol", [("float32", 1e-4), ("int8", 1e-4)])
def test_model_decode_through_the_kernel_matches_the_reference(llama, kv_dtype, tol):
    """The model's decode step with `paged_kernel` (what runs on CUDA, block tables as wide as a CUDA graph's)
    against the reference path, fp32 and int8 KV."""
    c = llama.config
    layout = KvLayout.of(c.num_layers, c.num_kv_heads, c.head_dim, 4, kv_dtype)
    prompts = [list(range(3, 12)), list(range(40, 45))]
    tables = torch.tensor([[0, 1, 2, 3, 12, 12], [5, 6, 12, 12, 12, 12]])  # padded with the pad block 12
    logits = {}
    for kernel in (False, True):
        cache = PagedKvCache(layout, 13)
        for ids, table in zip(prompts, tables.tolist()):
            llama.prefill(torch.tensor(ids), table, cache)
        llama.paged_kernel = kernel
        try:
            positions = torch.tensor([len(p) for p in prompts])
            steps = []
            for step in range(3):  # three tokens: the kernel path stores each new token itself
                steps.append(llama.decode(torch.tensor([100 + step, 7]), positions + step, tables,
                                          positions + step + 1, cache))
        finally:
            llama.paged_kernel = False
        logits[kernel] = torch.stack(steps)  # [3, B, V]
    assert (logits[True] - logits[False]).abs().max().item() < tol


@needs_triton
def test_kernel_reads_strided_lengths_and_table_rows():
    """The CUDA-graph runner's inputs are column views of one [rows, 3 + M] buffer (`GraphInputs.views`): the
    lengths a column of stride 3 + M, the tables' rows strided too. The kernel reads them through their strides:
    the same result as contiguous copies, bit for bit."""
    cache = _filled_cache("float32")
    g = torch.Generator().manual_seed(4)
    q = torch.randn(3, 4, 32, generator=g)
    buffer = torch.zeros(3, 3 + 10, dtype=torch.int64)  # [R, 3 + M] as GraphInputs holds it
    buffer[:, 3:] = torch.randperm(40, generator=g)[:30].view(3, 10)
    buffer[:, 2] = torch.tensor([1, 17, 40])
    tables, lens = buffer[:, 3:], buffer[:, 2]
    assert lens.stride() == (13,) and tables.stride() == (13, 1)
    got = paged_decode_attention(q, cache.k[0], cache.v[0], tables, lens, splits=2)
    expected = paged_decode_attention(q, cache.k[0], cache.v[0], tables.contiguous(), lens.contiguous(), splits=2)
    assert torch.equal(got, expected)
    with pytest.raises(ValueError, match="contiguous rows"):
        paged_decode_attention(q, cache.k[0], cache.v[0], tables.t().contiguous().t(), lens)


class _Replayed:
    """Stands in for a captured CUDA graph on the CPU: replaying reruns the captured call on the same persistent
    input buffers (`GraphInputs.device`) into the same output buffer."""

    def __init__(self, step):
        self.step = step

    def replay(self) -> None:
        with torch.inference_mode():  # the output buffer was made under it, by the model's decode
            self.step()

    def pool(self) -> None:
        return None


class _InterpretedGraphRunner(CudaGraphRunner):
    """`CudaGraphRunner` with each bucket's graph a `_Replayed` call: what runs is the runner's own input path
    (GraphInputs filled, padded, uploaded; its views into the model) through the paged kernel, interpreted."""

    def _capture(self, bucket: int, pool) -> _Replayed:
        views = self.inputs.views(bucket)
        for _ in range(2):  # the warm-up the real capture runs, on the rows as they are before any step
            self.model.decode(*views, self.cache)
        self.outputs[bucket] = self.model.decode(*views, self.cache)
        return _Replayed(lambda: self.outputs[bucket].copy_(self.model.decode(*views, self.cache)))


@needs_triton
@pytest.mark.parametrize("kv_dtype", ["float32", "int8", "fp8_e4m3"])
def test_graph_runner_input_path_through_the_kernel_matches_eager(llama, kv_dtype):
    """What CUDA graphs replay on the GPU, on the CPU: 3 sequences in bucket 4 (a pad row), tables as wide as
    the graphs' (6 blocks, the pad block past each context), lengths a strided column, `paged_kernel` on;
    3 steps give the logits eager steps give (kernel and reference path), and the capture's warm-up on
    pad rows wrote only into the pad block, no NaN."""
    c = llama.config
    layout = KvLayout.of(c.num_layers, c.num_kv_heads, c.head_dim, 4, kv_dtype)
    prompts = [list(range(3, 12)), list(range(40, 45)), list(range(7, 20))]
    tables = [[0, 1, 2, 14], [5, 6, 15], [8, 9, 10, 11, 13]]  # room for the 3 steps
    pad = 16
    positions = torch.tensor([len(p) for p in prompts])
    width = max(map(len, tables))
    padded = torch.tensor([t + [t[0]] * (width - len(t)) for t in tables])  # as the engine pads (own blocks)
    logits = {}
    for path in ("graphs", "eager kernel", "eager reference"):
        cache = PagedKvCache(layout, pad + 1)
        for ids, table in zip(prompts, tables):
            llama.prefill(torch.tensor(ids), table, cache)
        llama.paged_kernel = path != "eager reference"
        try:
            if path == "graphs":
                before = cache.k.clone(), cache.v.clone()
                runner = _InterpretedGraphRunner(llama, cache, max_batch=4, max_blocks=6, pad_block=pad)
                assert runner.capture() == [] and runner.buckets == (1, 2, 4)
                assert runner.kind(3, width) == "graphs" and runner.kind(3, 7) == "eager"
                # the warm-up (pad rows: token 0 at position 0 of the pad block, context 1) wrote the pad block only
                for held, now in zip(before, (cache.k, cache.v)):
                    assert torch.equal(held[:, :pad].float(), now[:, :pad].float())
                    assert not now[:, pad].float().isnan().any()
                if cache.k_scales is not None:
                    assert not cache.k_scales.isnan().any() and not cache.v_scales.isnan().any()
                decode = runner.decode
            else:
                decode = EagerRunner(llama, cache).decode
            steps = [decode(torch.tensor([100 + s, 7, 50]), positions + s, padded, positions + s + 1).clone()
                     for s in range(3)]
        finally:
            llama.paged_kernel = False
        logits[path] = torch.stack(steps)  # [3, B, V]
    assert (logits["graphs"] - logits["eager kernel"]).abs().max().item() < 1e-5
    assert (logits["graphs"] - logits["eager reference"]).abs().max().item() < 1e-4
