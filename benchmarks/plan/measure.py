"""`pdserve plan profile`: measure this machine's tiers through the served engines into a profile file.

    pdserve plan profile [--model DIR] [--out benchmarks/plan/profile-cpu.json] [--quick] [--background-streams N]
                         [--decode-dtypes auto/auto,auto/int8,int8/auto]

It starts a 1 prefill + 1 decode cluster (`pdserve up`'s launcher; each worker on its own share of the
cores) and sends requests through the coordinator's gRPC API, timed at the client as `pdserve bench` does:
1. Prefill: one prompt at a time at several lengths, 2 output tokens, while `background_streams` other
   requests decode (the decode worker and the coordinator busy, as under load; their CPU is what the
   prefill worker contends with on a shared machine; 0: an idle cluster): TTFT(L) = overhead + step(L)
   fits `fixed + per_token x padded + per_pair x L^2`; bursts of short prompts sent at once (the first
   runs alone, the rest pack into the next step) split the intercept into the step's fixed seconds and
   the client-visible overhead that occupies no worker. Then, on the idle cluster, prompts at each length
   back to back and each after an idle gap of `cold_gap_s`: median cold TTFT over median warm is the
   length's cold factor (`cold_rows`, profile.py `PrefillCost.cold_factors`).
2. Decode: B requests at once (B up to the decode worker's --max-running, 64) at two context lengths: the median gap between tokens while all B decode
   is one step at batch B; fits `fixed + per_seq x B + per_context_token x sum of contexts`.
3. KV handoff: the second token's wait past the first, less a decode step, is the handoff's fixed time;
   its bytes/s is the in-process KvSender -> gRPC -> KvReceiver -> PagedKvCache transfer of
   benchmarks/tiers.py (`_transfer`), and the bytes per token those of the decode worker's KV layout.
4. The host's CPU (procstat.py), over each group: the share of a core each worker got while it wanted one
   (its busiest thread's on-CPU / (on-CPU + waiting) seconds): the prefill fit takes TTFT x that share, its
   work on cores of its own; a decode step's work is the decode process's CPU per step (`step_work`: its
   engine loop, relay and gRPC threads take the GIL in turn, on one core); the coordinator's and this
   client's CPU seconds per request (a group of one-token requests) and per token (the decode groups, less
   their requests'); the cores the prefill worker keeps busy while it works (its process's CPU over its
   busiest thread's: XLA's threads). These are the profile's `host_cpu`.
5. Per request, beside the steps: N requests one at a time (2 tokens: one decode step each) at a short and a
   long prompt on the idle cluster; each worker's CPU over them (its threads' on-CPU seconds, schedstat),
   less its idle CPU over the same wall time and the steps' work the fits give, per request, fitted as
   `per_request_s + per_request_token_s x prompt` (the KV sent or received, the RPCs, admission); the decode
   groups' step work has their requests' share taken out.
6. Per dtype: the decode groups again on a cluster whose decode worker runs at each other WEIGHT/KV pair of
   --decode-dtypes (its --weight-dtype/--kv-dtype): the profile's `decode_dtypes`, with that KV layout's
   bytes per token and cache size (profile.py).
A decode group whose requests never all decode at once (the last first token after the first finish) is
kept in the notes but not fitted. The raw rows go into the profile's `notes`. A few minutes; progress on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pdserve.benchmarks.plan import pinning
from pdserve.server.plan.contention import HostCpu, ProcessCpu
from pdserve.benchmarks.plan.fit import nonneg_fit
from pdserve.benchmarks.plan.procstat import Window, thread_run_seconds
from pdserve.server.plan.profile import DecodeCost, DtypeRow, HandoffCost, PrefillCost, Profile
from pdserve.benchmarks.protocol import cpu_model
from pdserve.server.prefill.shapes import bucket_length

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
    decode_tokens: int = 96
    """Tokens each decode group's requests generate: enough that all of a batch decode at once a while."""
    front_requests: int = 32
    """One-token requests sent at once to measure the coordinator's and the client's CPU per request."""
    request_lengths: tuple[int, ...] = (16, 384)
    request_count: int = 16
    """Requests sent one at a time at each of `request_lengths` for the workers' CPU per request."""
    background_streams: int = 8
    """Requests decoding while the prefill rows are measured; each row's share of a core is divided out.
    0: an idle cluster, a prompt's time taken as its work and its process's CPU over that time as the cores
    it keeps busy (the busiest thread's share also counts XLA's threads waiting for each other). Measured
    both ways on 2026-12-04, the loaded profile predicted the validation runs better (10 and 11 of 18
    against 6 and 4: benchmarks/README.md), so it stays the default."""

    cold_gap_s: float = 0.3
    """The idle gap before each cold prefill row (measured on the idle cluster beside warm ones sent back to
    back: the ratio is the profile's `cold_factors`)."""
    cold_after_s: float = 0.075
    """The idle gap from which the simulator takes a prefill step as cold. Measured here (2026-12-04, AMD EPYC, 2
    cores, 384-token prompts one at a time): after gaps of 5-50 ms a step was as fast as back to back, after
    100 ms and more 1.4x as slow."""

    def __post_init__(self) -> None:
        if self.repeats < 1 or self.burst < 2 or self.decode_tokens < 8:
            raise ValueError("repeats >= 1, burst >= 2 and decode_tokens >= 8")
        if self.background_streams < 0:
            raise ValueError(f"--background-streams must be >= 0, got {self.background_streams}")


