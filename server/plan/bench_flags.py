"""`pdserve bench`'s flags (target, data, load, results) and the requests they draw: `pdserve plan simulate`
and `plan size` take the very same flags and requests, so a simulated run is the one bench would send.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from pdserve.server.plan import datasets


def add_bench_flags(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    t = p.add_argument_group("target")
    t.add_argument("--target", choices=["grpc", "openai"], default="grpc")
    t.add_argument("--addr", default="127.0.0.1:50051", help="pdserve gRPC address (--target grpc)")
    t.add_argument("--base-url", default="http://127.0.0.1:8000", help="OpenAI server (--target openai)")
    t.add_argument("--model", help="model name for OpenAI requests (default: the first of /v1/models)")
    t.add_argument("--api-key", help="bearer token for OpenAI requests")
    t.add_argument("--timeout", type=float, default=None, help="per-request deadline in seconds")
    d = p.add_argument_group("data")
    d.add_argument("--dataset", choices=["synthetic", "sharegpt"], default="synthetic")
    d.add_argument("--dataset-path", type=Path, help="ShareGPT JSON or JSONL file")
    d.add_argument(
        "--tokenizer", type=Path, help="tokenizer.json or model dir, to count ShareGPT prompt tokens"
    )
    d.add_argument("--input-len", type=int, default=128)
    d.add_argument("--output-len", type=int, default=32)
    d.add_argument("--length-dist", choices=["fixed", "uniform", "lognormal"], default="fixed")
    d.add_argument("--range-ratio", type=float, default=0.5, help="uniform: lengths in len*(1 +- ratio)")
    d.add_argument("--sigma", type=float, default=0.5, help="log-normal: sigma of log(length)")
    d.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="synthetic token ids below this (default: from --tokenizer, else 500)",
    )
    d.add_argument("--seed", type=int, default=0)
    ld = p.add_argument_group("load")
    ld.add_argument(
        "--num-prompts", type=int, default=None, help="requests to send (default 100 without --duration)"
    )
    ld.add_argument("--duration", type=float, default=None, help="stop sending after this many seconds")
    ld.add_argument(
        "--request-rate", type=float, default=math.inf, help="requests/s (default inf: closed loop)"
    )
    ld.add_argument("--arrival", choices=["poisson", "constant"], default="poisson")
    ld.add_argument("--concurrency", type=int, default=None, help="at most this many requests in flight")
    ld.add_argument("--warmup", type=int, default=0, help="requests sent and discarded first (prompts of their own, "
                    "not the measured ones)")
    r = p.add_argument_group("results")
    r.add_argument("--slo-ttft-ms", type=float, default=None)
    r.add_argument("--slo-tpot-ms", type=float, default=None)
    r.add_argument(
        "--out", type=Path, default=None, help="results directory (default benchmarks/results/<time>)"
    )
    r.add_argument("--no-plots", action="store_true")
    r.add_argument("--no-progress", action="store_true")
    return p


def vocab_size(args) -> int:
    if args.vocab_size:
        return args.vocab_size
    if args.tokenizer:
        from tokenizers import Tokenizer

        path = args.tokenizer / "tokenizer.json" if args.tokenizer.is_dir() else args.tokenizer
        return Tokenizer.from_file(str(path)).get_vocab_size()
    return 500


def prompt_count(args) -> int:
    """How many distinct requests a run draws: --num-prompts, else (a timed run) the arrivals its rate and
    --duration give with room for Poisson's spread, else 1000 (a closed loop cycles through them). A timed
    run that cycled would send the same prompts again, and a server's prefix cache would serve them."""
    if args.num_prompts:
        return args.num_prompts
    if args.duration and math.isfinite(args.request_rate):
        return max(1000, arrivals_bound(args.request_rate, args.duration))
    return 1000


def arrivals_bound(rate: float, duration: float) -> int:
    """Poisson arrivals at `rate` over `duration` seconds, with room for the spread (mean + 6 sd + 16)."""
    expected = rate * duration
    return math.ceil(expected + 6 * math.sqrt(expected) + 16)


def make_requests(args, n: int, seed: int | None = None) -> list[datasets.BenchRequest]:
    seed = args.seed if seed is None else seed
    if args.dataset == "sharegpt":
        if not args.dataset_path:
            raise SystemExit("--dataset sharegpt needs --dataset-path")
        return datasets.sharegpt(args.dataset_path, n, tokenizer_path=args.tokenizer, seed=seed)
    return datasets.synthetic(
        n,
        input_len=args.input_len,
        output_len=args.output_len,
        vocab_size=vocab_size(args),
        dist=args.length_dist,
        range_ratio=args.range_ratio,
        sigma=args.sigma,
        seed=seed,
    )
