"""The CUDA paged kernel's multi-query form (speculative decoding's verify step: k + 1 new tokens per sequence,
each masked at its own position) against the reference paged attention, run by Triton's interpreter on the CPU;
the model's verify step through it; and the CUDA-graph runner's verify input path. bfloat16 is left to the GPU
run (`benchmarks/gpu.py`'s kernels stage): the interpreter's bf16 `tl.dot` is wrong on the CPU."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton is first imported

from pdserve.kvcache.layout import KvLayout
from pdserve.server.decode.attention import PagedContext, paged_attention
from pdserve.server.decode.cuda_attention import paged_verify_attention
from pdserve.server.decode.kv_cache import PagedKvCache
from pdserve.server.decode.model_runner import CudaGraphRunner, EagerRunner
from tests.decode.test_cuda_attention import _filled_cache, _Replayed, needs_triton


def _verify_rows(new: int, proposals: list[int], lens: list[int]) -> torch.Tensor:
    """Positions [B, new] as the speculator lays them out: row i's last token then its proposals at consecutive
    positions ending at lens[i] - 1, pad entries repeating the last."""
    steps = torch.arange(new)
    return torch.stack([n - 1 - p + steps.clamp(max=p) for n, p in zip(lens, proposals)])


def _reference(q, cache: PagedKvCache, tables, lens, positions, window: int | None) -> torch.Tensor:
    context = PagedContext.build(positions, tables, lens, cache.block_size, q.device, q.dtype,
                                 groups=q.shape[2] // cache.layout.num_kv_heads, window=window)
    return paged_attention(q, cache, 0, context if window is None else context.local)


@needs_triton
@pytest.mark.parametrize("kv_dtype, q_dtype, new, window, splits, tol", [
    ("float32", torch.float32, 2, 0, 1, 1e-5),
    ("float32", torch.float32, 4, 0, 3, 1e-5),
    ("float32", torch.float32, 4, 7, 2, 1e-5),
    ("float32", torch.float32, 2, 30, 1, 1e-5),
    ("float16", torch.float16, 4, 0, None, 2e-3),
    ("int8", torch.float32, 2, 13, 2, 1e-5),
    ("int8", torch.float32, 4, 0, 1, 1e-5),
    ("fp8_e4m3", torch.float32, 4, 9, None, 1e-5),
    ("fp8_e4m3", torch.float32, 2, 0, 2, 1e-5),
])
def test_verify_kernel_matches_the_reference_and_reads_only_what_each_token_sees(kv_dtype, q_dtype, new, window,
                                                                                 splits, tol):
    """k = new - 1 proposals: rows of mixed lengths (a context of only its new tokens, part of a block, the whole
    table) and proposals (all k, none: pad entries, fewer), each new token attending up to its own position
    (through its window when given). Blocks past each context, and (windowed) wholly before its first token's
    window, hold NaN: nothing reads them."""
    cache = _filled_cache(kv_dtype)
    g = torch.Generator().manual_seed(new * 100 + window)
    lens = [new, 17, 40]
    proposals = [new - 1, 0, max(1, new - 2)]
    positions = _verify_rows(new, proposals, lens)
    q = torch.randn(3, new, 4, 32, generator=g).to(q_dtype)  # 4 query heads share 2 kv heads
    tables = torch.randperm(40, generator=g)[:30].view(3, 10)
    ctx = torch.tensor(lens)
    want = _reference(q, cache, tables, ctx, positions, window or None).float()
    bad = float("nan") if kv_dtype in ("float32", "float16") else 127
    for b, n in enumerate(lens):
        first_seen = max(0, int(positions[b, 0]) + 1 - window) if window else 0
        for stale in (tables[b, -(-n // 4):], tables[b, : first_seen // 4]):
            cache.k[0, stale] = cache.v[0, stale] = bad
            if cache.k_scales is not None:
                cache.k_scales[0, stale] = cache.v_scales[0, stale] = float("nan")
    scales = (None, None) if cache.k_scales is None else (cache.k_scales[0], cache.v_scales[0])
    got = paged_verify_attention(q, cache.k[0], cache.v[0], tables, ctx, positions, *scales, splits=splits,
                                 window=window)
    assert got.dtype == q_dtype and got.shape == (3, new, 4, 32)
    assert not got.isnan().any()
    assert (got.float() - want).abs().max().item() < tol


@needs_triton
def test_each_new_token_attends_only_up_to_its_own_position():
    """A later key's value changes every output after it and none before: the causal mask over the new tokens."""
    cache = _filled_cache("float32")
    q = torch.randn(1, 4, 4, 32, generator=torch.Generator().manual_seed(5))
    tables = torch.arange(10)[None]
    ctx = torch.tensor([30])
    positions = torch.tensor([[26, 27, 28, 29]])
    before = paged_verify_attention(q, cache.k[0], cache.v[0], tables, ctx, positions)
    cache.v[0, 7, 0] += 1.0  # position 28 (block 7, offset 0)
    after = paged_verify_attention(q, cache.k[0], cache.v[0], tables, ctx, positions)
    changed = (after - before).abs().amax(dim=(0, 2, 3))  # [4]
    assert changed[:2].max().item() == 0.0 and changed[2:].min().item() > 1e-3


