"""KV bytes one request sends over the handoff, and the decode cache's blocks it holds, for sliding-window models,
against the same model with every layer global: `python -m pdserve.benchmarks.kv.window [--json OUT]`.

Each bytes row runs the real handoff in memory (kvcache/local.py: the sender plans the pieces, the receiver's
state machine checks them and counts the bytes it stores) for a prompt of 4x the window, on two shapes:
every layer windowed (Mistral) and local/global alternating (Gemma 2). The bound checked is the issue's:
bytes sent <= the global layers' whole prompt + one window per local layer (plus the partial block the
window starts in). Each cache row runs the decode tier's real Scheduler: the blocks one sequence holds at a
context of 1-8x the window (the prompt handed over, one token decoded), and how many sequences of that
context a fixed cache admits at once. Counts bytes and blocks, not time: the same on every machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import asdict, dataclass

import numpy as np

from pdserve.kvcache.layout import KvLayout
from pdserve.kvcache.local import LocalKvTransport
from pdserve.kvcache.receiver import KvReceiver
from pdserve.kvcache.tensors import KvTensors
from pdserve.kvcache.wire import PROTOCOL_VERSION
from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.v1 import worker_pb2 as pb
from pdserve.server.decode.scheduler import Scheduler
from pdserve.server.decode.sequence import Sequence

FINGERPRINT = "window-kv"
TOKEN = b"t" * 16


@dataclass
class Row:
    shape: str
    window: int
    prompt_tokens: int
    bytes_sent: int
    bytes_all_global: int
    bound: int
    """The global layers' whole prompt + one window (rounded out to whole blocks) per local layer."""

    @property
    def ratio(self) -> float:
        return self.bytes_sent / self.bytes_all_global


@dataclass
class CacheRow:
    shape: str
    window: int
    context_tokens: int
    blocks_held: int
    """Decode-cache blocks one sequence holds at this context (its prompt handed over, one token decoded)."""
    blocks_all_global: int
    max_sequences: int
    """Sequences of this context (prompts handed over) that `cache_blocks` blocks admit at once."""
    max_sequences_all_global: int


class _Sink:
    def write(self, request_id: str, piece) -> None:
        pass


async def bytes_sent(layout: KvLayout, num_tokens: int) -> int:
    """The KV and scale bytes the receiver stores for one request of num_tokens, sent in 2 layer groups."""
    receiver = KvReceiver(layout, FINGERPRINT, _Sink())
    transport = LocalKvTransport({"d": receiver}, num_streams=2)
    transfer = receiver.expect("r", 0, TOKEN, num_tokens)
    header = pb.KvHeader(request_id="r", attempt=0, transfer_token=TOKEN, num_tokens=num_tokens,
                         fingerprint=pb.ModelFingerprint(digest=FINGERPRINT), layout=layout.to_proto(),
                         protocol_version=PROTOCOL_VERSION)
    shape = (layout.num_layers, num_tokens, layout.num_kv_heads, layout.head_dim)
    k = np.zeros(shape, layout.np_dtype)
    sender = await transport.open("d", header, layout)
    half = layout.num_layers // 2
    for start, stop in ((0, half), (half, layout.num_layers)):
        await sender.send(KvTensors(start, 0, k[start:stop], k[start:stop]))
    await sender.finish(first_token_id=0)
    await transfer.done
    await transport.close()
    return transfer.bytes_received


