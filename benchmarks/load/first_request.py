"""A prefill worker's first requests right after it reports ready, while the rest of its start-up programs
compile in the background (issue 40 item 5): their TTFT, the event loop's longest stall meanwhile, and the
same prompts' TTFT once every program is compiled.

One process, the engine as `pdserve prefill` loads it (`load_engine(serving=True)`), a compile cache of its
own (cold unless `--compile-cache-dir` names a warm one). The load, one after another, starting at ready:
1. `first`: a prompt of --prompt-tokens (a turn whose first --prefix-tokens are a system prompt nobody sent yet);
2. `second turn`: another prompt of the same length opening with the same system prompt (its prefix KV cached:
   the steps read context);
3. --probes short prompts (256 tokens) back to back, each timed: the step gaps while the background compiles;
then, once every program is compiled, the same three kinds again on fresh tokens (`*_warm`).

    python -m pdserve.benchmarks.first_request --model DIR --prompt-tokens 2048 --prefix-tokens 1024

Prints one JSON line. Run it on the code before and after a change (the same flags, one after the other) and
compare ratios: timings on a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np


def _parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="first_request", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--prefix-tokens", type=int, default=1024, help="the system prompt both turns open with")
    p.add_argument("--probes", type=int, default=8, help="short prompts timed back to back after the turns")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--max-prefill-chunk", type=int, help="chunked prefill: even the first prompt's later chunks "
                                                         "read context (default: the token budget)")
    p.add_argument("--compile-cache-dir", type=Path, help="JAX's compile cache (default: a fresh, empty one)")
    return p.parse_args(argv)


async def _ttft(engine, tokens: list[int]) -> float:
    from pdserve.v1 import generation_pb2 as gen_pb

    t0 = time.perf_counter()
    job = engine.enqueue(tokens, gen_pb.SamplingParams(max_tokens=1, temperature=0.0), 0, "float32")
    await job.first_token
    ttft = time.perf_counter() - t0
    while await job.kv.get() is not None:  # the KV leaves before the next prompt is timed
        pass
    return ttft


async def _load(engine, rng: np.random.Generator, args: argparse.Namespace) -> dict[str, float | list[float]]:
    vocab = engine.vocab_size
    system = rng.integers(3, vocab, args.prefix_tokens).tolist()
    rest = args.prompt_tokens - args.prefix_tokens
    first = await _ttft(engine, system + rng.integers(3, vocab, rest).tolist())
    second = await _ttft(engine, system + rng.integers(3, vocab, rest).tolist())
    probes = [await _ttft(engine, rng.integers(3, vocab, 256).tolist()) for _ in range(args.probes)]
    return {"first": first, "second_turn": second, "probes": probes}


async def _lag(stop: asyncio.Event, worst: list[float]) -> None:
    """The event loop's longest late wake-up (a 5 ms sleep's excess) until `stop`."""
    while not stop.is_set():
        t0 = time.perf_counter()
        await asyncio.sleep(0.005)
        worst[0] = max(worst[0], time.perf_counter() - t0 - 0.005)


async def _run(engine, args: argparse.Namespace) -> dict:
    rng = np.random.default_rng(0)
    stop, worst = asyncio.Event(), [0.0]
    ticker = asyncio.create_task(_lag(stop, worst))
    cold = await _load(engine, rng, args)
    pending_after = engine.compiling.pending if engine.compiling is not None else 0
    t0 = time.perf_counter()
    if engine.compiling is not None:
        await asyncio.to_thread(engine.compiling.finished.wait, 3600)
    stop.set()
    await ticker
    rest_s = time.perf_counter() - t0
    warm = await _load(engine, np.random.default_rng(1), args)  # fresh tokens: nothing cached but the new system prompt
    return {
        "ttft_first_s": round(cold["first"], 3), "ttft_second_turn_s": round(cold["second_turn"], 3),
        "probe_ttft_median_s": round(statistics.median(cold["probes"]), 4),
        "probe_ttft_max_s": round(max(cold["probes"]), 4),
        "ttft_first_warm_s": round(warm["first"], 3), "ttft_second_turn_warm_s": round(warm["second_turn"], 3),
        "probe_ttft_median_warm_s": round(statistics.median(warm["probes"]), 4),
        "probe_ttft_max_warm_s": round(max(warm["probes"]), 4),
        "loop_lag_max_s": round(worst[0], 4), "programs_pending_after_load": pending_after,
        "rest_compiled_after_load_s": round(rest_s, 1),
    }


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    import logging

    from prometheus_client import REGISTRY

    from pdserve.server import metrics
    from pdserve.server.prefill.config import PrefillConfig
    from pdserve.server.prefill.main import load_engine

    logging.basicConfig(level=logging.WARNING)
    cache = args.compile_cache_dir or Path(tempfile.mkdtemp(prefix="first-request-jax-cache-"))
    config = PrefillConfig(model_dir=args.model, max_model_len=args.max_model_len,
                           max_batch_size=args.max_batch_size, max_prefill_chunk=args.max_prefill_chunk,
                           compilation_cache=cache)
    t0 = time.perf_counter()
    engine = load_engine(config, progress=False, serving=True)
    ready_s = time.perf_counter() - t0
    programs = len(engine.compiling.jobs) if engine.compiling is not None else None
    compiled = programs - engine.compiling.pending if engine.compiling is not None else None
    out = {"ready_s": round(ready_s, 1), "programs_at_ready": f"{compiled} of {programs}",
           **asyncio.run(_run(engine, args))}
    waits = sum(s.value for m in REGISTRY.collect() if m.name == "pdserve_prefill_compile_waits"
                for s in m.samples if s.name.endswith("_total"))
    out["compile_waits"] = waits if hasattr(metrics, "prefill_compile_waits") else None  # None: not counted
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
