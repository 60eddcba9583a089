"""The latency the P/D handoff adds: the same model, prefilled and decoded in one process vs through
`pdserve up` (coordinator + prefill worker + decode worker, KV over gRPC).

    python -m pdserve.benchmarks.kv.handoff [--model DIR] [--lengths 128,448] [--repeats 5] [--kv-streams 2]

One process: the prefill tier's jitted JAX prefill (the engine's bucket padding, batch 1) gives the
first token; its KV goes, as numpy, straight into the decode tier's `PagedKvCache`; one
`DecoderModel.decode` step (one torch thread) gives the second token. Disaggregated: `Generate` with max_tokens 2 through
the coordinator on 127.0.0.1 (1 prefill + 1 decode worker), timed at the client. TTFT is the time to the
first token; T2T the time to the second, the first one that needs the KV on the decode worker.
The disaggregated cluster runs twice in the same run: "before" with the handoff as it was before
layer-wise streaming (`--kv-layer-groups 1 --kv-streams 1`: the whole KV leaves after the whole
prefill, over one stream) and "after" with the defaults plus --kv-streams.
Every figure is the median of --repeats after a warm-up of the same length (compile excluded).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import numpy as np


def one_process(model_dir: Path, lengths: list[int], repeats: int) -> dict[int, tuple[float, float]]:
    """{length: (median TTFT s, median time to the second token s)} in this process."""
    import jax
    import jax.numpy as jnp
    import torch

    from pdserve.kvcache.layout import KvLayout
    from pdserve.server.decode.kv_cache import PagedKvCache
    from pdserve.server.decode.weights import build_model
    from pdserve.server.model.config import load_config
    from pdserve.server.model.weights import load_weights
    from pdserve.server.prefill.model import load_params, make_prefill_fn
    from pdserve.server.prefill.shapes import bucket_length

    # One torch thread: with two, each small step waits at OpenMP barriers for a core that JAX's threads
    # (or any other process) hold; measured here at ~110 ms vs ~1 ms a step for the tiny model.
    torch.set_num_threads(1)
    config = load_config(model_dir)
    weights = load_weights(model_dir)
    dtype = config.dtype if config.dtype in ("float32", "bfloat16") else "float32"
    params = load_params(config, weights, dtype=dtype)
    fn = make_prefill_fn(config)
    model = build_model(config, weights, dtype=getattr(torch, dtype))
    layout = KvLayout(config.num_layers, config.num_kv_heads, config.head_dim, block_size=16, dtype=dtype)
    out = {}
    for n in lengths:
        table = list(range(layout.num_blocks(n + 1)))
        cache = PagedKvCache(layout, len(table))
        ids = np.random.default_rng(n).integers(10, config.vocab_size, n)
        padded = np.zeros((1, bucket_length(n, config.max_model_len)), np.int32)
        padded[0, :n] = ids

        def run() -> tuple[float, float]:
            t0 = time.perf_counter()
            logits, k, v = fn(params, jnp.asarray(padded), jnp.asarray([n], jnp.int32))
            first = int(jnp.argmax(logits[0]))
            t1 = time.perf_counter()
            k_np, v_np = jax.device_get((k[:, 0, :n], v[:, 0, :n]))  # [L, n, Hkv, D]
            cache.write(table, 0, 0, np.asarray(k_np), np.asarray(v_np))
            pos = torch.tensor([n])
            model.decode(torch.tensor([first]), pos, torch.tensor([table]), pos + 1, cache).argmax(-1)
            return t1 - t0, time.perf_counter() - t0

        run()  # compile
        times = [run() for _ in range(repeats)]
        out[n] = (statistics.median(t[0] for t in times), statistics.median(t[1] for t in times))
    return out


async def _disaggregated(address: str, vocab: int, lengths: list[int], repeats: int) -> dict[int, tuple[float, float]]:
    from pdserve.benchmarks.clients import GrpcTarget
    from pdserve.server.plan.run_summary import RequestOutput
    from pdserve.server.plan.datasets import synthetic

    target = GrpcTarget(address, timeout=300)
    out = {}
    try:
        for n in lengths:
            reqs = synthetic(repeats + 1, input_len=n, output_len=2, vocab_size=vocab, seed=n)
            times = []
            for i, req in enumerate(reqs):  # one at a time; the first warms up (compiles this bucket)
                o = RequestOutput(group="handoff", prompt_len=n)
                await target.send(req, o)
                if not o.success or len(o.chunk_times) < 2:
                    raise RuntimeError(f"request failed: {o.error or o.chunk_tokens}")
                if i:
                    times.append((o.ttft, o.chunk_times[1] - o.sent))
            out[n] = (statistics.median(t[0] for t in times), statistics.median(t[1] for t in times))
    finally:
        await target.close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.benchmarks.kv.handoff", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="checkpoint (default: pdserve's embedded tiny model)")
    p.add_argument("--lengths", default="128,448")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--kv-layer-groups", type=int, default=4, help="the prefill workers' setting, after")
    p.add_argument("--kv-streams", type=int, default=2, help="the prefill workers' setting, after")
    args = p.parse_args(argv)
    from pdserve.server import launcher
    from pdserve.server.cli import default_model_dir
    from pdserve.server.model.config import load_config

    model = args.model or default_model_dir()
    lengths = [int(x) for x in args.lengths.split(",")]
    print(f"one process: {model.name}", file=sys.stderr, flush=True)
    local = one_process(model, lengths, args.repeats)
    variants = {"before": ["--kv-layer-groups", "1", "--kv-streams", "1"],
                "after": ["--kv-layer-groups", str(args.kv_layer_groups), "--kv-streams", str(args.kv_streams)]}
    remote = {}
    for name, prefill_args in variants.items():
        print(f"disaggregated, {name}: pdserve up (1 prefill + 1 decode worker) prefill {' '.join(prefill_args)}",
              file=sys.stderr, flush=True)
        cluster = launcher.launch(model, prefill_workers=1, decode_workers=1, port=0, host="127.0.0.1",
                                  prefill_args=prefill_args)
        try:
            remote[name] = asyncio.run(_disaggregated(cluster.coordinator.address, load_config(model).vocab_size,
                                                      lengths, args.repeats))
        finally:
            cluster.stop()
    print("| prompt tokens | handoff | TTFT one process (ms) | TTFT disaggregated (ms) | added (ms) | "
          "T2T one process (ms) | T2T disaggregated (ms) | added (ms) | T2T - TTFT one process (ms) | "
          "T2T - TTFT disaggregated (ms) |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n in lengths:
        for name in variants:
            (lt, l2), (rt, r2) = local[n], remote[name][n]
            print(f"| {n} | {name} | {lt * 1e3:.1f} | {rt * 1e3:.1f} | {(rt - lt) * 1e3:+.1f} | {l2 * 1e3:.1f} | "
                  f"{r2 * 1e3:.1f} | {(r2 - l2) * 1e3:+.1f} | {(l2 - lt) * 1e3:.1f} | {(r2 - rt) * 1e3:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
