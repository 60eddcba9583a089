"""The KV handoff at wire speed: the transfer against raw grpcio with the receiver in a process of its own,
parallel streams, and how much of the transfer layer-wise streaming hides behind the prefill.

    python -m pdserve.benchmarks.kv.stream [--streams 1,2,4] [--tokens 2048] [--layers 24] [--groups 1,4]
        [--one-process] [--no-pin]

1. Transfer: a --tokens prompt's bf16 KV at Qwen2.5-0.5B's KV shape (24 layers x 2 kv heads x 64:
   12 KiB a token, 25 MB at 2,048 tokens) through `GrpcKvTransport(num_streams=N)` -> `KvReceiver`
   -> `PagedKvCache` on 127.0.0.1, beside raw grpcio (`ceilings.LoopbackClient` -> `LoopbackServer`:
   pre-made `bytes`, a server that only counts them) moving the same bytes in messages of the same size
   over the same number of streams, for each N in --streams; and beside "grpcio + copies", raw grpcio
   plus the two copies any array transfer through grpcio makes (array -> `bytes` message; received
   message -> array). As deployed, the receiving side of all three (`receiving_side.ReceivingSide`)
   runs in a process of its own with its own event loop (`receiver_process.ReceiverProcess`), and the
   two processes are pinned to a core each where two exist (--no-pin: free to run anywhere);
   --one-process runs both sides in this one process and event loop, as before. The three systems
   alternate repetition by repetition (`protocol.schedule`), so the ratios compare runs made moments
   apart. Every repetition's bytes are checked: the receiving process digests the cache (or array)
   and the sender compares it with the digest of what it sent. CPU s/GB is read per process (every
   thread): the sender's and the receiver's apart, or the one process's in --one-process mode.
2. Overlap: a real `PrefillEngine` + `PrefillService` on the Qwen2.5-0.5B shape (random bf16 weights,
   --layers of its 24 layers: compute and KV bytes both scale with the layers, so the fraction does
   not depend much on it) prefills one --tokens prompt and pushes its KV over gRPC (N = the largest
   --streams) to a KvReceiver writing a PagedKvCache, in this one process. Measured: prefill compute
   (the call until the first token) and the time from the first token to "KV complete at the
   receiver", for --kv-layer-groups 1 (the whole KV leaves after the whole prefill, as before
   layer-wise streaming) and each G in --groups, in the same run.
Transfer figures are median [min-max] over --repeats after a warm-up, with the machine record
(`protocol.MachineRecord`: load before, during, after); overlap figures are the best of --repeats.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from pdserve.benchmarks import ceilings, protocol
from pdserve.benchmarks.kv import push as kv_push
from pdserve.benchmarks.kv import receiver_process, receiving_side
from pdserve.kvcache.codec import MAX_CHUNK_BYTES
from pdserve.kvcache.layout import KvLayout


@dataclass
class TransferRow:
    """One stream count: each figure a spread (protocol.spread) over the alternating repetitions."""

    streams: int
    transfer_gbps: dict
    raw_gbps: dict
    ratio: dict
    """transfer / raw grpcio, repetition by repetition (the two ran back to back)."""
    copies_gbps: dict
    """grpcio plus the two copies any array transfer through it makes (LoopbackClient/Server(copies=...))."""
    copies_ratio: dict
    """transfer / grpcio + copies, repetition by repetition."""
    transfer_cpu_s_per_gb: dict
    """CPU seconds per GB moved of the sending process (every thread), both sides in --one-process mode:
    steadier than wall time on a busy machine."""
    raw_cpu_s_per_gb: dict
    copies_cpu_s_per_gb: dict
    transfer_receiver_cpu_s_per_gb: dict | None = None
    """The receiving process's CPU seconds per GB (None in --one-process mode: counted above)."""
    raw_receiver_cpu_s_per_gb: dict | None = None
    copies_receiver_cpu_s_per_gb: dict | None = None