QUICK = ProfilePlan(prefill_lengths=(16, 128, 448), repeats=2, decode_batches=(1, 16, 64), decode_contexts=(32, 320),
                    decode_tokens=48, front_requests=16, background_streams=8, request_count=8)


async def _send(target, requests) -> list:
    from pdserve.server.plan.run_summary import RequestOutput

    outs = [RequestOutput(group="profile", prompt_len=r.prompt_len) for r in requests]
    await asyncio.gather(*(target.send(r, o) for r, o in zip(requests, outs)))
    for o in outs:
        if not o.success:
            raise RuntimeError(f"a profiling request failed: {o.error}; is the cluster healthy? "
                               f"(`pdserve status`)")
    return outs


def _synthetic(n: int, prompt_len: int, output_len: int, vocab: int, seed: int):
    from pdserve.server.plan.datasets import synthetic

    return synthetic(n, input_len=prompt_len, output_len=output_len, vocab_size=vocab, seed=seed)


async def _background(target, vocab: int, streams: int, output_len: int, stop: asyncio.Event) -> None:
    """`streams` requests decoding at all times until `stop`: the decode tier and the coordinator busy, as
    under load, while the prefill rows are measured (their CPU is the prefill worker's contention)."""
    from pdserve.server.plan.run_summary import RequestOutput

    seed = 5000
    while not stop.is_set():
        reqs = _synthetic(streams, 16, output_len, vocab, seed)
        seed += 1
        await asyncio.gather(*(target.send(r, RequestOutput(group="background", prompt_len=16)) for r in reqs))


def _pids(pids: dict[str, int]) -> dict[str, int]:
    """The cluster's processes under the names the profile uses, and this process (the load client)."""
    import os

    named = {"client": os.getpid()}
    for name, pid in pids.items():
        named[name.split("-")[0]] = pid  # prefill-0 -> prefill, decode-0 -> decode, coordinator
    return named


async def measure_served(address: str, vocab: int, plan: ProfilePlan, max_len: int, bar,
                         pids: dict[str, int] | None = None) -> dict:
    from pdserve.benchmarks.clients import GrpcTarget

    pids = _pids(pids or {})
    target = GrpcTarget(address, timeout=300)
    rows: dict = {"prefill": [], "burst": [], "decode": [], "front": [], "prefill_cpu": {}}
    try:
        await _send(target, _synthetic(4, 16, 2, vocab, 99))  # connections, the first steps
        stop = asyncio.Event()
        background = (asyncio.create_task(_background(target, vocab, plan.background_streams, max_len - 32, stop))
                      if plan.background_streams else None)
        try:
            await asyncio.sleep(0.5)
            ttft_sum = 0.0
            whole = Window(pids)
            for n in plan.prefill_lengths:
                reqs = _synthetic(plan.repeats + 1, n, 2, vocab, n)
                for i, req in enumerate(reqs):  # one at a time; the first warms the bucket up
                    window = Window(pids)
                    (o,) = await _send(target, [req])
                    ttft_sum += o.ttft
                    if i:
                        got = window.end()["share"]
                        rows["prefill"].append({"tokens": n, "ttft_s": o.ttft, "second_s": o.chunk_times[1] - o.sent,
                                                "share": got.get("prefill", 1.0),
                                                "decode_share": got.get("decode", 1.0),
                                                "background": plan.background_streams})
                bar.update(1)
            host = whole.end()
            rows["prefill_cpu"] = {"cpu_s": host["cpu_s"].get("prefill", 0.0), "ttft_sum_s": ttft_sum,
                                   "hot_cpu_s": host["hot_cpu_s"].get("prefill", 0.0),
                                   "background": plan.background_streams}
            for r in range(plan.repeats + 1):
                outs = await _send(target, _synthetic(plan.burst, 16, 1, vocab, 1000 + r))
                ttfts = sorted(o.ttft for o in outs)
                if r:
                    rows["burst"].append({"prompts": plan.burst, "tokens": 16, "first_s": ttfts[0],
                                          "last_s": ttfts[-1]})
            bar.update(1)
        finally:
            stop.set()
            if background is not None:
                await background
        rows["cold"] = await cold_rows(target, vocab, plan)
        bar.update(1)
        window = Window(pids)
        await _send(target, _synthetic(plan.front_requests, 16, 1, vocab, 2000))
        host = window.end()
        rows["front"].append({"requests": plan.front_requests, "tokens": plan.front_requests,
                              "cpu_s": {k: host["cpu_s"].get(k, 0.0) for k in ("coordinator", "client")}})
        rows["requests"] = await request_rows(target, vocab, plan, max_len, pids)
        rows["decode"] = await decode_rows(target, vocab, plan, max_len, pids, bar)
    finally:
        await target.close()
    return rows