async def rows(windows: list[int], num_layers: int = 8, kv_heads: int = 8, head_dim: int = 128,
               block_size: int = 16, dtype: str = "bfloat16") -> list[Row]:
    out = []
    shapes = {"all windowed (Mistral)": lambda w: (w,) * num_layers,
              "local/global alternating (Gemma 2)": lambda w: tuple(w if i % 2 == 0 else 0 for i in range(num_layers))}
    for name, windows_of in shapes.items():
        for w in windows:
            n = 4 * w
            layout = KvLayout.of(num_layers, kv_heads, head_dim, block_size, dtype, windows=windows_of(w))
            full = KvLayout.of(num_layers, kv_heads, head_dim, block_size, dtype)
            per_layer_token = layout.bytes_per_token // num_layers
            local = sum(1 for x in layout.windows if x)
            window_tokens = min(n, -(-(w - 1) // block_size) * block_size + block_size)
            bound = per_layer_token * ((num_layers - local) * n + local * window_tokens)
            out.append(Row(name, w, n, await bytes_sent(layout, n), await bytes_sent(full, n), bound))
    return out


SHAPES = {"all windowed (Mistral)": lambda w, n: (w,) * n,
          "local/global alternating (Gemma 2)": lambda w, n: tuple(w if i % 2 == 0 else 0 for i in range(n))}


def _sequence(rid: str, prompt: list[int]) -> Sequence:
    sampling = gen_pb.SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True)
    return Sequence(rid, prompt, sampling, frozenset(), max_model_len=1 << 30)


def held_at(windows: tuple[int, ...], block_size: int, context: int) -> int:
    """The blocks a sequence of `context` tokens holds: its prompt (context - 1 tokens) handed over, the first
    token appended, the next step scheduled."""
    s = Scheduler(-(-context // block_size) + 1, block_size, 1, 1, enable_prefix_caching=False, windows=windows)
    seq = _sequence("r", list(range(context - 1)))
    s.add(seq)
    s.start(seq)
    seq.append(0)
    s.schedule()
    return s.blocks_held(seq)


def admitted_at(windows: tuple[int, ...], block_size: int, context: int, cache_blocks: int) -> int:
    """How many prompts of `context` tokens (handed over) a cache of cache_blocks admits at once."""
    s = Scheduler(cache_blocks, block_size, 1 << 20, 1 << 20, enable_prefix_caching=False, windows=windows)
    while True:
        seq = _sequence(f"r{len(s.loading)}", list(range(context)))
        if not s.add(seq):
            return len(s.loading)


async def cache_rows(windows: list[int], num_layers: int = 8, block_size: int = 16, cache_blocks: int = 4096,
                     multiples: tuple[int, ...] = (1, 2, 4, 8)) -> list[CacheRow]:
    out = []
    for name, windows_of in SHAPES.items():
        for w in windows:
            for m in multiples:
                n, layer_windows = m * w, windows_of(w, num_layers)
                out.append(CacheRow(name, w, n, held_at(layer_windows, block_size, n), held_at((), block_size, n),
                                    admitted_at(layer_windows, block_size, n, cache_blocks),
                                    admitted_at((), block_size, n, cache_blocks)))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, nargs="+", default=[128, 512, 1024, 4096])
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--cache-blocks", type=int, default=4096, help="the fixed decode cache (blocks of 16)")
    args = parser.parse_args(argv)
    table = asyncio.run(rows(args.windows))
    cache = asyncio.run(cache_rows(args.windows, cache_blocks=args.cache_blocks))
    print(f"{'shape':36} {'window':>7} {'prompt':>7} {'sent MiB':>9} {'all-global MiB':>15} {'ratio':>6}  <= bound")
    for r in table:
        print(f"{r.shape:36} {r.window:7d} {r.prompt_tokens:7d} {r.bytes_sent / 2**20:9.2f} "
              f"{r.bytes_all_global / 2**20:15.2f} {r.ratio:6.3f}  {r.bytes_sent <= r.bound}")
    print(f"\ndecode cache, {args.cache_blocks} blocks of 16 tokens")
    print(f"{'shape':36} {'window':>7} {'context':>8} {'blocks held':>12} {'all-global':>11} {'max seqs':>9} "
          f"{'all-global':>11}")
    for c in cache:
        print(f"{c.shape:36} {c.window:7d} {c.context_tokens:8d} {c.blocks_held:12d} {c.blocks_all_global:11d} "
              f"{c.max_sequences:9d} {c.max_sequences_all_global:11d}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bytes": [asdict(r) | {"ratio": r.ratio} for r in table],
                       "decode_cache": [asdict(c) for c in cache]}, f, indent=2)
    return 0 if all(r.bytes_sent <= r.bound for r in table) else 1


if __name__ == "__main__":
    raise SystemExit(main())
