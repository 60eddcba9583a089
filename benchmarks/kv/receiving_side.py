"""The receiving half of benchmarks.kv.stream's transfer: what a decode worker holds, for three systems.

- "pdserve": a KvReceiver writing a PagedKvCache (`kv_push.serve_receiver`, `kv_push.CacheSink`);
- "raw grpcio": a `ceilings.LoopbackServer` that only counts the bytes;
- "grpcio + copies": a `ceilings.LoopbackServer` copying each message into its place in an array.

Start it in the event loop of the process that owns this side (the sender's own, or a process of its
own: `benchmarks.kv.receiver_process`). Per repetition:
1. `begin(system, request_id, token)` clears what the system writes (the cache, the array), registers
   the transfer (pdserve) and returns this process's CPU time (every thread);
2. the sender moves the bytes to `addresses[system]`;
3. `end(system, request_id)` returns the CPU time again and a digest of what arrived (sha256 of the
   cache's K then V, or of the array; None for raw grpcio, whose server checks only the count), which
   the sender compares with `digest()` of what it sent.
"""

from __future__ import annotations

import hashlib
import time

import numpy as np

from pdserve.benchmarks.kv import push as kv_push
from pdserve.benchmarks.ceilings import LoopbackServer
from pdserve.kvcache.layout import KvLayout

PDSERVE, RAW, COPIES = "pdserve", "raw grpcio", "grpcio + copies"
SYSTEMS = (PDSERVE, RAW, COPIES)
QWEN_05B_KV = KvLayout(24, 2, 64, 16, "bfloat16")
"""Qwen2.5-0.5B's KV: 24 layers x 2 kv heads x 64, bf16, 12 KiB a token."""


def digest(*arrays: np.ndarray) -> str:
    """sha256 of the arrays' bytes, one after the other (each C-contiguous)."""
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).view(np.uint8).data)
    return h.hexdigest()


class ReceivingSide:
    """The three systems' servers on 127.0.0.1, in this process's event loop."""

    own_process = False
    """True for benchmarks.kv.receiver_process's proxy: its CPU time is not this process's."""

    def __init__(self, layout: KvLayout, num_tokens: int, nbytes: int) -> None:
        """nbytes: what one repetition moves (the copies server's array)."""
        self.layout, self.num_tokens, self.nbytes = layout, num_tokens, nbytes
        self.addresses: dict[str, str] = {}
        self._server = None
        self._transfers: dict = {}

    async def start(self) -> ReceivingSide:
        from pdserve.kvcache.receiver import KvReceiver
        from pdserve.server.decode.kv_cache import PagedKvCache

        self.table = list(range(self.layout.num_blocks(self.num_tokens)))
        self.cache = PagedKvCache(self.layout, len(self.table))
        self.receiver = KvReceiver(self.layout, "bench", kv_push.CacheSink(self.cache, self.table))
        server, address = await kv_push.serve_receiver(self.receiver)
        self.raw = await LoopbackServer().start()
        self.copies = await LoopbackServer(copies=self.nbytes).start()
        self._server = server
        self.addresses = {PDSERVE: address, RAW: self.raw.address, COPIES: self.copies.address}
        return self

    async def begin(self, system: str, request_id: str, token: bytes) -> float:
        """Clears what `system` writes and expects its next transfer; this process's CPU seconds."""
        if system == PDSERVE:
            self.cache.k.zero_()
            self.cache.v.zero_()
            self._transfers[request_id] = self.receiver.expect(request_id, 0, token, self.num_tokens)
        elif system == COPIES:
            assert self.copies.target is not None
            self.copies.target[:] = 0
        elif system != RAW:
            raise ValueError(f"unknown system {system!r}; one of {', '.join(SYSTEMS)}")
        return time.process_time()

    async def end(self, system: str, request_id: str) -> tuple[float, str | None]:
        """(this process's CPU seconds, the digest of what arrived) once the transfer is done."""
        cpu = time.process_time()
        if system == PDSERVE:
            import torch

            await self._transfers.pop(request_id).done  # raises the receiver's TransferError
            k, v = self.cache.read(self.table, self.num_tokens)  # [L, T, Hkv, D] bf16
            return cpu, digest(*(t.contiguous().view(torch.int16).numpy() for t in (k, v)))
        if system == COPIES:
            assert self.copies.target is not None
            return cpu, digest(self.copies.target)
        return cpu, None

    async def close(self) -> None:
        if self._server is not None:
            server, self._server = self._server, None
            await server.stop(None)
            await self.raw.close()
            await self.copies.close()