async def cold_rows(target, vocab: int, plan: ProfilePlan) -> list[dict]:
    """Per prefill length on the idle cluster: `repeats` prompts back to back (warm) and `repeats` each after
    an idle gap of `cold_gap_s` (cold), their TTFTs."""
    rows = []
    for n in plan.prefill_lengths:
        reqs = _synthetic(2 * plan.repeats + 1, n, 2, vocab, 4000 + n)
        await _send(target, reqs[:1])
        warm = [(await _send(target, [r]))[0].ttft for r in reqs[1:plan.repeats + 1]]
        cold = []
        for r in reqs[plan.repeats + 1:]:
            await asyncio.sleep(plan.cold_gap_s)
            cold.append((await _send(target, [r]))[0].ttft)
        rows.append({"tokens": n, "gap_s": plan.cold_gap_s, "cold_after_s": plan.cold_after_s,
                     "warm_s": warm, "cold_s": cold})
    return rows


def cold_fit(rows: list[dict], max_len: int, min_bucket: int) -> dict:
    """`cold_after_s` and `cold_factors` from `cold_rows` (median cold TTFT over median warm, at least 1)."""
    if not rows:
        return {}
    warm: dict[int, list[float]] = {}
    cold: dict[int, list[float]] = {}
    for r in rows:  # rows of one bucket (merged profiles) pooled
        n = bucket_length(r["tokens"], max_len, min_bucket)
        warm.setdefault(n, []).extend(r["warm_s"])
        cold.setdefault(n, []).extend(r["cold_s"])
    factors = {n: max(1.0, statistics.median(cold[n]) / statistics.median(warm[n])) for n in warm}
    return {"cold_after_s": rows[0]["cold_after_s"], "cold_factors": tuple(sorted(factors.items()))}


def _thread_cpu(pids: dict[str, int]) -> dict[str, float]:
    """Each process's on-CPU seconds summed over its threads (schedstat: ns, not the 10 ms ticks of stat)."""
    return {k: sum(on for on, _ in thread_run_seconds(pid).values()) for k, pid in pids.items()}


async def request_rows(target, vocab: int, plan: ProfilePlan, max_len: int, pids: dict[str, int]) -> list[dict]:
    """The workers' CPU per request beside their steps: `request_count` 2-token requests one at a time per
    prompt length on the idle cluster, and the idle CPU over as long a wall before them."""
    rows = []
    workers = {k: v for k, v in pids.items() if k in ("prefill", "decode")}
    for length in (n for n in plan.request_lengths if n < max_len - 2):
        reqs = _synthetic(plan.request_count + 1, length, 2, vocab, 3000 + length)
        await _send(target, reqs[:1])  # the bucket warm
        t0, cpu0 = time.perf_counter(), _thread_cpu(workers)
        for req in reqs[1:]:
            await _send(target, [req])
        wall, cpu1 = time.perf_counter() - t0, _thread_cpu(workers)
        await asyncio.sleep(min(wall, 3.0))
        idle_wall, cpu2 = min(wall, 3.0), _thread_cpu(workers)
        rows.append({"prompt": length, "requests": plan.request_count, "wall_s": wall,
                     "cpu_s": {k: cpu1[k] - cpu0[k] for k in workers},
                     "idle_cores": {k: max(cpu2[k] - cpu1[k], 0.0) / idle_wall for k in workers}})
    return rows