def kv_arrays(layout: KvLayout, num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """Random k, v [L, T, Hkv, D] in the layout's dtype."""
    shape = (layout.num_layers, num_tokens, layout.num_kv_heads, layout.head_dim)  # [L, T, Hkv, D]
    rng = np.random.default_rng(0)
    return tuple(rng.standard_normal(shape, dtype=np.float32).astype(layout.np_dtype) for _ in "kv")


async def transfer(num_tokens: int, streams: list[int], repeats: int, chunk_bytes: int, *,
                   one_process: bool = False, pin: bool = True) -> list[TransferRow]:
    """pdserve's transfer and raw grpcio on the same bytes, message size and stream count, alternating.

    The receiving side (receiving_side.ReceivingSide) runs in a process of its own
    (receiver_process.ReceiverProcess), each side pinned to a core of its own when pin and two cores
    exist; one_process: in this process and event loop. Every repetition's bytes are checked at the
    receiver (a digest of the cache or array against the one of what was sent).
    """
    layout = receiving_side.QWEN_05B_KV
    k, v = kv_arrays(layout, num_tokens)
    nbytes = k.nbytes + v.nbytes
    sender_core, receiver_core = (None, None) if one_process else receiver_process.core_plan(pin)
    if one_process:
        side = await receiving_side.ReceivingSide(layout, num_tokens, nbytes).start()
    else:
        side = await receiver_process.ReceiverProcess.start(layout, num_tokens, nbytes, receiver_core)
        where = ("" if receiver_core is None
                 else f": receiver on core {receiver_core}, sender on core {sender_core}")
        print(f"  receiver process pid {side.process.pid}{where}", file=sys.stderr, flush=True)
    rows = []
    try:
        with receiver_process.pinned(sender_core):
            for n in streams:
                rows.append(await _transfer_row(side, layout, k, v, n, repeats, chunk_bytes))
    finally:
        await side.close()
    return rows


async def _transfer_row(side, layout: KvLayout, k: np.ndarray, v: np.ndarray, n: int, repeats: int,
                        chunk_bytes: int) -> TransferRow:
    from pdserve.kvcache.grpc_sender import GrpcKvTransport

    PDSERVE, RAW, COPIES = receiving_side.SYSTEMS
    num_tokens, nbytes = k.shape[1], k.nbytes + v.nbytes
    raw = ceilings.LoopbackClient(side.addresses[RAW], chunk_bytes, n)
    copies = ceilings.LoopbackClient(side.addresses[COPIES], chunk_bytes, n, copies=nbytes)
    sender = GrpcKvTransport(num_streams=n, max_chunk_bytes=chunk_bytes)
    expected = {PDSERVE: receiving_side.digest(k, v), RAW: None, COPIES: receiving_side.digest(copies.source)}

    async def push(rid: str, token: bytes) -> None:
        await sender.send(side.addresses[PDSERVE], kv_push.header(rid, token, "bench", layout, num_tokens),
                          layout, k, v, 7)

    runs = {PDSERVE: push, RAW: lambda rid, token: raw.seconds(nbytes),
            COPIES: lambda rid, token: copies.seconds(nbytes)}
    sent = 0

    async def once(name: str) -> tuple[float, float, float]:
        """(wall s, this process's CPU s, the receiving process's CPU s) of one repetition, checked."""
        nonlocal sent
        rid, token = f"bench-{n}-{sent}", os.urandom(16)
        sent += 1
        r0 = await side.begin(name, rid, token)
        c0, start = time.process_time(), time.perf_counter()
        await runs[name](rid, token)
        seconds, cpu = time.perf_counter() - start, time.process_time() - c0
        r1, got = await side.end(name, rid)
        if got != expected[name]:
            raise RuntimeError(f"{name}: the bytes at the receiver differ from the bytes sent "
                               f"(digest {got} != {expected[name]}); the transfer is broken, fix it first")
        return seconds, cpu, r1 - r0

    measured: dict[str, list[tuple[float, float, float]]] = {name: [] for name in runs}
    try:
        for name in runs:  # connect and warm up
            await once(name)
        for _, name in protocol.schedule(list(runs), repeats):
            measured[name].append(await once(name))
    finally:
        await sender.close()
        await raw.close()
        await copies.close()
    wall = {name: [m[0] for m in ms] for name, ms in measured.items()}

    def gbps(name: str) -> dict | None:
        return protocol.spread([nbytes / s / 1e9 for s in wall[name]])

    def per_gb(name: str, index: int) -> dict | None:
        return protocol.spread([m[index] / (nbytes / 1e9) for m in measured[name]])

    def ratio(reference: str) -> dict | None:
        return protocol.spread([r / p for p, r in zip(wall[PDSERVE], wall[reference])])

    receiving = side.own_process
    row = TransferRow(
        n, gbps(PDSERVE), gbps(RAW), ratio(RAW), gbps(COPIES), ratio(COPIES),
        per_gb(PDSERVE, 1), per_gb(RAW, 1), per_gb(COPIES, 1),
        *((per_gb(PDSERVE, 2), per_gb(RAW, 2), per_gb(COPIES, 2)) if receiving else (None, None, None)),
    )
    f = protocol.fmt_spread
    print(f"  {n} stream(s): transfer {f(row.transfer_gbps)} GB/s, raw grpcio {f(row.raw_gbps)} GB/s, "
          f"ratio {f(row.ratio)}; grpcio + copies {f(row.copies_gbps)} GB/s, ratio {f(row.copies_ratio)}",
          file=sys.stderr, flush=True)
    return row


class _Context:
    async def abort(self, code, details=""):
        raise RuntimeError(f"{code.name}: {details}")


async def overlap(model_dir: Path, num_tokens: int, groups: list[int], streams: int,
                  repeats: int) -> list[tuple[int, float, float]]:
    """[(layer groups, prefill compute s, first token -> KV complete s)] on the same prompt."""
    from pdserve.kvcache.layout import KvLayout
    from pdserve.kvcache.receiver import KvReceiver
    from pdserve.kvcache.grpc_sender import GrpcKvTransport
    from pdserve.v1 import generation_pb2 as gen_pb
    from pdserve.v1 import worker_pb2 as pb
    from pdserve.server.decode.kv_cache import PagedKvCache
    from pdserve.server.model.config import load_config
    from pdserve.server.model.fingerprint import fingerprint
    from pdserve.server.model.weights import load_weights
    from pdserve.server.prefill.config import PrefillConfig
    from pdserve.server.prefill.engine import PrefillEngine
    from pdserve.server.prefill.model import load_params
    from pdserve.server.prefill.service import PrefillService

    config = load_config(model_dir)
    params = load_params(config, load_weights(model_dir), dtype=config.dtype)
    digest = fingerprint(model_dir, config)
    layout = KvLayout(config.num_layers, config.num_kv_heads, config.head_dim, 16, config.dtype)
    table = list(range(layout.num_blocks(num_tokens)))
    cache = PagedKvCache(layout, len(table))
    receiver = KvReceiver(layout, digest, kv_push.CacheSink(cache, table))
    server, address = await kv_push.serve_receiver(receiver)
    ids = np.random.default_rng(1).integers(10, config.vocab_size, num_tokens).tolist()
    greedy = gen_pb.SamplingParams(max_tokens=2, temperature=0.0, top_p=1.0)
    rows = []
    try:
        for g in groups:
            engine = PrefillEngine(config, params, PrefillConfig(model_dir=model_dir, kv_layer_groups=g,
                                                                 min_bucket=num_tokens, prefix_cache_bytes=0))
            transport = GrpcKvTransport(num_streams=streams)
            service = PrefillService(engine, transport, config, fingerprint=digest)
            best = (float("inf"), float("inf"))
            for attempt in range(repeats + 1):  # the first compiles
                rid, token = f"overlap-{g}-{attempt}", os.urandom(16)
                transfer = receiver.expect(rid, 0, token, num_tokens)
                request = pb.PrefillRequest(request_id=rid, token_ids=ids, sampling=greedy, transfer_token=token,
                                            target=pb.KvTarget(address=address, layout=layout.to_proto()))
                t0 = time.perf_counter()
                await service.Prefill(request, _Context())
                t_first = time.perf_counter()
                await transfer.done
                t_done = time.perf_counter()
                await asyncio.gather(*service.pushes)
                if attempt and t_done - t_first < best[1]:
                    best = (t_first - t0, t_done - t_first)
            await transport.close()
            rows.append((g, *best))
            print(f"  {g} layer group(s): prefill {best[0] * 1e3:.0f} ms, first token -> KV complete "
                  f"{best[1] * 1e3:.1f} ms ({best[1] / best[0]:.3f})", file=sys.stderr, flush=True)
    finally:
        await server.stop(None)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.benchmarks.kv.stream", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", default="1,2,4")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--layers", type=int, default=24, help="of Qwen2.5-0.5B's 24, for the overlap part")
    p.add_argument("--groups", default="4", help="layer groups to compare with 1")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--chunk-bytes", type=int, default=MAX_CHUNK_BYTES,
                   help="message size of both the transfer and raw grpcio (default: the transfer's)")
    p.add_argument("--model-dir", type=Path, help="where the random Qwen-shape checkpoint is kept")
    p.add_argument("--one-process", action="store_true",
                   help="run the receiving side in this process and event loop too "
                        "(default: a process of its own)")
    p.add_argument("--no-pin", action="store_true",
                   help="leave both processes free to run on any core "
                        "(default: one core each where two exist)")
    p.add_argument("--skip-overlap", action="store_true")
    p.add_argument("--max-load", type=float, default=2.0, help="refuse to run above this 1-minute load average")
    p.add_argument("--allow-noisy", action="store_true", help="run on a busy machine, marking the result noisy")
    p.add_argument("--json", type=Path, help="also write the rows and the machine record here")
    args = p.parse_args(argv)
    import uvloop  # what every pdserve process runs on

    from pdserve.benchmarks.checkpoint import make_qwen25_05b_shape

    streams = [int(x) for x in args.streams.split(",")]
    groups = [1, *(int(x) for x in args.groups.split(",") if int(x) != 1)]
    record = protocol.MachineRecord.take()
    protocol.gate(record, args.max_load, args.allow_noisy)
    with protocol.LoadMonitor() as monitor:
        print(f"transfer vs raw grpcio ({args.chunk_bytes}-byte messages, {args.repeats} alternating "
              f"repetitions, {'one process' if args.one_process else 'sender and receiver processes'}):",
              file=sys.stderr, flush=True)
        moved = uvloop.run(transfer(args.tokens, streams, args.repeats, args.chunk_bytes,
                                    one_process=args.one_process, pin=not args.no_pin))
        hidden = []
        if not args.skip_overlap:
            model_dir = args.model_dir or Path(tempfile.gettempdir()) / f"pdserve-qwen-shape-{args.layers}l"
            make_qwen25_05b_shape(model_dir, "bfloat16", num_hidden_layers=args.layers)
            print(f"overlap ({args.layers} layers, {args.tokens} tokens, {max(streams)} stream(s)):", file=sys.stderr)
            hidden = uvloop.run(overlap(model_dir, args.tokens, groups, max(streams), args.repeats))
    record.finish(monitor)
    f = protocol.fmt_spread
    one = moved[0].transfer_gbps["median"]
    print(record.markdown())
    print()
    print("Median [min-max] over the repetitions; transfer / raw is taken repetition by repetition.")
    print()
    two = moved[0].transfer_receiver_cpu_s_per_gb is not None
    cpu_heads = "CPU s/GB (both sides): transfer, raw, + copies"
    if two:
        cpu_heads = "CPU s/GB sender: transfer, raw, + copies | CPU s/GB receiver: transfer, raw, + copies"
    print("| streams | transfer GB/s | raw grpcio GB/s | transfer / raw | grpcio + copies GB/s | "
          f"transfer / (grpcio + copies) | transfer / 1-stream transfer | {cpu_heads} |")
    print("| ---: " * (9 if two else 8) + "|")
    for r in moved:
        cpu = f"{f(r.transfer_cpu_s_per_gb)}, {f(r.raw_cpu_s_per_gb)}, {f(r.copies_cpu_s_per_gb)}"
        if two:
            cpu += (f" | {f(r.transfer_receiver_cpu_s_per_gb)}, {f(r.raw_receiver_cpu_s_per_gb)}, "
                    f"{f(r.copies_receiver_cpu_s_per_gb)}")
        print(f"| {r.streams} | {f(r.transfer_gbps)} | {f(r.raw_gbps)} | **{f(r.ratio)}** | {f(r.copies_gbps)} | "
              f"{f(r.copies_ratio)} | {r.transfer_gbps['median'] / one:.2f} | {cpu} |")
    if hidden:
        print()
        print("| layer groups | prefill compute (ms) | first token -> KV complete (ms) | fraction of compute |")
        print("| ---: | ---: | ---: | ---: |")
        for g, compute, tail in hidden:
            print(f"| {g} | {compute * 1e3:.0f} | {tail * 1e3:.1f} | {tail / compute:.3f} |")
    if args.json:
        args.json.write_text(json.dumps({
            "chunk_bytes": args.chunk_bytes, "tokens": args.tokens, "machine": record.as_dict(),
            "one_process": args.one_process, "pinned": not args.no_pin and not args.one_process,
            "transfer": [asdict(r) for r in moved],
            "overlap": [{"layer_groups": g, "compute_s": c, "tail_s": t} for g, c, t in hidden],
        }, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
