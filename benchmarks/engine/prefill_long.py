"""Long prompts on the prefill engine: peak host memory and time vs prompt length, whole and chunked.

    .venv/bin/python -m pdserve.benchmarks.engine.prefill_long --lengths 2048,4096,8192,16384 --chunk 2048

The model: Qwen2.5-0.5B's shape with --layers layers (random weights), run in float32 on the CPU.
Each (length, chunk) point runs in its own process: the engine loads, compiles the step shapes the
prompt needs (untimed), then prefills one prompt of that length through `PrefillEngine.submit`.
Reported: seconds, the peak RSS above the RSS just before the prompt (sampled every 5 ms,
benchmarks/engine/prefill.py's PeakRss), and that peak per 1k tokens (flat or falling when memory is linear
in the length). For scale, the score matrix the old whole-matrix attention built, fp32 [Hq, S, S] per
layer, is printed beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from pdserve.server.cache_dir import cache_dir


def measure(model_dir: str, length: int, chunk: int) -> dict:
    """In this process: the peak RSS growth and seconds of one `length`-token prefill in chunks of `chunk`."""
    import numpy as np

    from pdserve.benchmarks.engine.prefill import PeakRss
    from pdserve.v1 import generation_pb2 as gen_pb
    from pdserve.server.model.config import load_config
    from pdserve.server.model.weights import load_weights
    from pdserve.server.prefill.config import PrefillConfig
    from pdserve.server.prefill.engine import PrefillEngine
    from pdserve.server.prefill.step_packing import StepShape
    from pdserve.server.prefill.model import load_params

    config = load_config(model_dir)
    engine = PrefillEngine(config, load_params(config, load_weights(model_dir), dtype="float32"),
                           PrefillConfig(model_dir=Path(model_dir), max_batch_tokens=chunk, max_prefill_chunk=chunk,
                                         prefix_cache_bytes=0, kv_layer_groups=1))
    contexts = sorted({next(b for b in engine.context_buckets if b >= start) for start in range(0, length, chunk)})
    print(f"  {length} tokens in chunks of {chunk}: compiling {len(contexts)} step shapes ...", file=sys.stderr,
          flush=True)
    engine.warmup(shapes=[StepShape(chunk, c) for c in contexts])
    prompt = [int(t) for t in np.random.default_rng(0).integers(10, config.vocab_size, length)]
    greedy = gen_pb.SamplingParams(max_tokens=1, temperature=0.0, top_p=1.0)

    async def run():
        return await engine.submit(prompt, greedy, 0, "float32")

    t0 = time.perf_counter()
    with PeakRss() as rss:  # sampled every 5 ms: the compiles' own peak (before) does not mask it
        result = asyncio.run(run())
    seconds = time.perf_counter() - t0
    assert result.k.shape[1] == length
    return {"length": length, "chunk": chunk, "seconds": seconds, "peak_mib": (rss.peak - rss.start) / 2**20,
            "baseline_mib": rss.start / 2**20, "kv_mib": (result.k.nbytes + result.v.nbytes) / 2**20,
            "num_heads": config.num_heads, "num_layers": config.num_layers}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="prefill_long", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="checkpoint dir (default: Qwen2.5-0.5B's shape, --layers layers)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lengths", default="2048,4096,8192,16384")
    p.add_argument("--chunk", type=int, default=2048, help="--max-prefill-chunk (and the step's token budget)")
    p.add_argument("--whole-up-to", type=int, default=8192, help="also run prompts up to this long unchunked")
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: MODEL:LENGTH:CHUNK, measured in this process
    args = p.parse_args(argv)
    if args.one:
        model, length, chunk = args.one.rsplit(":", 2)
        print(json.dumps(measure(model, int(length), int(chunk))))
        return 0
    from pdserve.benchmarks.checkpoint import make_qwen25_05b_shape

    cache = cache_dir()
    model = args.model or make_qwen25_05b_shape(
        cache / "models" / f"qwen2.5-0.5b-shape-random-bfloat16-{args.layers}l", num_hidden_layers=args.layers)
    points = []
    for n in (int(x) for x in args.lengths.split(",")):
        if n <= args.whole_up_to:
            points.append((n, n))
        if n > args.chunk:
            points.append((n, args.chunk))
    rows = []
    for n, chunk in points:
        print(f"== {n} tokens, chunks of {chunk} ...", file=sys.stderr, flush=True)
        out = subprocess.run([sys.executable, "-m", "pdserve.benchmarks.engine.prefill_long", "--one", f"{model}:{n}:{chunk}"],
                             capture_output=True, text=True)
        if out.returncode:
            print(out.stderr[-3000:], file=sys.stderr)
            rows.append({"length": n, "chunk": chunk, "error": out.stderr.strip().splitlines()[-1]})
            continue
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"load average {os.getloadavg()[0]:.1f} (timings are from this machine as loaded)")
    print(f"{'tokens':>7} {'chunk':>6} {'seconds':>8} {'peak MiB':>9} {'MiB/1k tok':>10} {'KV MiB':>7} "
          f"{'S x S scores MiB/layer (old)':>29}")
    for r in rows:
        if "error" in r:
            print(f"{r['length']:>7} {r['chunk']:>6} failed: {r['error']}")
            continue
        old = r["num_heads"] * r["length"] ** 2 * 4 / 2**20
        print(f"{r['length']:>7} {r['chunk']:>6} {r['seconds']:>8.1f} {r['peak_mib']:>9.0f} "
              f"{r['peak_mib'] / r['length'] * 1024:>10.1f} {r['kv_mib']:>7.0f} {old:>29.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