async def decode_rows(target, vocab: int, plan: ProfilePlan, max_len: int, pids: dict[str, int], bar) -> list[dict]:
    """B requests at once per group: the median gap between tokens while all B decode is one step at batch B."""
    rows = []
    for context in plan.decode_contexts:
        for batch in plan.decode_batches:
            prompt = min(context, max_len - plan.decode_tokens - 1)
            window = Window(pids)
            outs = await _send(target, _synthetic(batch, prompt, plan.decode_tokens, vocab, batch * 7 + context))
            host = window.end()
            begin, end = max(o.chunk_times[0] for o in outs), min(o.done for o in outs)
            # seconds per token between chunks (a chunk may carry several tokens: the coordinator coalesces)
            pairs = [(b - a) / k for o in outs
                     for a, b, k in zip(o.chunk_times, o.chunk_times[1:], o.chunk_tokens[1:])]
            inside = [(b - a) / k for o in outs
                      for a, b, k in zip(o.chunk_times, o.chunk_times[1:], o.chunk_tokens[1:])
                      if a >= begin and b <= end]
            overlap = len(inside) >= batch * 4
            gaps = inside if overlap else pairs  # too little overlap: every gap (not fitted)
            rows.append({"batch": batch, "prompt": prompt, "tokens": plan.decode_tokens,
                         "context_tokens": batch * (prompt + plan.decode_tokens // 2),
                         "step_s": statistics.median(gaps), "overlap": overlap, "share": host["share"].get("decode", 1.0),
                         "cpu_s": {k: host["cpu_s"].get(k, 0.0) for k in ("coordinator", "client", "decode")},
                         "decode_hot_cpu_s": host["hot_cpu_s"].get("decode", 0.0)})
            bar.update(1)
    return rows


def step_work(r: dict) -> float:
    """A decode group's step on a core of its own: the decode process's CPU per step (about `tokens` steps)
    where measured, its threads (engine loop, relay, gRPC) taking the GIL in turn; else the step's wall
    seconds times the share of a core the worker got."""
    cpu = r.get("cpu_s", {}).get("decode")
    return min(r["step_s"], cpu / r["tokens"]) if cpu else r["step_s"] * r.get("share", 1.0)


def fit_decode(rows: list[dict], per_resumed_token_s: float, requests: list[dict] = ()) -> DecodeCost:
    """`fixed + per_seq x B + per_context_token x contexts` over the groups whose requests all decoded at once,
    each step's work on a core of its own (`step_work`) less its group's requests' own CPU spread over the
    steps; then the per-request cost from `requests` rows (`request_rows`), the two fitted in turn."""
    cost = DecodeCost(0.0, 0.0)
    for _ in range(6):  # each round's error is the last's over the groups' tokens per request
        dec = [{**r, "step_s": max(step_work(r) - _requests_per_step(r, cost), 0.1 * step_work(r))}
               for r in rows if r.get("overlap", True)]
        if not dec:
            raise ValueError("no decode group had all its requests decoding at once: raise ProfilePlan.decode_tokens")
        d = nonneg_fit({"one": [1.0] * len(dec), "batch": [r["batch"] for r in dec],
                        "context": [r["context_tokens"] for r in dec]}, [r["step_s"] for r in dec])
        steps = DecodeCost(d["one"], d["batch"], d["context"], per_resumed_token_s=per_resumed_token_s)
        per = _per_request(requests, "decode", lambda n: steps.step_seconds(1, n + 1))
        cost = dataclasses.replace(steps, **per)
        if not requests:
            break
    return cost


def _requests_per_step(r: dict, cost: DecodeCost) -> float:
    """A decode group's requests' own CPU (`request_seconds`) spread over its steps (about `tokens` of them)."""
    if "tokens" not in r or not (cost.per_request_s or cost.per_request_token_s):
        return 0.0
    return r["batch"] * cost.request_seconds(r.get("prompt", 0)) / r["tokens"]


def _per_request(requests: list[dict], role: str, step: Callable[[int], float]) -> dict[str, float]:
    """`per_request_s` and `per_request_token_s` of a worker from `request_rows`: its CPU per request less its
    idle CPU over the wall and the request's steps (`step(prompt)`), fitted against the prompt length."""
    rows = [r for r in requests if role in r.get("cpu_s", {})]
    if not rows:
        return {"per_request_s": 0.0, "per_request_token_s": 0.0}
    own = [max((r["cpu_s"][role] - r["idle_cores"][role] * r["wall_s"]) / r["requests"] - step(r["prompt"]), 0.0)
           for r in rows]
    if len(rows) == 1:
        return {"per_request_s": own[0], "per_request_token_s": 0.0}
    c = nonneg_fit({"one": [1.0] * len(rows), "tokens": [r["prompt"] for r in rows]}, own, relative=False)
    return {"per_request_s": c["one"], "per_request_token_s": c["tokens"]}


def fit_profile(rows: dict, *, hardware: str, model: str, kv_bytes_per_token: int, kv_cache_tokens: int,
                transfer_bytes_per_s: float, max_len: int, min_bucket: int = 16, max_batch_tokens: int = 8192) -> Profile:
    """The profile the rows imply (module docstring: the model each one fits). Rows measured before the host's
    CPU was (no `share`) count as measured on cores of their own."""
    pre = _medians([{**r, "share": _share(r, "share"), "decode_share": _share(r, "decode_share"),
                     "ttft_s": r["ttft_s"] * _share(r, "share")} for r in rows["prefill"]], "tokens")
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
    requests = rows.get("requests", [])
    decode = fit_decode(rows["decode"], per_token, requests)
    steps = PrefillCost(fixed, per_token, per_pair, **cold_fit(rows.get("cold", []), max_len, min_bucket))
    host = host_cpu(rows)
    threads = host.prefill_threads  # a prefill step's CPU: its work times the cores XLA keeps busy
    prefill = dataclasses.replace(steps, **_per_request(
        requests, "prefill",
        lambda n: threads * steps.step_seconds(bucket_length(n, max_len, min_bucket), n * n)))
    # the second token's wait runs on the decode worker (the KV in, a step): its share divided out too
    waits = [(r["second_s"] - r["ttft_s"] / r.get("share", 1.0)) * r.get("decode_share", 1.0)
             - decode.step_seconds(1, r["tokens"] + 1) - r["tokens"] * kv_bytes_per_token / transfer_bytes_per_s
             for r in pre]
    handoff = HandoffCost(max(statistics.median(waits), 0.0), transfer_bytes_per_s, kv_bytes_per_token)
    return Profile(hardware=hardware, model=model, prefill=prefill, decode=decode,
                   handoff=handoff, kv_cache_tokens=kv_cache_tokens, source="measured",
                   ttft_overhead_s=intercept - fixed, host_cpu=host,
                   notes={"rows": rows, "prefill_intercept_s": intercept,
                          "max_batch_tokens": max_batch_tokens, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})


def host_cpu(rows: dict) -> HostCpu:
    """The front's CPU per request (the one-token group) and per token (the decode groups of 8 or more, less
    their requests'), the cores the prefill worker keeps busy while it prefills; zeros where not measured."""
    import os

    front = {}
    for name in ("coordinator", "client"):
        per_request = statistics.median([r["cpu_s"][name] / r["requests"] for r in rows.get("front", [])] or [0.0])
        per_token = [(r["cpu_s"][name] - per_request * r["batch"]) / (r["batch"] * r["tokens"])
                     for r in rows["decode"] if "cpu_s" in r and r["batch"] >= 8]
        front[name] = ProcessCpu(per_request, max(statistics.median(per_token), 0.0) if per_token else 0.0)
    cores = float(os.cpu_count() or 1)
    cpu = rows.get("prefill_cpu") or {}
    if cpu.get("background", 1) == 0 and cpu.get("ttft_sum_s"):  # measured idle: its CPU over its prompts' time
        prefill = cpu.get("cpu_s", 0.0) / cpu["ttft_sum_s"]
    else:
        prefill = cpu.get("cpu_s", 0.0) / cpu["hot_cpu_s"] if cpu.get("hot_cpu_s") else 1.0
    # the decode worker's step is its process's CPU (step_work): one core, its threads in turn
    return HostCpu(prefill_threads=min(max(prefill, 1.0), cores), decode_threads=1.0,
                   coordinator=front["coordinator"], client=front["client"])


def _share(r: dict, key: str) -> float:
    """The share a prefill row divides out: the measured one under background load, 1 on an idle cluster
    (rows of older profiles, without `background`, were measured under load)."""
    return r.get(key, 1.0) if r.get("background", 1) else 1.0


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
                                                "refit_at": new.notes["measured_at"], "max_len": max_len},
                      "dtypes": profile.dtypes,
                      "decode_dtypes": dtype_rows(notes.get("dtype_rows", {}), new.prefill.per_token_s)
                      if "dtype_rows" in notes else profile.decode_dtypes})


