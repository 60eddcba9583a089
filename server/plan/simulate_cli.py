"""`pdserve plan simulate`: one simulated cluster on one workload, bench's summary out.

    pdserve plan simulate --profile profile.json --prefill-workers 1 --decode-workers 1 \
        --input-len 256 --output-len 64 --request-rate 4 --duration 60 --json
    pdserve plan simulate --profile profile.json --colocated --decode-workers 2 --trace trace.jsonl

The workload flags are `pdserve bench`'s (its parser's own), so the same flags give the same requests at
the same times; `--json` prints the summary with bench's `results.json` keys (`ttft_ms`, `tpot_ms`,
`itl_ms` with `median`/`p99`, `goodput`, ...) and the simulator's own figures under `sim`.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from pdserve.server.plan.bench_flags import add_bench_flags
from pdserve.server.plan.cluster import ClusterSpec, CoordinatorSpec, simulate
from pdserve.server.plan.contention import HostCpu, parse_placement
from pdserve.server.plan.profile import Profile
from pdserve.server.plan.run_summary import format_summary
from pdserve.server.plan.workers import DecodeSpec, PrefillSpec
from pdserve.server.plan.workload import from_args, read_trace
from pdserve.server.prefill.scheduler import PREFILL_ORDERS


def add_cluster_flags(p: argparse.ArgumentParser) -> None:
    c = p.add_argument_group("cluster (pdserve up's flags)")
    c.add_argument("--prefill-workers", type=int, default=1)
    c.add_argument("--decode-workers", type=int, default=1, help="(with --colocated: colocated workers)")
    c.add_argument("--colocated", action="store_true", help="no prefill tier: each worker prefills and decodes")
    c.add_argument("--max-batch-tokens", "--max-num-batched-tokens", type=int, default=PrefillSpec.max_batch_tokens)
    c.add_argument("--max-batch-size", type=int, default=PrefillSpec.max_batch_size)
    c.add_argument("--max-prefill-chunk", type=int, default=None)
    c.add_argument("--prefill-order", choices=PREFILL_ORDERS, default=PrefillSpec.order)
    c.add_argument("--max-running", "--max-num-seqs", type=int, default=DecodeSpec.max_running)
    c.add_argument("--block-size", type=int, default=DecodeSpec.block_size)
    c.add_argument("--kv-cache-tokens", type=int, default=None, help="default: the profile's")
    c.add_argument("--max-model-len", type=int, default=None,
                   help="default: the longest prompt + output of the workload, as a power of two")
    c.add_argument("--ttft-budget", type=float, default=0.0)
    c.add_argument("--decode-policy", choices=["prefix-aware", "most-free-blocks", "power-of-two"],
                   default=CoordinatorSpec.decode_policy)
    h = p.add_argument_group("a shared host (contention.py)")
    h.add_argument("--host-cores", type=float, default=None,
                   help="the cores every process of the cluster (workers, coordinator, load client) shares, as on "
                        "this machine (`pdserve up` on one host); default: each worker owns its device")
    h.add_argument("--external-cores", type=float, default=0.0,
                   help="with --host-cores: cores other processes on the host keep busy")
    h.add_argument("--placement", type=_placement, default=None,
                   help="with --host-cores: the core each process is pinned to, e.g. prefill=0,decode=1,coordinator=0,"
                        "client=0 (as `plan validate --pin` runs them); default: they float over the cores")


def _placement(text: str) -> dict[str, int]:
    try:
        return parse_placement(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def host_of(args, measured: HostCpu) -> HostCpu:
    """The shared host of --host-cores (with the profile's measured front CPU and threads), or none."""
    if getattr(args, "host_cores", None) is None:
        if getattr(args, "external_cores", 0.0) or getattr(args, "placement", None):
            raise ValueError("--external-cores and --placement need --host-cores (the host they share)")
        return HostCpu()
    return replace(measured, cores=args.host_cores, external_cores=args.external_cores,
                   placement=getattr(args, "placement", None))


def cluster_spec(args, max_len: int, colocated: bool | None = None, prefill_workers: int | None = None,
                 decode_workers: int | None = None, host: HostCpu | None = None) -> ClusterSpec:
    colocated = args.colocated if colocated is None else colocated
    max_model_len = args.max_model_len or 1 << (max_len - 1).bit_length()
    return ClusterSpec(
        prefill_workers=0 if colocated else (args.prefill_workers if prefill_workers is None else prefill_workers),
        decode_workers=args.decode_workers if decode_workers is None else decode_workers,
        colocated=colocated,
        prefill=PrefillSpec(max_batch_size=args.max_batch_size, max_batch_tokens=args.max_batch_tokens,
                            max_chunk=args.max_prefill_chunk, order=args.prefill_order, max_model_len=max_model_len),
        decode=DecodeSpec(block_size=args.block_size, max_running=args.max_running,
                          kv_cache_tokens=args.kv_cache_tokens, max_model_len=max_model_len),
        coordinator=CoordinatorSpec(decode_policy=args.decode_policy, ttft_budget=args.ttft_budget,
                                    timeout=args.timeout or CoordinatorSpec.timeout),
        host=host or HostCpu())


def workload(args):
    if getattr(args, "trace", None):
        return read_trace(args.trace, vocab_size=args.vocab_size or 500, seed=args.seed)
    if args.concurrency:
        raise ValueError("--concurrency (a closed loop) is not simulated; give --request-rate")
    return from_args(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve plan simulate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bench_flags(p)  # the workload flags, exactly bench's (--timeout: the requests' deadline)
    p.set_defaults(request_rate=None)
    s = p.add_argument_group("simulation")
    s.add_argument("--profile", type=Path, required=True, help="a profile file (`pdserve plan profile`)")
    s.add_argument("--prefill-profile", type=Path, help="the prefill tier's, when it runs on other hardware")
    s.add_argument("--trace", type=Path, help="a trace file instead of the distributions (workload.py)")
    s.add_argument("--json", action="store_true", help="print the summary as JSON (bench's keys)")
    s.add_argument("--weight-dtype", help="the decode worker's --weight-dtype: the profile's decode row at it "
                                          "(default: the one the profile measured first, its `dtypes`)")
    s.add_argument("--kv-dtype", help="the decode worker's --kv-dtype: likewise (KV bytes on the wire, cache size too)")
    s.add_argument("--baseline", action="store_true",
                   help="also simulate colocated serving on as many workers (of --profile's hardware): the "
                        "baseline the split must beat (under `baseline_colocated`)")
    add_cluster_flags(p)
    return p


def run(args) -> dict:
    if args.request_rate is None and not args.trace:
        raise ValueError("give --request-rate (requests/s) or --trace")
    decode = Profile.load(args.profile)
    prefill = Profile.load(args.prefill_profile) if args.prefill_profile else decode
    decode = decode.with_dtypes(getattr(args, "weight_dtype", None), getattr(args, "kv_dtype", None))
    requests = workload(args)
    host = host_of(args, decode.host_cpu)
    spec = cluster_spec(args, max(r.prompt_len + r.output_len for r in requests), host=host)
    result = simulate(requests, spec, prefill, decode)
    summary = result.summary(args.slo_ttft_ms, args.slo_tpot_ms)
    summary["cluster"] = {"prefill_workers": spec.prefill_workers, "decode_workers": spec.decode_workers,
                          "colocated": spec.colocated, "prefill_hardware": prefill.hardware,
                          "decode_hardware": decode.hardware, "decode_dtypes": decode.dtypes}
    if getattr(args, "baseline", False) and not spec.colocated:
        workers = spec.prefill_workers + spec.decode_workers
        colocated = cluster_spec(args, max(r.prompt_len + r.output_len for r in requests), colocated=True,
                                 decode_workers=workers, host=host)
        base = simulate(requests, colocated, decode).summary(args.slo_ttft_ms, args.slo_tpot_ms)
        base["cluster"] = {"prefill_workers": 0, "decode_workers": workers, "colocated": True,
                           "decode_hardware": decode.hardware}
        summary["baseline_colocated"] = base
    return summary


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    summary = run(args)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(format_summary(summary, "simulated"))
        sim = summary["sim"]
        print("utilisation: " + "  ".join(f"{k} {100 * v:.0f}%" for k, v in sim["utilisation"].items())
              + f"   KV on the wire: {sim['kv_wire_bytes_per_s'] / 1e6:.2f} MB/s   preemptions: {sim['preemptions']}")
        if "baseline_colocated" in summary:
            base = summary["baseline_colocated"]
            print(format_summary(base, f"colocated baseline, {base['cluster']['decode_workers']} workers"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