@pytest.fixture(scope="module")
def llama(tiny_model):
    from pdserve.server.decode.weights import build_model
    from pdserve.server.model.config import load_config
    from pdserve.server.model.weights import load_weights

    path = tiny_model("llama")
    return build_model(load_config(path), load_weights(path))


def _verify_logits(model, layout: KvLayout, kernel: bool, prompts, tables, new: int, proposals) -> torch.Tensor:
    """The model's verify step (pad entries included) after each prompt's prefill -> logits [B, new, V]."""
    cache = PagedKvCache(layout, 40)
    for ids, table in zip(prompts, tables.tolist()):
        model.prefill(torch.tensor(ids), table, cache)
    lens = [len(p) + 1 + n for p, n in zip(prompts, proposals)]  # the last token, then its proposals, are new
    positions = _verify_rows(new, proposals, lens)
    tokens = (positions * 7 + 3) % model.config.vocab_size
    pad = torch.arange(new)[None] > torch.tensor(proposals)[:, None]
    model.paged_kernel = kernel
    try:
        return model.verify(tokens, positions, tables, torch.tensor(lens), cache, pad, pad_slot=39 * 4)
    finally:
        model.paged_kernel = False


@needs_triton
@pytest.mark.parametrize("kv_dtype, new", [("float32", 2), ("float32", 4), ("int8", 4), ("fp8_e4m3", 2)])
def test_model_verify_through_the_kernel_matches_the_reference(llama, kv_dtype, new):
    c = llama.config
    layout = KvLayout.of(c.num_layers, c.num_kv_heads, c.head_dim, 4, kv_dtype)
    prompts = [list(range(3, 12)), list(range(40, 45)), list(range(7, 30))]
    tables = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7], [10, 11, 12, 13, 13, 13, 13, 13], list(range(20, 28))])
    proposals = [new - 1, 0, 1]
    logits = {k: _verify_logits(llama, layout, k, prompts, tables, new, proposals) for k in (False, True)}
    live = torch.arange(new)[None] <= torch.tensor(proposals)[:, None]  # pad entries' logits mean nothing
    assert (logits[True] - logits[False])[live].abs().max().item() < 1e-4


@needs_triton
@pytest.mark.parametrize("family", ["mistral-windowed", "gemma2"])
def test_windowed_model_verify_through_the_kernel_matches_the_reference_past_the_window(tiny_model, family):
    from pdserve.server.decode.weights import build_model
    from pdserve.server.model.config import load_config
    from pdserve.server.model.tiny import WINDOW
    from pdserve.server.model.weights import load_weights

    path = tiny_model(family)
    model = build_model(load_config(path), load_weights(path))
    c = model.config
    layout = KvLayout(c.num_layers, c.num_kv_heads, c.head_dim, 4, "float32")
    prompts = [list(range(3, 3 + WINDOW + 9)), list(range(40, 46))]
    tables = torch.tensor([list(range(0, 12)), list(range(12, 24))])
    logits = {k: _verify_logits(model, layout, k, prompts, tables, 4, [3, 2]) for k in (False, True)}
    live = torch.arange(4)[None] <= torch.tensor([3, 2])[:, None]
    assert (logits[True] - logits[False])[live].abs().max().item() < 1e-4


class _InterpretedVerifyRunner(CudaGraphRunner):
    """`CudaGraphRunner` whose graphs are `_Replayed` calls on the CPU: what runs is the runner's own verify input
    path (VerifyInputs filled, padded, uploaded; its views into the model) through the kernel, interpreted."""

    def _capture(self, bucket: int, pool) -> _Replayed:
        raise RuntimeError("this test captures verify graphs only")

    def _capture_verify(self, bucket: int, new: int, pool) -> _Replayed:
        tokens, positions, tables, lens, pad = self.verify_inputs.views(bucket, new)
        run = lambda: self.model.verify(tokens, positions, tables, lens, self.cache, pad, self.pad_slot)  # noqa: E731
        run()  # the warm-up the real capture runs (twice there), on the rows as they are before any step
        self.verify_outputs[(bucket, new)] = run()
        return _Replayed(lambda: self.verify_outputs[(bucket, new)].copy_(run()))