def merge_rows(docs: list[dict]) -> dict:
    """The rows of several profiles' measurements as one measurement's: every list's rows together, the
    prefill's CPU sums added."""
    out: dict = {}
    for rows in docs:
        for key, value in rows.items():
            if isinstance(value, list):
                out.setdefault(key, []).extend(value)
            elif isinstance(value, dict):
                into = out.setdefault(key, {})
                for k, v in value.items():
                    into[k] = into.get(k, 0) + v if k != "background" else v
    return out


def merge(profiles: list[Profile], max_len: int) -> Profile:
    """One profile from several measurements of the same cluster (`--merge`): each group's rows from every
    one fitted together, the KV link's bytes/s their median. Minutes apart on a shared VM a profile's step
    costs move by 20-40%; the merged one is their middle."""
    if len({(p.hardware, p.model, p.handoff.kv_bytes_per_token) for p in profiles}) != 1:
        raise ValueError("--merge takes profiles of one machine, model and KV layout: "
                         + ", ".join(f"{p.hardware}/{p.model}/{p.handoff.kv_bytes_per_token} B" for p in profiles))
    for p in profiles:
        if "rows" not in p.notes:
            raise ValueError(f"the profile of {p.hardware} measured at {p.notes.get('measured_at', '?')} holds no "
                             f"rows to merge (a projected or scripted profile)")
    first = profiles[0]
    new = fit_profile(merge_rows([p.notes["rows"] for p in profiles]), hardware=first.hardware, model=first.model,
                      kv_bytes_per_token=first.handoff.kv_bytes_per_token, kv_cache_tokens=first.kv_cache_tokens,
                      transfer_bytes_per_s=statistics.median(p.handoff.bytes_per_s for p in profiles), max_len=max_len)
    return dataclasses.replace(new, notes={**new.notes, "max_len": max_len,
                                           "merged_from": [p.notes.get("measured_at") for p in profiles]})


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve plan profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--refit", type=Path, help="fit this profile's stored rows again (no measuring) into --out")
    p.add_argument("--merge", type=Path, nargs="+", metavar="PROFILE",
                   help="fit these measured profiles' rows together into --out (no measuring): their middle")
    p.add_argument("--max-len", type=int, help="with --refit or --merge: the served max model length (default: the "
                                               "file's)")
    p.add_argument("--model", type=Path, help="checkpoint (default: pdserve's embedded tiny model)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/plan/profile-cpu.json"))
    p.add_argument("--quick", action="store_true", help="fewer rows (about a minute less)")
    p.add_argument("--pin", action="store_true",
                   help="each worker on a core of its own (prefill, coordinator and this client on the first, decode on "
                        "the second: pinning.py), as `plan validate --pin` runs its cluster")
    p.add_argument("--background-streams", type=int, default=ProfilePlan.background_streams,
                   help="requests kept decoding while the prefill rows are measured (their share of a core divided "
                        "out); 0: the prefill rows on the idle cluster, each prompt's time as its work and the prefill "
                        f"worker's CPU over that time as the cores a step keeps busy. Default "
                        f"{ProfilePlan.background_streams}")
    p.add_argument("--hardware", help="the name written into the profile (default: this CPU's model name)")
    p.add_argument("--decode-dtypes", type=parse_dtype_pairs, default=parse_dtype_pairs(DEFAULT_DTYPES),
                   help="the decode worker's WEIGHT/KV dtypes (its --weight-dtype/--kv-dtype) to measure decode steps "
                        f"at, comma-separated; the first is the whole profile's, each other one a decode cluster of its "
                        f"own (about 40 s each). Default {DEFAULT_DTYPES}")
    return p


