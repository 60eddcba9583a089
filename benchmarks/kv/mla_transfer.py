"""The KV handoff of a multi-head latent attention model (DeepSeek) against a same-size model without it:
`python -m pdserve.benchmarks.kv.mla_transfer [--tokens 1024] [--repeats 5] [--json OUT]`.

Each shape is a DeepSeek layout (one latent entry of kv_lora_rank + qk_rope_head_dim values per token and layer,
no V: `KvLayout.for_model`, kind mla_latent) and its twin: a Llama of the same hidden size, layers and heads
(every head a kv head of hidden / heads dims, K and V). Both send a --tokens prompt's KV through the real path,
`GrpcKvTransport` -> `KvReceiver` -> the decode tier's `PagedKvCache` on 127.0.0.1 (one stream, one process),
alternating repetition by repetition so the ratio compares runs made moments apart; the figure is the median
wall time of the transfer (header to the receiver's done), scaled to 1k tokens. Shapes: the tiny deepseek_v3
checkpoint of the tests (fp32; built by `server/model/tiny.py`) and DeepSeek-V2-Lite's (bf16). DeepSeek-V3's is
given in bytes only (its twin's 1k tokens are 1.8 GB).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import numpy as np

from pdserve.benchmarks.kv import push as kv_push
from pdserve.kvcache.codec import kv_bytes
from pdserve.kvcache.grpc_sender import GrpcKvTransport
from pdserve.kvcache.layout import KvLayout
from pdserve.kvcache.receiver import KvReceiver


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    dtype: str

    def layouts(self, block_size: int = 16) -> tuple[KvLayout, KvLayout]:
        """(the MLA layout, the same-size Llama's)."""
        mla = KvLayout.of(self.layers, 1, self.kv_lora_rank + self.qk_rope_head_dim, block_size, self.dtype,
                          kind="mla_latent")
        return mla, KvLayout.of(self.layers, self.heads, self.hidden // self.heads, block_size, self.dtype)


V2_LITE = Shape("DeepSeek-V2-Lite", layers=27, hidden=2048, heads=16, kv_lora_rank=512, qk_rope_head_dim=64,
                dtype="bfloat16")
V3 = Shape("DeepSeek-V3", layers=61, hidden=7168, heads=128, kv_lora_rank=512, qk_rope_head_dim=64, dtype="bfloat16")


def tiny_shape() -> Shape:
    """The tests' tiny deepseek_v3 checkpoint's shape, read from its config.json."""
    from pdserve.server.model.config import load_config
    from pdserve.server.model.tiny import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        c = load_config(make_tiny_model(tmp, "deepseek_v3"))
    return Shape("tiny deepseek_v3", c.num_layers, c.hidden_size, c.num_heads, c.mla.kv_lora_rank,
                 c.mla.qk_rope_head_dim, "float32")


@dataclass
class Row:
    shape: str
    dtype: str
    mla_bytes_per_token_layer: int
    twin_bytes_per_token_layer: int
    mla_ms_per_1k_tokens: float | None
    twin_ms_per_1k_tokens: float | None
    mla_ms_spread: list[float] | None = None
    twin_ms_spread: list[float] | None = None

    @property
    def bytes_ratio(self) -> float:
        return self.twin_bytes_per_token_layer / self.mla_bytes_per_token_layer

    @property
    def time_ratio(self) -> float | None:
        return None if not self.mla_ms_per_1k_tokens else self.twin_ms_per_1k_tokens / self.mla_ms_per_1k_tokens


class _Side:
    """A KvReceiver writing a PagedKvCache of one layout, served on 127.0.0.1."""

    def __init__(self, layout: KvLayout, num_tokens: int) -> None:
        from pdserve.server.decode.kv_cache import PagedKvCache

        self.layout, self.num_tokens = layout, num_tokens
        self.table = list(range(layout.num_blocks(num_tokens)))
        self.cache = PagedKvCache(layout, len(self.table))
        self.receiver = KvReceiver(layout, "mla-bench", kv_push.CacheSink(self.cache, self.table))
        rng = np.random.default_rng(0)
        shape = (layout.num_layers, num_tokens, layout.num_kv_heads)
        self.k = rng.standard_normal((*shape, layout.head_dim), dtype=np.float32).astype(layout.np_dtype)
        self.v = rng.standard_normal((*shape, layout.value_dim), dtype=np.float32).astype(layout.np_dtype)

    async def start(self) -> _Side:
        self.server, self.address = await kv_push.serve_receiver(self.receiver)
        return self

    async def transfer_seconds(self, transport: GrpcKvTransport, request_id: str) -> float:
        token = request_id.encode().ljust(16, b"-")
        transfer = self.receiver.expect(request_id, 0, token, self.num_tokens)
        header = kv_push.header(request_id, token, "mla-bench", self.layout, self.num_tokens)
        t0 = time.perf_counter()
        await transport.send(self.address, header, self.layout, self.k, self.v, 0)
        await transfer.done
        seconds = time.perf_counter() - t0
        got, _ = self.cache.read(self.table, self.num_tokens)  # every byte arrived
        assert got.shape == self.k.shape
        return seconds

    async def stop(self) -> None:
        await self.server.stop(None)


async def measure(shape: Shape, num_tokens: int, repeats: int) -> Row:
    mla, twin = shape.layouts()
    sides = [await _Side(layout, num_tokens).start() for layout in (mla, twin)]
    transport = GrpcKvTransport(num_streams=1)
    times: list[list[float]] = [[], []]
    try:
        for i in range(repeats + 1):  # the first, a warm-up, is not counted
            for j, side in enumerate(sides if i % 2 else sides[::-1]):
                seconds = await side.transfer_seconds(transport, f"r{i}-{j}")
                if i:
                    times[sides.index(side)].append(seconds * 1000 * 1024 / num_tokens)
            print(f"  {shape.name}: repetition {i}/{repeats}", file=sys.stderr, flush=True)
    finally:
        await transport.close()
        for side in sides:
            await side.stop()
    per_layer = [kv_bytes(layout, 1) // layout.num_layers for layout in (mla, twin)]
    return Row(shape.name, shape.dtype, *per_layer, statistics.median(times[0]), statistics.median(times[1]),
               [round(min(times[0]), 2), round(max(times[0]), 2)], [round(min(times[1]), 2), round(max(times[1]), 2)])


def bytes_only(shape: Shape) -> Row:
    mla, twin = shape.layouts()
    return Row(shape.name, shape.dtype, kv_bytes(mla, 1) // mla.num_layers, kv_bytes(twin, 1) // twin.num_layers,
               None, None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    rows = [asyncio.run(measure(s, args.tokens, args.repeats)) for s in (tiny_shape(), V2_LITE)] + [bytes_only(V3)]
    print(f"{'shape':<18} {'dtype':<9} {'B/token/layer MLA':>17} {'twin':>6} {'ratio':>6} "
          f"{'ms/1k tok MLA':>13} {'twin':>8} {'ratio':>6}")
    for r in rows:
        timed = r.mla_ms_per_1k_tokens is not None
        print(f"{r.shape:<18} {r.dtype:<9} {r.mla_bytes_per_token_layer:>17} {r.twin_bytes_per_token_layer:>6} "
              f"{r.bytes_ratio:>6.1f} " + (f"{r.mla_ms_per_1k_tokens:>13.2f} {r.twin_ms_per_1k_tokens:>8.2f} "
                                           f"{r.time_ratio:>6.1f}" if timed else f"{'-':>13} {'-':>8} {'-':>6}"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dict(asdict(r), bytes_ratio=r.bytes_ratio, time_ratio=r.time_ratio) for r in rows], f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