@needs_triton
def test_graph_runner_verify_input_path_through_the_kernel_matches_eager(llama):
    """What verify graphs replay on the GPU, on the CPU: 3 sequences in bucket 4 (a pad row; the one bucket here, to
    keep the interpreter's time down), k = 3 (graphs for 2, 3 and 4 new tokens), tables as wide as the graphs',
    strided column views; steps of 4 and then 2 new tokens
    (pad entries in both) give the logits eager verify steps give (kernel and reference), and the capture's
    warm-up on pad rows wrote only into the pad block. int8 KV (scales beside the blocks); the other dtypes go
    through the same path, checked above."""
    c = llama.config
    layout = KvLayout.of(c.num_layers, c.num_kv_heads, c.head_dim, 4, "int8")
    prompts = [list(range(3, 12)), list(range(40, 45)), list(range(7, 20))]
    tables = [[0, 1, 2, 14], [5, 6, 15], [8, 9, 10, 11, 13]]
    pad_block = 16
    width = max(map(len, tables))
    padded = torch.tensor([t + [t[0]] * (width - len(t)) for t in tables])
    steps = [(4, [3, 0, 2]), (2, [1, 1, 0])]  # (new tokens, each row's proposals)
    logits = {}
    for path in ("graphs", "eager kernel", "eager reference"):
        cache = PagedKvCache(layout, pad_block + 1)
        for ids, table in zip(prompts, tables):
            llama.prefill(torch.tensor(ids), table, cache)
        llama.paged_kernel = path != "eager reference"
        try:
            if path == "graphs":
                before = cache.k.clone(), cache.v.clone()
                runner = _InterpretedVerifyRunner(llama, cache, max_batch=4, max_blocks=6, pad_block=pad_block,
                                                  buckets=(4,), verify_new=4)
                assert runner.capture_verify() == [] and sorted(runner.verify_graphs) == [(4, 2), (4, 3), (4, 4)]
                assert runner.verify_kind(3, 4, width) == "graphs" and runner.verify_kind(3, 4, 7) == "eager"
                assert runner.verify_kind(3, 5, width) == "eager"  # more new tokens than the graphs'
                for held, now in zip(before, (cache.k, cache.v)):
                    assert torch.equal(held[:, :pad_block].float(), now[:, :pad_block].float())
                verify = runner.verify
            else:
                verify = EagerRunner(llama, cache).verify
            done = [len(p) for p in prompts]
            out = []
            for new, proposals in steps:
                lens = [n + 1 + p for n, p in zip(done, proposals)]
                positions = _verify_rows(new, proposals, lens)
                tokens = (positions * 5 + 1) % c.vocab_size
                pad = torch.arange(new)[None] > torch.tensor(proposals)[:, None]
                live = ~pad
                out.append(verify(tokens, positions, padded, torch.tensor(lens), pad, pad_block * 4)[live].clone())
                done = [n + 1 for n in done]  # one token accepted per row, the rest rejected (rewritten next step)
        finally:
            llama.paged_kernel = False
        logits[path] = torch.cat(out)  # [live entries, V]
        if path == "graphs":
            assert runner.verify_steps == {"graphs": 2, "eager": 0}
    assert (logits["graphs"] - logits["eager kernel"]).abs().max().item() < 1e-5
    assert (logits["graphs"] - logits["eager reference"]).abs().max().item() < 1e-4


@needs_triton
async def test_the_engine_verifies_through_its_runner_graphs_and_the_kernel(tiny_model):
    """The native engine with n-gram speculation (k = 3), its verify steps replayed by the graph runner (interpreted
    graphs) through the paged kernel, proposals the reference's own tokens with some corrupted: greedy tokens equal
    speculation off on the reference path."""
    from tests.decode.test_spec_engine import _admit, _drain, _engine, _greedy, _oracle, _reference

    path = tiny_model("llama")
    prompt = [3, 14, 15, 92, 65, 35, 89]
    want = await _reference(path, prompt, _greedy(10))
    engine = _engine(path, num_blocks=16, k=3)
    model = engine.model
    runner = _InterpretedVerifyRunner(model, engine.cache, max_batch=1, max_blocks=8, pad_block=16, verify_new=4)
    assert runner.verify_buckets == (1,) and runner.verify_new == (2, 3, 4)
    model.paged_kernel = True
    try:
        assert runner.capture_verify() == []
        engine.speculator.runner = runner
        _oracle(engine, prompt, want)
        seq = await _admit(engine, "a", prompt, _greedy(10))
        got = [seq.output_ids[0], *await _drain(seq)]
    finally:
        model.paged_kernel = False
        await engine.close()
    assert got == want
    assert runner.verify_steps["graphs"] > 0 and runner.verify_steps["eager"] == 0
