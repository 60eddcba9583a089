"""`pdserve plan profile`: measure this machine's tiers through the served engines into a profile file.

    pdserve plan profile [--model DIR] [--out benchmarks/plan/profile-cpu.json] [--quick]

It starts a 1 prefill + 1 decode cluster (`pdserve up`'s launcher; each worker on its own share of the
cores) and sends requests through the coordinator's gRPC API, timed at the client as `pdserve bench` does:
1. Prefill: one prompt at a time at several lengths, 2 output tokens, while `background_streams` other
   requests decode (the decode worker and the coordinator busy, as under load; their CPU is what the
   prefill worker contends with on a shared machine): TTFT(L) = overhead + step(L)
   fits `fixed + per_token x padded + per_pair x L^2`; bursts of short prompts sent at once (the first
   runs alone, the rest pack into the next step) split the intercept into the step's fixed seconds and
   the client-visible overhead that occupies no worker.
2. Decode: B requests at once (B up to the decode worker's --max-running, 64) at two context lengths: the median gap between tokens while all B decode
   is one step at batch B; fits `fixed + per_seq x B + per_context_token x sum of contexts`.
3. KV handoff: the second token's wait past the first, less a decode step, is the handoff's fixed time;
   its bytes/s is the in-process KvSender -> gRPC -> KvReceiver -> PagedKvCache transfer of
   benchmarks/tiers.py (`_transfer`), and the bytes per token those of the decode worker's KV layout.
The raw rows go into the profile's `notes`. A few minutes; progress on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pdserve.benchmarks.plan.fit import nonneg_fit
from pdserve.benchmarks.plan.profile import DecodeCost, HandoffCost, PrefillCost, Profile
from pdserve.benchmarks.plan.workers import bucket_length
from pdserve.benchmarks.protocol import cpu_model

_START = time.perf_counter()
PREFILL_ARGS = ["--compile-before-serving", "all"]
"""Every prefill program compiled before the worker serves: a compile while it serves (the default
`common` compiles the rest between requests) would land in the measured times."""


def log(message: str) -> None:
    print(f"[plan profile {time.perf_counter() - _START:6.1f}s] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class ProfilePlan:
    prefill_lengths: tuple[int, ...] = (16, 64, 128, 256, 448)
    repeats: int = 5
    burst: int = 5
    decode_batches: tuple[int, ...] = (1, 8, 32, 64)
    decode_contexts: tuple[int, ...] = (32, 320)
    decode_tokens: int = 48
    background_streams: int = 8
    """Requests decoding while the prefill rows are measured (0: an idle cluster)."""

    def __post_init__(self) -> None:
        if self.repeats < 1 or self.burst < 2 or self.decode_tokens < 8:
            raise ValueError("repeats >= 1, burst >= 2 and decode_tokens >= 8")


QUICK = ProfilePlan(prefill_lengths=(16, 128, 448), repeats=2, decode_batches=(1, 16, 64), decode_contexts=(32, 320),
                    decode_tokens=16, background_streams=8)


async def _send(target, requests) -> list:
    from pdserve.benchmarks.clients import RequestOutput

    outs = [RequestOutput(group="profile", prompt_len=r.prompt_len) for r in requests]
    await asyncio.gather(*(target.send(r, o) for r, o in zip(requests, outs)))
    for o in outs:
        if not o.success:
            raise RuntimeError(f"a profiling request failed: {o.error}; is the cluster healthy? "
                               f"(`pdserve status`)")
    return outs


def _synthetic(n: int, prompt_len: int, output_len: int, vocab: int, seed: int):
    from pdserve.benchmarks.datasets import synthetic

    return synthetic(n, input_len=prompt_len, output_len=output_len, vocab_size=vocab, seed=seed)


async def _background(target, vocab: int, streams: int, output_len: int, stop: asyncio.Event) -> None:
    """`streams` requests decoding at all times until `stop`: the decode tier and the coordinator busy, as
    under load, while the prefill rows are measured (their CPU is the prefill worker's contention)."""
    from pdserve.benchmarks.clients import RequestOutput

    seed = 5000
    while not stop.is_set():
        reqs = _synthetic(streams, 16, output_len, vocab, seed)
        seed += 1
        await asyncio.gather(*(target.send(r, RequestOutput(group="background", prompt_len=16)) for r in reqs))


async def measure_served(address: str, vocab: int, plan: ProfilePlan, max_len: int, bar) -> dict:
    from pdserve.benchmarks.clients import GrpcTarget

    target = GrpcTarget(address, timeout=300)
    rows: dict = {"prefill": [], "burst": [], "decode": []}
    try:
        await _send(target, _synthetic(4, 16, 2, vocab, 99))  # connections, the first steps
        stop = asyncio.Event()
        background = asyncio.create_task(_background(target, vocab, plan.background_streams, max_len - 32, stop))
        try:
            await asyncio.sleep(0.5)
            for n in plan.prefill_lengths:
                reqs = _synthetic(plan.repeats + 1, n, 2, vocab, n)
                for i, req in enumerate(reqs):  # one at a time; the first warms the bucket up
                    (o,) = await _send(target, [req])
                    if i:
                        rows["prefill"].append({"tokens": n, "ttft_s": o.ttft, "second_s": o.chunk_times[1] - o.sent})
                bar.update(1)
            for r in range(plan.repeats + 1):
                outs = await _send(target, _synthetic(plan.burst, 16, 1, vocab, 1000 + r))
                ttfts = sorted(o.ttft for o in outs)
                if r:
                    rows["burst"].append({"prompts": plan.burst, "tokens": 16, "first_s": ttfts[0],
                                          "last_s": ttfts[-1]})
            bar.update(1)
        finally:
            stop.set()
            await background
        for context in plan.decode_contexts:
            for batch in plan.decode_batches:
                prompt = min(context, max_len - plan.decode_tokens - 1)
                outs = await _send(target, _synthetic(batch, prompt, plan.decode_tokens, vocab, batch * 7 + context))
                begin, end = max(o.chunk_times[0] for o in outs), min(o.done for o in outs)
                # seconds per token between chunks (a chunk may carry several tokens: the coordinator coalesces)
                pairs = [(b - a) / k for o in outs
                         for a, b, k in zip(o.chunk_times, o.chunk_times[1:], o.chunk_tokens[1:])]
                inside = [(b - a) / k for o in outs
                          for a, b, k in zip(o.chunk_times, o.chunk_times[1:], o.chunk_tokens[1:])
                          if a >= begin and b <= end]
                gaps = inside if len(inside) >= batch * 4 else pairs  # too little overlap: every gap
                rows["decode"].append({"batch": batch, "prompt": prompt, "tokens": plan.decode_tokens,
                                       "context_tokens": batch * (prompt + plan.decode_tokens // 2),
                                       "step_s": statistics.median(gaps)})
                bar.update(1)
    finally:
        await target.close()
    return rows


def fit_profile(rows: dict, *, hardware: str, model: str, kv_bytes_per_token: int, kv_cache_tokens: int,
                transfer_bytes_per_s: float, max_len: int, min_bucket: int = 16, max_batch_tokens: int = 8192) -> Profile:
    """The profile the rows imply (module docstring: the model each one fits)."""
    pre = _medians(rows["prefill"], "tokens")
    padded = [bucket_length(r["tokens"], max_len, min_bucket) for r in pre]
    c = nonneg_fit({"one": [1.0] * len(pre), "padded": padded, "pairs": [r["tokens"] ** 2 for r in pre]},
                   [r["ttft_s"] for r in pre])
    per_token, per_pair, intercept = c["padded"], c["pairs"], c["one"]
    # A burst: the first prompt's step alone, then the other prompts packed into one step.
    b = rows["burst"]
    packed = [(r["prompts"] - 1) * r["tokens"] for r in b]
    deltas = [r["last_s"] - r["first_s"] - per_token * bucket_length(min(p, max_len), max(max_len, p), min_bucket)
              - per_pair * sum([r["tokens"] ** 2] * (r["prompts"] - 1)) for r, p in zip(b, packed)]
    fixed = min(max(statistics.median(deltas), 0.0), intercept) if deltas else intercept
    dec = rows["decode"]
    d = nonneg_fit({"one": [1.0] * len(dec), "batch": [r["batch"] for r in dec],
                    "context": [r["context_tokens"] for r in dec]}, [r["step_s"] for r in dec])
    decode = DecodeCost(d["one"], d["batch"], d["context"], per_resumed_token_s=per_token)
    waits = [r["second_s"] - r["ttft_s"] - decode.step_seconds(1, r["tokens"] + 1)
             - r["tokens"] * kv_bytes_per_token / transfer_bytes_per_s for r in pre]
    handoff = HandoffCost(max(statistics.median(waits), 0.0), transfer_bytes_per_s, kv_bytes_per_token)
    return Profile(hardware=hardware, model=model, prefill=PrefillCost(fixed, per_token, per_pair), decode=decode,
                   handoff=handoff, kv_cache_tokens=kv_cache_tokens, source="measured",
                   ttft_overhead_s=intercept - fixed,
                   notes={"rows": rows, "prefill_intercept_s": intercept,
                          "max_batch_tokens": max_batch_tokens, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})


def _medians(rows: list[dict], key: str) -> list[dict]:
    """One row per value of `key`: the median of each other field (the machine is shared: noise)."""
    out = []
    for value in sorted({r[key] for r in rows}):
        group = [r for r in rows if r[key] == value]
        out.append({k: (value if k == key else statistics.median(r[k] for r in group)) for k in group[0]})
    return out


def _peaks() -> dict:
    """One core's (each worker has one): what efficiency factors are measured against (roofline.py)."""
    import torch

    from pdserve.benchmarks import ceilings

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {"flops": ceilings.matmul_torch_gflops(1024, 3) * 1e9,
                "bytes_per_s": ceilings.memcpy_torch_gbps(256 * 2**20, 3) * 1e9, "threads": 1}
    finally:
        torch.set_num_threads(threads)


def _shape(config) -> dict:
    from pdserve.benchmarks.tiers import matmul_weights

    layers, head = matmul_weights(config)
    return {"params": layers + head, "layers": config.num_layers, "hidden": config.hidden_size,
            "kv_heads": config.num_kv_heads, "head_dim": config.head_dim, "vocab": config.vocab_size}


def _transfer_bytes_per_s(layout) -> float:
    import uvloop

    from pdserve.benchmarks.tiers import _transfer
    from pdserve.kvcache.layout import KvLayout

    f32 = KvLayout(layout.num_layers, layout.num_kv_heads, layout.head_dim, block_size=layout.block_size,
                   dtype="float32")
    seconds, _, nbytes = uvloop.run(_transfer(f32, "profile", 2048, 3))
    return nbytes / seconds


def refit(profile: Profile, max_len: int) -> Profile:
    """The profile its own measured rows give under this module's fit (after a change to the fit)."""
    notes = profile.notes
    if "rows" not in notes:
        raise ValueError(f"the profile of {profile.hardware} holds no measured rows to fit again")
    new = fit_profile(notes["rows"], hardware=profile.hardware, model=profile.model,
                      kv_bytes_per_token=profile.handoff.kv_bytes_per_token, kv_cache_tokens=profile.kv_cache_tokens,
                      transfer_bytes_per_s=profile.handoff.bytes_per_s, max_len=max_len)
    kept = {k: v for k, v in notes.items() if k not in new.notes}
    return Profile(**{**new.__dict__, "notes": {**new.notes, **kept, "measured_at": notes.get("measured_at"),
                                                "refit_at": new.notes["measured_at"], "max_len": max_len}})


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve plan profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--refit", type=Path, help="fit this profile's stored rows again (no measuring) into --out")
    p.add_argument("--max-len", type=int, help="with --refit: the served max model length (default: the file's)")
    p.add_argument("--model", type=Path, help="checkpoint (default: pdserve's embedded tiny model)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/plan/profile-cpu.json"))
    p.add_argument("--quick", action="store_true", help="fewer rows (about a minute less)")
    p.add_argument("--hardware", help="the name written into the profile (default: this CPU's model name)")
    return p


def main(argv: list[str] | None = None) -> int:
    from tqdm import tqdm

    from pdserve.kvcache.layout import KvLayout
    from pdserve.server import launcher
    from pdserve.server.cli import default_model_dir
    from pdserve.server.client import list_workers
    from pdserve.server.model.config import load_config

    args = build_parser().parse_args(argv)
    if args.refit:
        old = Profile.load(args.refit)
        max_len = args.max_len or old.notes.get("max_len")
        if not max_len:
            raise ValueError(f"{args.refit} does not say its max model length: give --max-len")
        refit(old, max_len).save(args.out)
        print(f"profile: {args.out} (refit from {args.refit})")
        return 0
    plan = QUICK if args.quick else ProfilePlan()
    model = args.model or default_model_dir()
    config = load_config(model)
    max_len = min(config.max_model_len, 1 << 30)
    log(f"starting 1 prefill + 1 decode worker on {model} (compiles first: a minute or two)")
    cluster = launcher.launch(model, prefill_workers=1, decode_workers=1, port=0, host="127.0.0.1",
                              prefill_args=PREFILL_ARGS)
    try:
        statuses = {w.role: w.info for w in list_workers(cluster.coordinator.address)}
        decode = statuses["decode"]
        layout = KvLayout.from_proto(decode.kv_layout)
        kv_cache_tokens = decode.load.total_kv_blocks * layout.block_size
        steps = len(plan.prefill_lengths) + 1 + len(plan.decode_batches) * len(plan.decode_contexts)
        log(f"measuring: {steps} groups of requests (KV {layout.describe()}, cache {kv_cache_tokens} tokens)")
        lengths = tuple(n for n in plan.prefill_lengths if n < max_len - 2)
        plan = ProfilePlan(lengths, plan.repeats, plan.burst, plan.decode_batches, plan.decode_contexts,
                           plan.decode_tokens, plan.background_streams)
        with tqdm(total=steps, desc="plan profile", unit="group", file=sys.stderr) as bar:
            rows = asyncio.run(measure_served(cluster.coordinator.address, config.vocab_size, plan, max_len, bar))
    finally:
        cluster.stop()
    log("KV transfer bytes/s (benchmarks/tiers.py, in-process over gRPC)")
    bw = _transfer_bytes_per_s(layout)
    log("this machine's peaks on one core (benchmarks/ceilings.py: torch matmul GFLOP/s, memcpy GB/s)")
    peak = _peaks()
    profile = fit_profile(rows, hardware=args.hardware or cpu_model(), model=model.name,
                          kv_bytes_per_token=layout.bytes_per_token, kv_cache_tokens=kv_cache_tokens,
                          transfer_bytes_per_s=bw, max_len=1 << (max_len - 1).bit_length())
    profile.notes["max_len"] = 1 << (max_len - 1).bit_length()
    profile.notes["peak"] = peak
    profile.notes["kind"] = "cpu"
    profile.notes["model_shape"] = _shape(config)
    profile.save(args.out)
    p, d, h = profile.prefill, profile.decode, profile.handoff
    print(f"prefill step: {p.fixed_s * 1e3:.2f} ms + {p.per_token_s * 1e6:.2f} us/padded token + "
          f"{p.per_pair_s * 1e9:.3f} ns/attention pair; TTFT overhead {profile.ttft_overhead_s * 1e3:.2f} ms")
    print(f"decode step: {d.fixed_s * 1e3:.2f} ms + {d.per_seq_s * 1e3:.3f} ms/seq + "
          f"{d.per_context_token_s * 1e6:.3f} us/context token")
    print(f"KV handoff: {h.fixed_s * 1e3:.2f} ms + {h.kv_bytes_per_token} B/token at {h.bytes_per_s / 1e9:.2f} GB/s")
    print(f"profile: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
