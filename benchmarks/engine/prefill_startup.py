"""A prefill worker's start-up, first start against the next: are its programs served from JAX's persistent cache?

    .venv/bin/python -m pdserve.benchmarks.engine.prefill_startup --starts 2 --core 1

Each start is a fresh child process pinned to --core that loads the served engine (`load_engine`, every start-up
program compiled before it returns, as `--compile-before-serving all`) with its compilation cache in one fresh
directory shared by the starts, and reports its seconds (wall and CPU), the matmul path chosen, and JAX's
compilation events: programs compiled by XLA and programs read from the cache (a program calling a Python
callback is compiled at every start: JAX does not write it to the cache). The first start fills the cache; a second
start whose programs all come from the cache compiles nothing. Run it with another checkout's PYTHONPATH (its path,
`python benchmarks/engine/prefill_startup.py`) for that code's figures.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pdserve.server.cache_dir import cache_dir


BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
"""One per program built: compiled by XLA, or read from the persistent cache."""
CACHE_HITS = "/jax/compilation_cache/cache_hits"


def child(model: Path, max_model_len: int, compile_cache: Path) -> dict:
    """In this (pinned) process: one start of the engine, timed, with the cache's events counted."""
    import jax

    events: collections.Counter = collections.Counter()
    jax.monitoring.register_event_listener(lambda name, **kw: events.update([name]))
    jax.monitoring.register_event_duration_secs_listener(lambda name, secs, **kw: events.update([name]))
    from pdserve.server.prefill.config import PrefillConfig
    from pdserve.server.prefill.main import load_engine

    t0, c0 = time.perf_counter(), time.process_time()
    config = PrefillConfig(model_dir=model, max_model_len=max_model_len, compilation_cache=compile_cache)
    engine = load_engine(config, progress=False)
    return {"start_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0,
            "programs": len(engine.compiling.jobs), "matmul": engine.matmul_path.split(" (")[0],
            "compiled": events[BACKEND_COMPILE] - events[CACHE_HITS], "from_cache": events[CACHE_HITS]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, help="checkpoint dir (default: make the Qwen2.5-0.5B-shaped bf16 one)")
    p.add_argument("--starts", type=int, default=2)
    p.add_argument("--core", type=int, default=1)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--child", type=Path, help=argparse.SUPPRESS)  # a start, with this compilation cache
    args = p.parse_args(argv)
    if args.model is None:
        from pdserve.benchmarks.checkpoint import make_qwen25_05b_shape

        args.model = make_qwen25_05b_shape(cache_dir() / "models" / "qwen2.5-0.5b-shape-random-bfloat16", "bfloat16")
    if args.child:
        print(json.dumps(child(args.model, args.max_model_len, args.child)))
        return 0
    rows = []
    with tempfile.TemporaryDirectory(prefix="prefill-startup-") as compile_cache:
        for start in range(1, args.starts + 1):
            print(f"== start {start} of {args.starts} on core {args.core} (compilation cache {compile_cache}) ...",
                  file=sys.stderr, flush=True)
            cmd = ["taskset", "-c", str(args.core), sys.executable, str(Path(__file__).resolve()), "--model",
                   str(args.model), "--max-model-len", str(args.max_model_len), "--child", compile_cache]
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=os.environ)
            if proc.returncode:
                print(f"start {start} failed (exit {proc.returncode}); its log is above", file=sys.stderr)
                return 1
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    print("| start | matmul path | programs compiled | programs from the cache | start-up s (wall) | CPU s |")
    print("|---|---|---|---|---|---|")
    for i, r in enumerate(rows, 1):
        print(f"| {i} | {r['matmul']} | {r['compiled']} | {r['from_cache']} | {r['start_s']:.1f} | {r['cpu_s']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
