"""Decode speed through the served engine for `benchmarks/gpu.py`: the `DecodeEngine` the worker runs,
started by the worker's own `startup.engine_for_model`, fed as the worker is fed (requests added, their
prompt KV written through `engine.write` as the receiver writes it, then started), timed by the tokens
one request streams.

Ceilings measured in the same run: the weight-streaming floor (every matmul weight read once by a
CUDA-graphed chain of batch-1 matmuls, the lm head included) and the read bandwidth it implies; a step's
roofline is (weights + KV bytes it reads) / that bandwidth.
"""

from __future__ import annotations

import asyncio
import gc
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


@dataclass
class Point:
    batch: int
    context: int
    step_s: float
    weight_bytes: int
    kv_bytes: float  # per step, mean over the timed steps
    ingest_gbps: float  # received KV through engine.write onto the device (pinned staging included)
    runner: str = "eager"
    """How the point's steps ran: "graphs" (every one replayed a CUDA graph), "eager", or "mixed (G graphs, E eager)"."""

    @property
    def tokens_per_s(self) -> float:
        return self.batch / self.step_s


def random_model(config, dtype: torch.dtype, device: torch.device):
    """A DecoderModel of the config with random weights made on the device (no checkpoint to read)."""
    from pdserve.server.decode.model import DecoderModel

    model = DecoderModel(config, dtype, device)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name == "inv_freq":
                continue
            if "norm" in name:  # norm weights, qk_norm's [H + Hkv, D] included
                buf.fill_(1.0)
            elif buf.dim() >= 2:
                buf.normal_(0.0, 0.02, generator=g)
            else:
                buf.zero_()  # biases
    return model.eval()


def matmul_weights(model) -> list[torch.Tensor]:
    """Every weight a decode step streams: the layers' linears (quantized bytes where quantized) and the lm head."""
    from pdserve.server.decode.quant import Linear

    return [m.weight for m in model.modules() if isinstance(m, Linear)] + [model.lm_head]


def weight_bytes(model) -> int:
    from pdserve.server.decode.quant import Linear

    scales = sum(m.scale.nbytes for m in model.modules() if isinstance(m, Linear) and m.scale is not None)
    return sum(w.nbytes for w in matmul_weights(model)) + scales


def streaming_floor(model, repeats: int) -> float:
    """Seconds to read every matmul weight once: batch-1 matmuls over them, one after another (a CUDA graph
    on CUDA), best of `repeats`. Float weights only (the bf16 model)."""
    weights = matmul_weights(model)
    device = weights[0].device
    xs = {w.shape[1]: torch.zeros(1, w.shape[1], dtype=w.dtype, device=device) for w in weights}

    def chain():
        for w in weights:
            F.linear(xs[w.shape[1]], w)

    if device.type != "cuda":
        return _best(chain, repeats)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chain()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    return _best(graph.replay, repeats, torch.cuda.synchronize)


def _best(fn, repeats: int, sync=lambda: None) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t)
    return best


async def run_point(engine, batch: int, context: int, warmup: int, steps: int, kv: tuple[np.ndarray, np.ndarray],
                    seed: int, log) -> Point:
    """`batch` requests of `context`-token prompts, their KV written as received, decoded together; the mean
    step over `steps` steps after `warmup`."""
    from pdserve.kvcache.codec import KvPiece
    from pdserve.v1 import generation_pb2 as gen_pb
    from pdserve.v1 import worker_pb2 as pb

    rng = np.random.default_rng(seed)
    vocab = engine.model.config.vocab_size
    sampling = gen_pb.SamplingParams(max_tokens=warmup + steps + 1, temperature=0.0, ignore_eos=True)
    seqs = [engine.add(pb.DecodeRequest(request_id=f"B{batch}-C{context}-{i}", sampling=sampling,
                                        prompt_token_ids=rng.integers(0, vocab, context).tolist()))
            for i in range(batch)]
    await asyncio.gather(*(s.admitted for s in seqs))
    k, v = kv[0][:, :context], kv[1][:, :context]  # [L, T, Hkv, D]
    loop = asyncio.get_running_loop()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:  # as the receiver's write threads do
        await asyncio.gather(*(loop.run_in_executor(pool, engine.write, s.request_id, KvPiece(0, 0, k, v, None, None))
                               for s in seqs))
    if engine.cache.device.type == "cuda":
        torch.cuda.synchronize()
    ingest_s = time.perf_counter() - t0
    before = dict(engine.runner.steps)
    for s in seqs:
        engine.start(s, 1)
    times = []
    while (ids := await seqs[0].events.get()) is not None:
        times.extend([time.perf_counter()] * len(ids))
    for s in seqs[1:]:
        while await s.events.get() is not None:
            pass
    step_s = (times[warmup + steps - 1] - times[warmup - 1]) / steps
    graphs, eager = (engine.runner.steps[k] - before[k] for k in ("graphs", "eager"))
    runner = "graphs" if not eager else "eager" if not graphs else f"mixed ({graphs} graphs, {eager} eager)"
    layout = engine.layout
    kv_bytes = np.mean([batch * (context + 1 + warmup + s) * layout.bytes_per_token for s in range(steps)])
    point = Point(batch, context, step_s, weight_bytes(engine.model), float(kv_bytes),
                  2 * k.nbytes * batch / ingest_s / 1e9, runner)
    log(f"decode B={batch} ctx={context}: {step_s * 1e3:.2f} ms/step, {point.tokens_per_s:.1f} tok/s ({runner}); "
        f"KV in at {point.ingest_gbps:.1f} GB/s")
    return point


def random_kv(config, max_context: int, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """K and V [L, T, Hkv, D] in the cache's dtype (one array shared by every request: values do not change
    a step's cost)."""
    import ml_dtypes

    rng = np.random.default_rng(1)
    shape = (config.num_layers, max_context, config.num_kv_heads, config.head_dim)
    np_dtype = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32, "float16": np.float16}[dtype]
    base = rng.standard_normal((1, max_context, config.num_kv_heads, config.head_dim), dtype=np.float32) * 0.5
    k = np.broadcast_to(base.astype(np_dtype), shape).copy()
    return k, k.copy()


def free(engine) -> None:
    """Drop an engine's cache and graphs before the next one allocates."""
    engine.runner = None
    engine.cache = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def kernels_per_step(engine) -> tuple[int, float]:
    """(CUDA kernels one eager batch-1 decode step launches, their summed device time in ms): how much of a
    step is small kernels between the matmuls (norms, RoPE, activations), what fusing them would win."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from pdserve.server.decode.model_runner import EagerRunner

    runner = EagerRunner(engine.model, engine.cache)
    one = torch.zeros(1, dtype=torch.int64)
    args = (one, one, one[:, None], one + 1)  # token 0 at position 0 of block 0 (no sequence holds it now)
    runner.decode(*args)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        runner.decode(*args)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    return len(kernels), sum(e.device_time for e in kernels) / 1e3