DEFAULT_DTYPES = "auto/auto,auto/int8,int8/auto"


def parse_dtype_pairs(text: str) -> list[str]:
    """"W/KV,W/KV" -> ["W/KV", ...], each checked against the decode worker's choices."""
    from pdserve.server.choices import KV_DTYPES, WEIGHT_DTYPES

    pairs = [t.strip() for t in text.split(",") if t.strip()]
    if not pairs:
        raise argparse.ArgumentTypeError("give at least one WEIGHT/KV pair, e.g. auto/auto")
    for pair in pairs:
        weight, sep, kv = pair.partition("/")
        if not sep or weight not in WEIGHT_DTYPES or kv not in KV_DTYPES:
            raise argparse.ArgumentTypeError(
                f"{pair!r}: give WEIGHT/KV with WEIGHT one of {', '.join(WEIGHT_DTYPES)} and KV one of "
                f"{', '.join(KV_DTYPES)}")
    if len(set(pairs)) != len(pairs):
        raise argparse.ArgumentTypeError(f"{text!r} names a pair twice")
    return pairs


def dtype_args(pair: str) -> list[str]:
    weight, kv = pair.split("/")
    return ["--weight-dtype", weight, "--kv-dtype", kv]


def _decode_layout(address: str) -> tuple:
    from pdserve.kvcache.layout import KvLayout
    from pdserve.server.client import list_workers

    decode = {w.role: w.info for w in list_workers(address)}["decode"]
    layout = KvLayout.from_proto(decode.kv_layout)
    return layout, decode.load.total_kv_blocks * layout.block_size


