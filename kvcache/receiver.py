"""The decode side of the KV transfer: one state machine per request, fed by a transport's streams.

Life of a transfer:
1. The decode worker reserves blocks and calls `expect(id, attempt, token, num_tokens)`: WAITING.
   No lease clock runs yet: the prompt may still queue in the prefill tier.
2. The prefill worker begins the request: `begin(header)` (BeginKv), then its streams (1..N) each
   `receive(chunks)` (PushKv), each opening with the header. Strangers are refused without touching
   the transfer: unknown id, an attempt other than the expected one, a missing or wrong token, a
   stream index already open.
3. The authenticated header passes the handshake (protocol version, model fingerprint, layout,
   length, stream count): TRANSFERRING. The lease (`Transfer.wait`) starts at the first accepted
   header and restarts with every chunk.
4. Each KvBlocks piece is checked (place, sizes, no overlap across all streams) and written by the
   sink in a worker thread, off the event loop. The stream reads on while up to WRITES_IN_FLIGHT of
   its pieces are being written (the next message crosses the wire while the last one is copied into
   the cache); KvEnd counts only once every piece of the stream is written.
5. KvEnd on every stream once every layer of every token has arrived, then the streams close: DONE,
   and `done` resolves to the first token. Any refusal after step 2, or a KvAbort from the prefill
   worker: FAILED, every stream of the transfer is cut, and `done` raises TransferError.
`cancel()` or a newer attempt's `expect()` makes it CANCELLED; running streams are cut off at once
(ABORTED) and never write again; `settle(id)` waits for a write already running in its thread.
Call every method from the event loop the transport runs on.

A refusal is a `Refusal`: words naming both sides and the fix, and a `Status`. The gRPC servicer
(kvcache.grpc_receiver) answers it with the status code of that name; the in-memory transport
(kvcache.local) hands it to its sender as the same error. This module knows no gRPC.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import enum
import hmac
import time
from collections.abc import AsyncIterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from pdserve.kvcache.codec import KvPiece, decode_blocks
from pdserve.kvcache.layout import HandshakeError, KvLayout, check_handshake
from pdserve.kvcache.wire import PROTOCOL_VERSION
from pdserve.v1 import worker_pb2 as pb

if TYPE_CHECKING:
    from grpc import StatusCode

WRITE_THREADS = 4
"""Threads writing received pieces into the cache (numpy/torch copies release the GIL)."""
WRITES_IN_FLIGHT = 4
"""Pieces of one stream written at once while it reads on: what a stream holds beyond the message it reads."""


class KvSink(Protocol):
    def write(self, request_id: str, piece: KvPiece) -> None:
        """Copies the piece into the paged cache; the piece's arrays are read-only views."""


class TransferState(enum.Enum):
    WAITING = "waiting"
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


class Status(enum.Enum):
    """How a refusal is answered, named as the gRPC status code it maps to (kvcache.grpc_receiver)."""

    INVALID_ARGUMENT = "invalid_argument"
    """A malformed header, piece or stream."""
    NOT_FOUND = "not_found"
    """No transfer of that request id, or of that attempt, is expected here."""
    ALREADY_EXISTS = "already_exists"
    """The stream (or BeginKv) was sent twice."""
    PERMISSION_DENIED = "permission_denied"
    """A missing or wrong transfer token."""
    FAILED_PRECONDITION = "failed_precondition"
    """Another protocol version, model or KV layout."""
    ABORTED = "aborted"
    """The attempt is stale or was cancelled here, or the prefill worker gave it up."""
    CANCELLED = "cancelled"
    """The stream's call was cancelled before KvEnd."""
    INTERNAL = "internal"
    """The cache could not store a piece, or the receiver failed."""


