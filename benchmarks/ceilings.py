"""This machine's ceilings, measured in the same run as the tiers they bound.

- Memory: a large float32 copy. GB/s counts read + write bytes (2 x the array) per second: the rate
  the memory system moves bytes, which a read-only stream (a decode step) can at best match.
- Matmul: fp32 n x n @ n x n, 2 n^3 flops, in JAX (the prefill tier's framework) and torch (decode's).
- gRPC loopback: client-streaming calls (one per stream, each on its own connection) to a grpc.aio
  server on 127.0.0.1 (in this process, or in a process of its own: `LoopbackServer`,
  `LoopbackClient`) carrying pre-made `bytes` messages (identity serializers, no proto): what grpcio
  alone moves, to set beside the KV transfer of the same byte count and stream count.

Every number is the best of a few timed runs after a warm-up: the machine is shared, and the best
run is the one least disturbed by other processes.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable

import grpc
import numpy as np

from pdserve.kvcache.codec import MAX_CHUNK_BYTES
from pdserve.kvcache.grpc_sender import CHANNEL_OPTIONS

GB = 1e9
_LOOPBACK_METHOD = "/pdserve.bench.Loopback/Push"


def best_time(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """The fastest of `repeats` timed calls of fn, in seconds, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def memcpy_numpy_gbps(nbytes: int, repeats: int) -> float:
    """(read + write) GB/s of np.copyto between two float32 arrays of nbytes each."""
    src = np.ones(nbytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    seconds = best_time(lambda: np.copyto(dst, src), repeats)
    return 2 * src.nbytes / seconds / GB


def memcpy_torch_gbps(nbytes: int, repeats: int) -> float:
    """(read + write) GB/s of Tensor.copy_ between two float32 CPU tensors of nbytes each (multi-threaded)."""
    import torch

    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    seconds = best_time(lambda: dst.copy_(src), repeats)
    return 2 * src.numel() * 4 / seconds / GB


def matmul_jax_gflops(n: int, repeats: int) -> float:
    """GFLOP/s of jax.jit(jnp.dot) on fp32 [n, n] @ [n, n]."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (n, n), dtype=jnp.float32)
    b = jax.random.normal(jax.random.key(1), (n, n), dtype=jnp.float32)
    dot = jax.jit(jnp.dot)
    seconds = best_time(lambda: dot(a, b).block_until_ready(), repeats)
    return 2 * n**3 / seconds / 1e9


def matmul_torch_gflops(n: int, repeats: int) -> float:
    """GFLOP/s of torch.mm on fp32 [n, n] @ [n, n]."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    out = torch.empty(n, n)
    seconds = best_time(lambda: torch.mm(a, b, out=out), repeats)
    return 2 * n**3 / seconds / 1e9


async def _push(request_iterator, context) -> bytes:
    received = 0
    async for message in request_iterator:
        received += len(message)
    return received.to_bytes(8, "little")


def _push_into(target: np.ndarray):
    """A Push handler that copies the messages into target from the call's "offset" on, as they arrive."""

    async def push(request_iterator, context) -> bytes:
        at = int(dict(context.invocation_metadata())["offset"])
        received = 0
        async for message in request_iterator:
            np.copyto(target[at + received:at + received + len(message)], np.frombuffer(message, np.uint8))
            received += len(message)
        return received.to_bytes(8, "little")

    return push


class LoopbackServer:
    """The receiving half of raw grpcio on 127.0.0.1: a grpc.aio server whose Push handler only counts the
    messages (identity serializers, no proto), or with copies=N copies each received message into its place
    in an N-byte numpy array (`target`), as a transfer of arrays must. Start it inside the event loop that
    serves the KV receiver it is set beside, in the same process or another."""

    def __init__(self, *, copies: int = 0) -> None:
        self.target = np.zeros(copies, np.uint8) if copies else None
        self._server: grpc.aio.Server | None = None
        self.address = ""

    async def start(self) -> LoopbackServer:
        push = _push if self.target is None else _push_into(self.target)
        handler = grpc.method_handlers_generic_handler(
            "pdserve.bench.Loopback", {"Push": grpc.stream_unary_rpc_method_handler(push)}
        )  # no serializers: the handler sees the wire bytes
        self._server = grpc.aio.server(options=CHANNEL_OPTIONS)
        self._server.add_generic_rpc_handlers((handler,))
        self.address = f"127.0.0.1:{self._server.add_insecure_port('127.0.0.1:0')}"
        await self._server.start()
        return self

    async def close(self) -> None:
        if self._server is not None:
            await self._server.stop(None)


class LoopbackClient:
    """The sending half of raw grpcio: `streams` client-streaming calls to a LoopbackServer at `address`,
    each on its own channel (TCP connection), carrying pre-made `bytes` messages of message_bytes.

    copies=N (for a LoopbackServer(copies=N)): each message is copied out of an N-byte numpy array
    (`source`) into `bytes` (grpcio sends only `bytes`) instead of being pre-made; seconds() then carries
    exactly those N bytes.
    """

    def __init__(self, address: str, message_bytes: int = MAX_CHUNK_BYTES, streams: int = 1, *,
                 copies: int = 0) -> None:
        self.message_bytes, self.streams = message_bytes, streams
        self._payload = os.urandom(message_bytes)
        self.source = np.random.default_rng(0).integers(0, 256, copies, np.uint8) if copies else None
        options = [*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
        self._channels = [grpc.aio.insecure_channel(address, options=options) for _ in range(streams)]

    async def seconds(self, total_bytes: int) -> float:
        """Wall time to carry total_bytes, an even share on each stream."""
        pushes = [channel.stream_unary(_LOOPBACK_METHOD) for channel in self._channels]
        n = self.streams
        shares = [total_bytes // n + (i < total_bytes % n) for i in range(n)]
        start = time.perf_counter()
        starts = [sum(shares[:i]) for i in range(n)]
        await asyncio.gather(*(self._one(push, at, share) for push, at, share in zip(pushes, starts, shares)))
        return time.perf_counter() - start

    async def _one(self, push, at: int, share: int) -> None:
        size, source = self.message_bytes, self.source
        if source is not None and at + share > len(source):
            raise ValueError(f"LoopbackClient(copies={len(source)}) carries at most {len(source)} bytes, "
                             f"not {at + share}")

        async def messages():
            for offset in range(0, share, size):
                n = min(size, share - offset)
                if source is None:
                    yield self._payload if n == size else self._payload[:n]
                else:
                    yield source[at + offset:at + offset + n].tobytes()

        reply = await push(messages(), metadata=(("offset", str(at)),))
        if (received := int.from_bytes(reply, "little")) != share:
            raise RuntimeError(f"the loopback server received {received} of {share} bytes")

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()


class GrpcLoopback:
    """Raw grpcio on 127.0.0.1 in this process, kept open between runs: a LoopbackServer and a
    LoopbackClient of `streams` calls. Start it inside the event loop the KV transfer uses, so both see
    the same grpc.aio machinery; `seconds(n)` can then alternate with it.

    copies=N adds the two copies any transfer of N bytes of arrays through grpcio must make, and nothing
    else (LoopbackClient, LoopbackServer): what a KV transport moving N bytes could reach at best.
    """

    def __init__(self, message_bytes: int = MAX_CHUNK_BYTES, streams: int = 1, *, copies: int = 0) -> None:
        self.message_bytes, self.streams, self.copies = message_bytes, streams, copies
        self.server = LoopbackServer(copies=copies)
        self.client: LoopbackClient | None = None

    async def start(self) -> GrpcLoopback:
        await self.server.start()
        self.client = LoopbackClient(self.server.address, self.message_bytes, self.streams,
                                     copies=self.copies)
        return self

    async def seconds(self, total_bytes: int) -> float:
        assert self.client is not None, "start() the loopback first"
        return await self.client.seconds(total_bytes)

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()
        await self.server.close()


async def grpc_loopback_gbps(total_bytes: int, repeats: int, message_bytes: int = MAX_CHUNK_BYTES,
                             streams: int = 1) -> float:
    """GB/s of total_bytes streamed through GrpcLoopback (by default in messages of the KV transfer's size):
    the best of `repeats` after a warm-up."""
    loopback = await GrpcLoopback(message_bytes, streams).start()
    try:
        await loopback.seconds(total_bytes)  # connects and warms up
        best = min([await loopback.seconds(total_bytes) for _ in range(repeats)], default=float("inf"))
    finally:
        await loopback.close()
    return total_bytes / best / GB