def measure_dtype(model: Path, pair: str, vocab: int, plan: ProfilePlan, max_len: int,
                  cpus: dict[str, set[int]] | None = None) -> dict:
    """The decode groups on a cluster whose decode worker runs at `pair`: {"rows", "kv_bytes_per_token",
    "kv_cache_tokens"}."""
    from pdserve.benchmarks.clients import GrpcTarget
    from pdserve.server import launcher
    from tqdm import tqdm

    log(f"decode at weight/KV dtypes {pair}: starting 1 prefill + 1 decode worker ({' '.join(dtype_args(pair))})")
    cluster = launcher.launch(model, prefill_workers=1, decode_workers=1, port=0, host="127.0.0.1",
                              prefill_args=PREFILL_ARGS, decode_args=dtype_args(pair), cpus=cpus)
    try:
        layout, cache_tokens = _decode_layout(cluster.coordinator.address)

        async def go() -> tuple[list[dict], list[dict]]:
            target = GrpcTarget(cluster.coordinator.address, timeout=300)
            pids = _pids(cluster.describe()["pids"])
            try:
                await _send(target, _synthetic(4, 16, 2, vocab, 99))
                requests = await request_rows(target, vocab, plan, max_len, pids)
                with tqdm(total=len(plan.decode_batches) * len(plan.decode_contexts), desc=f"decode {pair}",
                          unit="group", file=sys.stderr) as bar:
                    return await decode_rows(target, vocab, plan, max_len, pids, bar), requests
            finally:
                await target.close()

        rows, requests = asyncio.run(go())
    finally:
        cluster.stop()
    return {"rows": rows, "requests": requests, "kv_bytes_per_token": layout.bytes_per_token,
            "kv_cache_tokens": cache_tokens}


def dtype_rows(measured: dict[str, dict], per_resumed_token_s: float) -> dict[str, DtypeRow]:
    return {pair: DtypeRow(fit_decode(m["rows"], per_resumed_token_s, m.get("requests", [])), m["kv_bytes_per_token"],
                           m["kv_cache_tokens"]) for pair, m in measured.items()}


