"""The decode tier's device-agnostic parts of running on a GPU, on the CPU: the device and size flags, the
cache sized from memory, the CUDA-graph runner's buckets and padded inputs.
The graphs themselves, pinned copies and the fp8/int8 kernels run in `python -m pdserve.benchmarks.gpu`
(its correctness section) on a CUDA device."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from pdserve.kvcache.layout import KvLayout
from pdserve.server.decode import cuda_linear
from pdserve.server.decode.config import DecodeConfig
from pdserve.server.decode.device import (cpu_cache_blocks, gpu_cache_blocks, parse_bytes, parse_device,
                                          resolve_device)
from pdserve.server.decode.kv_cache import PagedKvCache
from pdserve.server.decode.startup import build_native_engine as build_engine
from pdserve.server.decode.model_runner import BUCKETS, CudaGraphRunner, EagerRunner, GraphInputs, bucket_for
from pdserve.server.decode.weights import build_model
from pdserve.server.model.config import load_config
from pdserve.server.model.weights import load_weights

LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=32, block_size=16, dtype="float32")  # 8 KiB a block


def test_device_and_size_flags():
    assert [parse_device(d) for d in ("auto", "cpu", "cuda", "cuda:1")] == ["auto", "cpu", "cuda", "cuda:1"]
    with pytest.raises(ValueError, match="--device takes auto, cpu, cuda or cuda:N, not 'gpu'"):
        parse_device("gpu")
    assert resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert resolve_device("auto") == torch.device("cpu")
        with pytest.raises(ValueError, match="torch sees no CUDA device here"):
            resolve_device("cuda:0")
    assert [parse_bytes(s) for s in ("4GiB", "512MiB", "1.5g", "1000", "2KB")] == [4 * 2**30, 512 * 2**20,
                                                                                   3 * 2**29, 1000, 2000]
    with pytest.raises(ValueError, match="--kv-cache-memory takes a positive size"):
        DecodeConfig(model_dir=Path("m"), kv_cache_memory="lots")
    with pytest.raises(ValueError, match="--device takes"):
        DecodeConfig(model_dir=Path("m"), device="tpu")
    assert DecodeConfig(model_dir=Path("m")).num_blocks is None  # sized from memory at start
    assert DecodeConfig(model_dir=Path("m"), kv_cache_tokens=100).num_blocks == 7


def test_cache_sized_from_a_byte_budget_or_the_device_memory():
    assert PagedKvCache.bytes_per_block(LAYOUT) == 2 * 2 * 2 * 32 * 4 * 16 == 16384
    # CPU: 1 MiB holds 64 blocks; at most 4 sequences of 100 tokens (7 blocks each) can use 28.
    assert cpu_cache_blocks(2**20, LAYOUT, max_running=64, max_model_len=4096) == 64
    assert cpu_cache_blocks(2**20, LAYOUT, max_running=4, max_model_len=100) == 28
    with pytest.raises(ValueError, match="holds no 16384-byte block"):
        cpu_cache_blocks(1000, LAYOUT, 4, 100)
    # CUDA, vLLM's rule: 0.9 x 10 MiB - 5 MiB peak - 1 MiB outside torch = 3 MiB = 192 blocks.
    total = 10 * 2**20
    budget = int(total * 0.9) - 5 * 2**20 - 2**20
    assert gpu_cache_blocks(total, 0.9, 5 * 2**20, 2**20, LAYOUT) == budget // 16384 == 192
    assert gpu_cache_blocks(total, 0.9, 5 * 2**20, 2**20, LAYOUT, reserved_blocks=1) == 191
    with pytest.raises(ValueError, match="raise --gpu-memory-utilization"):
        gpu_cache_blocks(total, 0.5, 5 * 2**20, 2**20, LAYOUT)


def test_engine_built_without_kv_cache_tokens_takes_the_budget(tiny_model):
    path = tiny_model("llama")
    _, engine, _ = build_engine(DecodeConfig(model_dir=path, device="cpu", kv_cache_memory="1MiB", max_running=4))
    # the tiny llama: 2 layers x 2 kv heads x 32 x fp32 = 16 KiB a block; 1 MiB is 64, 4 x max_model_len more
    assert engine.pool.num_total == 64 and engine.cache.num_blocks == 64
    assert engine.cache.device == torch.device("cpu") and isinstance(engine.runner, EagerRunner)
    _, engine, _ = build_engine(DecodeConfig(model_dir=path, device="cpu", kv_cache_tokens=100))
    assert engine.pool.num_total == 7


def test_buckets_pad_to_the_next_power_of_two():
    assert BUCKETS == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    assert [bucket_for(b) for b in (1, 2, 3, 5, 64, 65, 256, 257)] == [1, 2, 4, 8, 64, 128, 256, None]


def test_step_inputs_pad_rows_into_the_pad_block():
    inputs = GraphInputs(rows=4, max_blocks=5, pad_block=99, device=torch.device("cpu"))
    inputs.fill(4, torch.tensor([11, 12, 13]), torch.tensor([20, 3, 40]), torch.tensor([[1, 2], [3, 3], [5, 6]]),
                torch.tensor([21, 4, 41]))
    inputs.upload(4)
    tokens, positions, tables, lens = inputs.views(4)
    assert tokens.tolist() == [11, 12, 13, 0] and positions.tolist() == [20, 3, 40, 0]
    assert lens.tolist() == [21, 4, 41, 1]
    assert tables.tolist() == [[1, 2, 99, 99, 99], [3, 3, 99, 99, 99], [5, 6, 99, 99, 99], [99] * 5]
    inputs.fill(2, torch.tensor([7]), torch.tensor([1]), torch.tensor([[8]]), torch.tensor([2]))  # a smaller step
    inputs.upload(2)
    assert inputs.views(2)[2].tolist() == [[8, 99, 99, 99, 99], [99] * 5]


@pytest.fixture(scope="module")
def llama(tiny_model):
    path = tiny_model("llama")
    return build_model(load_config(path), load_weights(path))


def test_a_padded_batch_gives_the_batch_its_own_logits(llama):
    """What a graph replays: the bucket's rows (3 sequences + 1 pad row writing into the pad block) give the
    3 sequences the logits an unpadded step gives, and the pad row writes nowhere else."""
    c = llama.config
    layout = KvLayout(c.num_layers, c.num_kv_heads, c.head_dim, 4, "float32")
    cache = PagedKvCache(layout, 13)  # 12 blocks + the pad block 12
    prompts = [list(range(3, 12)), list(range(40, 45)), list(range(7, 20))]
    tables = [[0, 1, 2], [5, 6], [8, 9, 10, 11]]
    for ids, table in zip(prompts, tables):
        llama.prefill(torch.tensor(ids), table, cache)
    tokens = torch.tensor([100, 101, 102])
    positions = torch.tensor([len(p) for p in prompts])
    width = max(map(len, tables))
    padded = torch.tensor([t + [t[0]] * (width - len(t)) for t in tables])
    before = cache.k.clone()
    eager = llama.decode(tokens, positions, padded, positions + 1, cache)  # [3, V]
    after_eager = cache.k.clone()
    cache.k.copy_(before)
    inputs = GraphInputs(rows=4, max_blocks=5, pad_block=12, device=torch.device("cpu"))
    inputs.fill(4, tokens, positions, padded, positions + 1)
    inputs.upload(4)
    t, p, tb, lens = inputs.views(4)
    replayed = llama.decode(t, p, tb, lens, cache)  # [4, V]
    assert torch.allclose(replayed[:3], eager, atol=1e-5, rtol=0)
    # The sequences' blocks get the same writes, up to the last bits a 3-row and a 4-row matmul may round
    # differently (AVX2's kernels do; AMX's happen not to); what neither step wrote is untouched, bit for bit.
    torch.testing.assert_close(cache.k[:, :12], after_eager[:, :12], atol=1e-5, rtol=0)
    untouched = after_eager[:, :12] == before[:, :12]
    assert torch.equal(cache.k[:, :12][untouched], before[:, :12][untouched])
    assert not torch.equal(cache.k[:, 12], before[:, 12])  # the pad row wrote into the pad block


def test_quantized_weights_on_the_cpu_say_they_save_memory_only(tiny_model):
    path = tiny_model("llama")
    model = build_model(load_config(path), load_weights(path), weight_format="fp8")
    assert model.weight_kernel == "fp8 weights dequantized per matmul on cpu: the format saves memory only"
    assert cuda_linear.pick("int8", torch.bfloat16, torch.device("cpu")) is None
    assert all(layer.wqkv.kernel is None for layer in model.layers)


def test_config_fields_reach_the_cli():
    names = {f.name for f in dataclasses.fields(DecodeConfig)}
    assert {"device", "kv_cache_memory", "enforce_eager", "gpu_memory_utilization"} <= names


class _Replay:
    """Stands in for a captured CUDA graph on the CPU: replay recomputes the step from the persistent inputs."""

    def __init__(self, step):
        self.replay = step


class _CpuGraphRunner(CudaGraphRunner):
    def capture(self) -> None:
        for bucket in self.buckets:
            self.outputs[bucket] = torch.empty(bucket, self.model.config.vocab_size)
            views = self.inputs.views(bucket)
            self.graphs[bucket] = _Replay(lambda b=bucket, v=views: self.outputs[b].copy_(
                self.model.decode(*v, self.cache)))


def test_graph_runner_pads_to_its_bucket_and_falls_back_to_eager(llama):
    """The runner's bookkeeping, graphs stood in for by eager replays of the same persistent buffers: a batch
    of 3 replays bucket 4 and gets its 3 rows; one wider than the graphs' tables, or larger than the largest
    bucket, runs eagerly."""
    c = llama.config
    layout = KvLayout(c.num_layers, c.num_kv_heads, c.head_dim, 4, "float32")
    cache = PagedKvCache(layout, 17)  # 16 blocks + the pad block 16
    runner = _CpuGraphRunner(llama, cache, max_batch=4, max_blocks=3, pad_block=16)
    runner.capture()
    assert runner.buckets == (1, 2, 4)
    replays = []
    for bucket, graph in runner.graphs.items():
        step = graph.replay
        graph.replay = lambda b=bucket, f=step: (replays.append(b), f())
    for ids, table in zip([list(range(3, 9)), list(range(20, 25)), list(range(30, 40))], [[0, 1], [4, 5], [8, 9, 10]]):
        llama.prefill(torch.tensor(ids), table, cache)
    tokens, positions = torch.tensor([1, 2, 3]), torch.tensor([6, 5, 10])
    tables = torch.tensor([[0, 1, 0], [4, 5, 4], [8, 9, 10]])
    snapshot = (cache.k.clone(), cache.v.clone())
    expected = EagerRunner(llama, cache).decode(tokens, positions, tables, positions + 1)
    cache.k.copy_(snapshot[0])
    cache.v.copy_(snapshot[1])
    got = runner.decode(tokens, positions, tables, positions + 1)
    assert replays == [4] and got.shape == (3, c.vocab_size)
    assert torch.allclose(got, expected, atol=1e-5, rtol=0)
    wide = torch.tensor([[0, 1, 0, 0]])  # 4 columns: wider than the graphs' 3
    runner.decode(torch.tensor([1]), torch.tensor([6]), wide, torch.tensor([7]))
    assert replays == [4]
    many = torch.zeros(5, 1, dtype=torch.int64)  # 5 rows: more than the largest bucket
    runner.decode(torch.zeros(5, dtype=torch.int64), torch.zeros(5, dtype=torch.int64), many,
                  torch.ones(5, dtype=torch.int64))
    assert replays == [4]
    runner.decode(tokens[:1], positions[:1], tables[:1, :2], positions[:1] + 1)
    assert replays == [4, 1]


def test_the_flags_parse_without_torch():
    """`pdserve up` and the coordinator build their parsers from DecodeConfig where torch is not installed."""
    import subprocess
    import sys

    code = "import sys, pdserve.server.cli, pdserve.server.decode.config; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