class Refusal(Exception):
    """Why the receiver turned a header or a stream away, in words naming both sides and the fix.

    fails: the transfer this refusal fails (FAILED, its other streams cut); None when the sender is a
    stranger to the transfer (unknown id, other attempt, wrong token), which is then left as it was.
    """

    def __init__(self, status: Status, message: str, fails: Transfer | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.fails = fails


class TransferError(Exception):
    """Why a transfer failed: the status and words of the refusal that failed it."""

    def __init__(self, status: Status, message: str) -> None:
        super().__init__(message)
        self.status = status

    @property
    def code(self) -> StatusCode:
        """The gRPC status code the transfer's stream was refused with, for callers that report it."""
        from pdserve.kvcache.grpc_receiver import status_code  # gRPC only where asked for

        return status_code(self.status)


def _new_future() -> asyncio.Future[int]:
    return asyncio.get_running_loop().create_future()


def _adapter(lora_name: str) -> str:
    return f"LoRA adapter {lora_name!r}" if lora_name else "the base model"


@dataclass(eq=False)
class Transfer:
    request_id: str
    attempt: int
    token: bytes = field(repr=False)
    num_tokens: int
    state: TransferState = TransferState.WAITING
    bytes_received: int = 0
    """KV and scale bytes written to the sink."""
    done: asyncio.Future[int] = field(default_factory=_new_future, repr=False)
    """The first token id once every layer of every token has arrived; TransferError on failure."""
    started_at: float | None = None
    """time.monotonic() when the first stream's header was accepted: the prefill worker began."""
    finished_at: float | None = None
    last_activity: float | None = None
    """time.monotonic() of the last accepted header or chunk: the lease counts from here."""
    num_streams: int = 0
    """The streams the sender announced (0 before the first header)."""
    covered: np.ndarray | None = field(default=None, repr=False)
    """[L, num_blocks] bool: (layer, block) cells received, over all streams."""
    stream_indexes: set[int] = field(default_factory=set, repr=False)
    ended: int = 0
    """Streams that sent KvEnd."""
    closed: int = 0
    """Streams that closed after KvEnd (all their pieces written)."""
    first_token_id: int | None = None
    started: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    cached_blocks: int = 0
    """Leading blocks the decode worker holds already (prefix cache); no stream sends them."""
    lora_name: str = ""
    """The LoRA adapter the KV must have been computed with ("": the base model)."""

    @property
    def seconds(self) -> float:
        """From the accepted header to DONE/FAILED/CANCELLED (or now); 0 before a stream starts."""
        if self.started_at is None:
            return 0.0
        return (self.finished_at or time.monotonic()) - self.started_at

    async def wait(self, lease: float) -> int:
        """The first token id once all the KV is in (TransferError if the transfer failed).

        No clock runs until the prefill worker begins the request (its header arrives): before that
        only the caller's deadline bounds the wait. From then on TimeoutError once `lease` seconds
        pass without a chunk.
        """
        while not self.done.done():
            if self.last_activity is None:
                started = asyncio.ensure_future(self.started.wait())
                try:
                    await asyncio.wait([self.done, started], return_when=asyncio.FIRST_COMPLETED)
                finally:
                    started.cancel()
                continue
            remaining = self.last_activity + lease - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no KV for {self.request_id} within the {lease:.1f} s lease")
            await asyncio.wait([self.done], timeout=remaining)
        return self.done.result()

    def touch(self) -> None:
        self.last_activity = time.monotonic()


@dataclass(eq=False)
class _Stream:
    """An authenticated PushKv call now feeding a transfer."""

    transfer: Transfer
    task: asyncio.Task
    index: int
    reading: bool = False
    cut: tuple[Status, str] | None = None
    writes: collections.deque = field(default_factory=collections.deque)
    """(future, piece bytes, where) of the pieces submitted to the pool and not yet checked, oldest first."""

    def cut_off(self, status: Status, message: str) -> None:
        """Stops the stream before it writes again; wakes it if it waits for the next chunk."""
        if self.cut is None:
            self.cut = (status, message)
            if self.reading:
                self.task.cancel()


class KvReceiver:
    def __init__(self, layout: KvLayout, fingerprint: str, sink: KvSink, *, write_threads: int = WRITE_THREADS):
        self.layout = layout
        self.fingerprint = fingerprint
        self.sink = sink
        self._transfers: dict[str, Transfer] = {}  # waiting or transferring, by request id
        self._streams: dict[str, list[_Stream]] = {}
        self._writes: dict[str, set[concurrent.futures.Future]] = {}  # running in the pool, by request id
        self._pool = concurrent.futures.ThreadPoolExecutor(write_threads, thread_name_prefix="kv-write")

    def expect(self, request_id: str, attempt: int, transfer_token: bytes, num_tokens: int,
               cached_blocks: int = 0, lora_name: str = "") -> Transfer:
        """Registers a transfer; a higher attempt replaces the old one and cuts off its stream.

        cached_blocks: leading blocks already held; their KV must not be sent. lora_name: the LoRA adapter the KV
        must have been computed with ("": the base model); a header naming another is refused.
        """
        if not transfer_token:
            raise ValueError(f"request {request_id!r}: a transfer token is required")
        if num_tokens < 0:
            raise ValueError(f"request {request_id!r}: num_tokens must be >= 0, got {num_tokens}")
        old = self._transfers.get(request_id)
        if old is not None:
            if attempt <= old.attempt:
                raise ValueError(
                    f"request {request_id!r}: attempt {attempt} is not newer than the expected "
                    f"attempt {old.attempt}"
                )
            self._cancel(
                old,
                f"request {request_id!r} attempt {old.attempt} was superseded by attempt {attempt}; "
                "its KV is discarded, stop sending it",
            )
        if not 0 <= cached_blocks <= self.layout.num_blocks(num_tokens):
            raise ValueError(f"request {request_id!r}: {cached_blocks} cached blocks, more than the prompt has")
        transfer = Transfer(request_id, attempt, bytes(transfer_token), num_tokens,
                            cached_blocks=cached_blocks, lora_name=lora_name)
        self._transfers[request_id] = transfer
        return transfer

    def cancel(self, request_id: str) -> None:
        """Forgets the request's transfer (no-op when unknown); a running stream gets ABORTED."""
        transfer = self._transfers.get(request_id)
        if transfer is not None:
            self._cancel(
                transfer, f"request {request_id!r} was cancelled on the decode worker; stop sending its KV"
            )

    def pending(self) -> int:
        """Transfers waiting for or receiving their KV."""
        return len(self._transfers)

    async def settle(self, request_id: str) -> None:
        """Returns once no write of the request runs in the pool (call before freeing its blocks)."""
        running = self._writes.get(request_id)
        if running:
            await asyncio.wait([asyncio.wrap_future(f) for f in list(running)])

    def begin(self, header: pb.KvHeader) -> Transfer:
        """The prefill worker begins the request (BeginKv): checks the header and starts the lease."""
        try:
            transfer = self._accept(header)
        except Refusal as refusal:
            self._fail_by(refusal)
            raise
        if transfer.state is not TransferState.WAITING:
            raise _sent_twice(transfer)
        self._start(transfer, header)
        return transfer

    async def receive(self, chunks: AsyncIterable[pb.KvChunk]) -> pb.PushKvResponse:
        """One stream of a transfer (a PushKv call): its header, pieces and KvEnd; the answer once the
        transfer is DONE. Raises Refusal; one after the header is accepted fails the whole transfer."""
        chunks = aiter(chunks)
        stream: _Stream | None = None
        try:
            first = await anext(chunks, None)
            if first is None or first.WhichOneof("part") != "header":
                got = "nothing" if first is None else (first.WhichOneof("part") or "an empty KvChunk")
                raise Refusal(
                    Status.INVALID_ARGUMENT, f"a PushKv stream must start with a KvHeader, got {got}"
                )
            stream = self._admit(first.header)
            await self._receive(stream, chunks)
            return await self._settled(stream)
        except Refusal as refusal:
            self._fail_by(refusal)
            raise
        except asyncio.CancelledError:
            if stream is not None and stream.cut is not None:  # cut off by cancel() or a newer attempt
                stream.task.uncancel()
                raise Refusal(*stream.cut) from None
            if stream is not None:
                self._fail(stream.transfer, Status.CANCELLED, "the PushKv call was cancelled before KvEnd")
            raise
        except Exception as e:  # a bug here must not leave the decode worker waiting forever
            if stream is not None:
                self._fail(stream.transfer, Status.INTERNAL, f"the decode worker failed receiving KV: {e!r}")
            raise
        finally:
            if stream is not None:
                self._drop(stream)

    async def _settled(self, stream: _Stream) -> pb.PushKvResponse:
        """The last stream to close finishes the transfer; the others wait for its outcome."""
        transfer = stream.transfer
        transfer.closed += 1
        if transfer.closed == transfer.num_streams:
            assert transfer.first_token_id is not None
            return self._finish(transfer)
        stream.reading = True  # a cut wakes it
        try:
            await asyncio.wait([transfer.done])
        finally:
            stream.reading = False
        if stream.cut is not None:
            raise Refusal(*stream.cut)
        if transfer.done.cancelled():
            raise Refusal(Status.ABORTED, f"request {transfer.request_id!r} was cancelled on the decode worker")
        error = transfer.done.exception()
        if isinstance(error, TransferError):
            raise Refusal(error.status, str(error))
        return self._response(transfer)

    def _admit(self, header: pb.KvHeader) -> _Stream:
        transfer = self._accept(header)
        index = header.stream_index
        if index in transfer.stream_indexes:
            raise _sent_twice(transfer)
        self._start(transfer, header)
        transfer.stream_indexes.add(index)
        stream = _Stream(transfer, asyncio.current_task(), index)  # type: ignore[arg-type]
        self._streams.setdefault(transfer.request_id, []).append(stream)
        return stream

    def _accept(self, header: pb.KvHeader) -> Transfer:
        """The transfer the header authenticates for, once it passes the handshake; else a refusal."""
        request_id, attempt = header.request_id, header.attempt
        transfer = self._transfers.get(request_id)
        if transfer is None:
            raise Refusal(
                Status.NOT_FOUND,
                f"no KV transfer is expected for request {request_id!r} on this "
                "decode worker (finished, cancelled, timed out or never registered)",
            )
        if attempt < transfer.attempt:
            raise Refusal(
                Status.ABORTED,
                f"request {request_id!r} attempt {attempt} is stale: the decode worker "
                f"expects attempt {transfer.attempt}; stop sending it",
            )
        if attempt > transfer.attempt:
            raise Refusal(
                Status.NOT_FOUND,
                f"request {request_id!r} attempt {attempt} is not expected: the decode "
                f"worker expects attempt {transfer.attempt}",
            )
        if not header.transfer_token:
            raise Refusal(
                Status.PERMISSION_DENIED,
                f"request {request_id!r}: the header carries no transfer token; "
                "send the token the coordinator issued",
            )
        if not hmac.compare_digest(header.transfer_token, transfer.token):
            raise Refusal(
                Status.PERMISSION_DENIED,
                f"request {request_id!r}: wrong transfer token; send the token "
                "the coordinator issued for this attempt",
            )
        if header.protocol_version != PROTOCOL_VERSION:
            raise Refusal(
                Status.FAILED_PRECONDITION,
                f"KV protocol version mismatch: the prefill worker speaks version {header.protocol_version}"
                f"{' (unversioned)' if not header.protocol_version else ''}, this decode worker "
                f"{PROTOCOL_VERSION}; run the same pdserve release on both tiers",
                transfer,
            )
        try:
            theirs = KvLayout.from_proto(header.layout)
        except ValueError as e:
            raise Refusal(
                Status.INVALID_ARGUMENT, f"the header's KV layout is invalid: {e}", transfer
            ) from None
        try:
            check_handshake(
                self.layout, self.fingerprint, theirs, header.fingerprint.digest, peer="prefill worker"
            )
        except HandshakeError as e:
            raise Refusal(Status.FAILED_PRECONDITION, str(e), transfer) from None
        if header.lora_name != transfer.lora_name:
            raise Refusal(
                Status.FAILED_PRECONDITION,
                f"request {request_id!r}: the KV was computed with {_adapter(header.lora_name)}, this decode worker "
                f"decodes it with {_adapter(transfer.lora_name)}; KV belongs to its adapter: prefill with the same one",
                transfer,
            )
        if header.num_tokens != transfer.num_tokens:
            raise Refusal(
                Status.INVALID_ARGUMENT,
                f"request {request_id!r}: the header says {header.num_tokens} "
                f"tokens, the decode worker expects {transfer.num_tokens}; "
                "send the prompt's true length",
                transfer,
            )
        num_streams = header.num_streams or 1
        if header.stream_index >= num_streams:
            raise Refusal(
                Status.INVALID_ARGUMENT,
                f"stream index {header.stream_index} is outside the {num_streams} streams",
                transfer,
            )
        if transfer.num_streams and num_streams != transfer.num_streams:
            raise Refusal(
                Status.INVALID_ARGUMENT,
                f"request {request_id!r}: a stream announces {num_streams} streams, an earlier header "
                f"{transfer.num_streams}",
                transfer,
            )
        if header.cached_blocks != transfer.cached_blocks:
            raise Refusal(
                Status.INVALID_ARGUMENT,
                f"request {request_id!r}: the header skips {header.cached_blocks} cached blocks, the decode "
                f"worker holds {transfer.cached_blocks}; send every block after the ones it holds",
                transfer,
            )
        return transfer

    def _start(self, transfer: Transfer, header: pb.KvHeader) -> None:
        """The prefill worker began: TRANSFERRING, and the lease runs from now."""
        if transfer.state is TransferState.WAITING:
            transfer.state = TransferState.TRANSFERRING
            transfer.started_at = time.monotonic()
            transfer.num_streams = header.num_streams or 1
            transfer.covered = np.zeros(
                (self.layout.num_layers, self.layout.num_blocks(transfer.num_tokens)), dtype=bool
            )
            transfer.covered[:, : transfer.cached_blocks] = True  # held already: a piece there overlaps
            for layer, stale in enumerate(self.layout.stale_tokens(transfer.num_tokens)):
                transfer.covered[layer, : stale // self.layout.block_size] = True  # behind its window: never sent
            transfer.started.set()
        transfer.touch()

    async def _receive(self, stream: _Stream, chunks) -> None:
        """Writes every piece of this stream; returns once KvEnd came and the stream closed.

        A malformed stream is refused once the pieces it sent before are written (so what a refused
        stream wrote is exactly what preceded the fault); a KvAbort drops the pieces still queued.
        """
        try:
            await self._read(stream, chunks)
        except Refusal as refusal:
            if refusal.status is not Status.ABORTED:
                with contextlib.suppress(Refusal):
                    await self._drain(stream, 0)
            raise

    async def _read(self, stream: _Stream, chunks) -> None:
        transfer = stream.transfer
        first_token_id: int | None = None
        while True:
            stream.reading = True
            try:
                chunk = await anext(chunks, None)
            finally:
                stream.reading = False
            if stream.cut is not None:
                raise Refusal(*stream.cut)
            if chunk is None:
                break
            transfer.touch()
            part = chunk.WhichOneof("part")
            if first_token_id is not None:
                raise Refusal(
                    Status.INVALID_ARGUMENT,
                    f"{part or 'an empty KvChunk'} after KvEnd; KvEnd is last",
                    transfer,
                )
            if part == "blocks":
                await self._write(stream, chunk.blocks)
            elif part == "end":
                first_token_id = chunk.end.first_token_id
                await self._drain(stream, 0)  # KvEnd counts once every piece of the stream is in the cache
                self._end(stream, first_token_id)
            elif part == "abort":
                raise Refusal(
                    Status.ABORTED,
                    f"the prefill worker gave up request {transfer.request_id!r} attempt {transfer.attempt}: "
                    f"{chunk.abort.reason}",
                    transfer,
                )
            elif part == "header":
                raise Refusal(
                    Status.INVALID_ARGUMENT, "a second KvHeader; one stream carries one transfer", transfer
                )
            else:
                raise Refusal(Status.INVALID_ARGUMENT, "an empty KvChunk", transfer)
        if first_token_id is None:
            raise Refusal(
                Status.INVALID_ARGUMENT,
                f"request {transfer.request_id!r}: the stream ended before KvEnd "
                "(the prefill worker closed or cancelled it)",
                transfer,
            )

    def _end(self, stream: _Stream, first_token_id: int) -> None:
        transfer = stream.transfer
        if transfer.first_token_id is not None and transfer.first_token_id != first_token_id:
            raise Refusal(
                Status.INVALID_ARGUMENT,
                f"request {transfer.request_id!r}: stream {stream.index} ends with first token {first_token_id}, "
                f"an earlier stream with {transfer.first_token_id}",
                transfer,
            )
        transfer.first_token_id = first_token_id
        transfer.ended += 1
        if transfer.ended == transfer.num_streams:
            self._check_complete(transfer)

    async def _write(self, stream: _Stream, msg: pb.KvBlocks) -> None:
        transfer, bs = stream.transfer, self.layout.block_size
        try:
            piece = decode_blocks(self.layout, msg)
        except ValueError as e:
            raise Refusal(Status.INVALID_ARGUMENT, str(e), transfer) from None
        token_end = msg.token_start + msg.token_count
        where = f"piece layers {msg.layer_start}+{msg.layer_count} tokens {msg.token_start}+{msg.token_count}"
        if token_end > transfer.num_tokens:
            raise Refusal(
                Status.INVALID_ARGUMENT,
                f"{where} ends past the prompt's {transfer.num_tokens} tokens",
                transfer,
            )
        if msg.token_count % bs and token_end != transfer.num_tokens:
            raise Refusal(
                Status.INVALID_ARGUMENT, f"{where} ends inside a block; only the last piece may", transfer
            )
        assert transfer.covered is not None
        cells = transfer.covered[msg.layer_start : msg.layer_start + msg.layer_count,
                                 msg.token_start // bs : -(-token_end // bs)]  # fmt: skip
        if cells.any():
            raise Refusal(Status.INVALID_ARGUMENT, f"{where} overlaps KV already received", transfer)
        cells[...] = True  # now: another stream's overlapping piece is refused while this one is written
        running = self._pool.submit(self._write_unless_cut, stream, piece)
        self._writes.setdefault(transfer.request_id, set()).add(running)
        loop = asyncio.get_running_loop()
        running.add_done_callback(lambda f: _on_loop(loop, self._written, transfer.request_id, f))
        stream.writes.append((running, piece.nbytes, where))
        await self._drain(stream, WRITES_IN_FLIGHT - 1)

    def _write_unless_cut(self, stream: _Stream, piece: KvPiece) -> None:
        """Runs in a writing thread: a stream cut off, or a transfer failed or cancelled, meanwhile
        writes nothing more (its pieces still queued are dropped)."""
        if stream.cut is None and stream.transfer.state is TransferState.TRANSFERRING:
            self.sink.write(stream.transfer.request_id, piece)

    async def _drain(self, stream: _Stream, keep: int) -> None:
        """Waits until at most `keep` of the stream's pieces are being written; a failed write refuses."""
        transfer = stream.transfer
        while stream.writes and (len(stream.writes) > keep or stream.writes[0][0].done()):
            running, nbytes, where = stream.writes[0]
            try:
                if not running.done():
                    await asyncio.wrap_future(running)
                running.result()
            except Exception as e:  # the decode tier's cache refused the piece
                raise Refusal(
                    Status.INTERNAL, f"the decode worker could not store {where}: {e!r}", transfer
                ) from e
            stream.writes.popleft()
            transfer.bytes_received += nbytes

    def _written(self, request_id: str, running: concurrent.futures.Future) -> None:
        """Forgets a finished write, on the event loop like every other use of `_writes`. (It ran in the
        writing thread: a thread that emptied the request's set and dropped it while the loop added the next
        write to that same set lost that write, and `settle` returned while it still ran, issue 38.)"""
        writes = self._writes.get(request_id)
        if writes is not None:
            writes.discard(running)
            if not writes:
                self._writes.pop(request_id, None)

    def _check_complete(self, transfer: Transfer) -> None:
        assert transfer.covered is not None
        missing_layers, missing_blocks = np.nonzero(~transfer.covered)
        if len(missing_layers):
            bs = self.layout.block_size
            layer, block = int(missing_layers[0]), int(missing_blocks[0])
            last_token = min((block + 1) * bs, transfer.num_tokens) - 1
            raise Refusal(
                Status.INVALID_ARGUMENT,
                f"request {transfer.request_id!r}: KvEnd before all KV arrived: {len(missing_layers)} of "
                f"{transfer.covered.size} (layer, block) cells missing, the first at layer {layer} tokens "
                f"{block * bs}..{last_token}; send every layer of every token before KvEnd",
                transfer,
            )

    def _finish(self, transfer: Transfer) -> pb.PushKvResponse:
        self._forget(transfer)
        transfer.state = TransferState.DONE
        transfer.finished_at = time.monotonic()
        if not transfer.done.done():
            transfer.done.set_result(transfer.first_token_id)
        return self._response(transfer)

    @staticmethod
    def _response(transfer: Transfer) -> pb.PushKvResponse:
        return pb.PushKvResponse(tokens_received=transfer.num_tokens, bytes_received=transfer.bytes_received)

    def _fail_by(self, refusal: Refusal) -> None:
        if refusal.fails is not None:
            self._fail(refusal.fails, refusal.status, refusal.message)

    def _fail(self, transfer: Transfer, status: Status, message: str) -> None:
        if self._transfers.get(transfer.request_id) is not transfer:
            return  # already superseded or cancelled
        for stream in self._streams.get(transfer.request_id, []):
            if stream.transfer is transfer and stream.task is not asyncio.current_task():
                stream.cut_off(status, message)
        self._forget(transfer)
        transfer.state = TransferState.FAILED
        transfer.finished_at = time.monotonic()
        if not transfer.done.done():
            transfer.done.set_exception(TransferError(status, message))

    def _cancel(self, transfer: Transfer, reason: str) -> None:
        for stream in self._streams.get(transfer.request_id, []):
            if stream.transfer is transfer:
                stream.cut_off(Status.ABORTED, reason)
        self._forget(transfer)
        transfer.state = TransferState.CANCELLED
        transfer.finished_at = time.monotonic()
        transfer.done.cancel()

    def _forget(self, transfer: Transfer) -> None:
        if self._transfers.get(transfer.request_id) is transfer:
            del self._transfers[transfer.request_id]

    def _drop(self, stream: _Stream) -> None:
        streams = self._streams.get(stream.transfer.request_id, [])
        if stream in streams:
            streams.remove(stream)
        if not streams:
            self._streams.pop(stream.transfer.request_id, None)


def _on_loop(loop: asyncio.AbstractEventLoop, callback, *args) -> None:
    """Calls back on the loop from any thread; nothing once the loop is closed (nobody waits any more)."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(callback, *args)


def _sent_twice(transfer: Transfer) -> Refusal:
    return Refusal(
        Status.ALREADY_EXISTS,
        f"request {transfer.request_id!r} attempt {transfer.attempt} already has a running stream; "
        "send each attempt once",
    )