def main(argv: list[str] | None = None) -> int:
    from pdserve.server import launcher
    from pdserve.server.cli import default_model_dir
    from pdserve.server.model.config import load_config
    from tqdm import tqdm

    args = build_parser().parse_args(argv)
    if args.refit:
        old = Profile.load(args.refit)
        max_len = args.max_len or old.notes.get("max_len")
        if not max_len:
            raise ValueError(f"{args.refit} does not say its max model length: give --max-len")
        refit(old, max_len).save(args.out)
        print(f"profile: {args.out} (refit from {args.refit})")
        return 0
    if args.merge:
        profiles = [Profile.load(path) for path in args.merge]
        max_len = args.max_len or profiles[0].notes.get("max_len") or load_config(
            args.model or default_model_dir()).max_model_len
        merge(profiles, max_len).save(args.out)
        print(f"profile: {args.out} (the rows of {len(profiles)} profiles fitted together)")
        return 0
    plan = dataclasses.replace(QUICK if args.quick else ProfilePlan(), background_streams=args.background_streams)
    model = args.model or default_model_dir()
    config = load_config(model)
    max_len = min(config.max_model_len, 1 << 30)
    main_pair, *other_pairs = args.decode_dtypes
    chosen = pinning.placement() if args.pin else None
    cpus = pinning.launcher_cpus(chosen) if chosen else None
    if chosen:
        pinning.pin_this_process(chosen)
        log(f"pinned: {', '.join(f'{k} on core {v}' for k, v in chosen.items())}")
    log(f"starting 1 prefill + 1 decode worker on {model} at weight/KV dtypes {main_pair} (compiles first: a "
        f"minute or two)")
    cluster = launcher.launch(model, prefill_workers=1, decode_workers=1, port=0, host="127.0.0.1",
                              prefill_args=PREFILL_ARGS, decode_args=dtype_args(main_pair), cpus=cpus)
    try:
        layout, kv_cache_tokens = _decode_layout(cluster.coordinator.address)
        steps = len(plan.prefill_lengths) + 2 + len(plan.decode_batches) * len(plan.decode_contexts)
        log(f"measuring: {steps} groups of requests (KV {layout.describe()}, cache {kv_cache_tokens} tokens)")
        lengths = tuple(n for n in plan.prefill_lengths if n < max_len - 2)
        plan = dataclasses.replace(plan, prefill_lengths=lengths)
        with tqdm(total=steps, desc="plan profile", unit="group", file=sys.stderr) as bar:
            rows = asyncio.run(measure_served(cluster.coordinator.address, config.vocab_size, plan, max_len, bar,
                                              cluster.describe()["pids"]))
    finally:
        cluster.stop()
    log("KV transfer bytes/s (benchmarks/tiers.py, in-process over gRPC)")
    bw = _transfer_bytes_per_s(layout)
    log("this machine's peaks on one core (benchmarks/ceilings.py: torch matmul GFLOP/s, memcpy GB/s)")
    peak = _peaks()
    raw = args.out.with_suffix(".rows.json")  # kept until the fit is saved: a failed fit loses no measuring
    raw.parent.mkdir(parents=True, exist_ok=True)
    raw.write_text(json.dumps(rows))
    try:
        profile = fit_profile(rows, hardware=args.hardware or cpu_model(), model=model.name,
                              kv_bytes_per_token=layout.bytes_per_token, kv_cache_tokens=kv_cache_tokens,
                              transfer_bytes_per_s=bw, max_len=1 << (max_len - 1).bit_length())
    except Exception as e:
        raise RuntimeError(f"the fit of the measured rows failed ({e}); the rows are in {raw}") from e
    profile.notes["max_len"] = 1 << (max_len - 1).bit_length()
    profile.notes["peak"] = peak
    profile.notes["kind"] = "cpu"
    profile.notes["placement"] = chosen
    profile.notes["model_shape"] = _shape(config)
    profile = dataclasses.replace(profile, dtypes=main_pair)
    profile.save(args.out)  # before the other pairs: a stopped run keeps the profile's own
    raw.unlink()
    other = {}
    for pair in other_pairs:
        other[pair] = measure_dtype(model, pair, config.vocab_size, plan, max_len, cpus)
        profile.notes["dtype_rows"] = other
        profile = dataclasses.replace(profile, decode_dtypes=dtype_rows(other, profile.prefill.per_token_s))
        profile.save(args.out)
    p, d, h = profile.prefill, profile.decode, profile.handoff
    print(f"prefill step: {p.fixed_s * 1e3:.2f} ms + {p.per_token_s * 1e6:.2f} us/padded token + "
          f"{p.per_pair_s * 1e9:.3f} ns/attention pair; TTFT overhead {profile.ttft_overhead_s * 1e3:.2f} ms")
    if p.cold_after_s:
        print(f"a prefill step after {p.cold_after_s * 1e3:.0f} ms idle: x" + ", x".join(
            f"{f:.2f} at {n}" for n, f in p.cold_factors) + " padded tokens")
    print(f"decode step: {d.fixed_s * 1e3:.2f} ms + {d.per_seq_s * 1e3:.3f} ms/seq + "
          f"{d.per_context_token_s * 1e6:.3f} us/context token")
    print(f"per request beside the steps: prefill {p.per_request_s * 1e3:.2f} ms + "
          f"{p.per_request_token_s * 1e6:.2f} us/prompt token, decode {d.per_request_s * 1e3:.2f} ms + "
          f"{d.per_request_token_s * 1e6:.2f} us/prompt token")
    print(f"KV handoff: {h.fixed_s * 1e3:.2f} ms + {h.kv_bytes_per_token} B/token at {h.bytes_per_s / 1e9:.2f} GB/s")
    for pair, row in profile.decode_dtypes.items():
        print(f"decode step at {pair}: {row.decode.fixed_s * 1e3:.2f} ms + {row.decode.per_seq_s * 1e3:.3f} ms/seq + "
              f"{row.decode.per_context_token_s * 1e6:.3f} us/context token; KV {row.kv_bytes_per_token} B/token, "
              f"cache {row.kv_cache_tokens} tokens")
    c = profile.host_cpu
    print(f"host CPU: coordinator {c.coordinator.per_request_s * 1e3:.2f} ms/request + "
          f"{c.coordinator.per_token_s * 1e3:.3f} ms/token, client {c.client.per_request_s * 1e3:.2f} ms/request + "
          f"{c.client.per_token_s * 1e3:.3f} ms/token; prefill keeps {c.prefill_threads:.2f} cores busy")
    print(f"profile: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
