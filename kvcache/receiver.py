"""The decode side of the KV transfer: one state machine per request behind KvTransfer.PushKv.

Life of a transfer:
1. The decode worker reserves blocks and calls `expect(id, attempt, token, num_tokens)`: WAITING.
2. A prefill worker opens PushKv with a header. Strangers are refused without touching the transfer:
   unknown id, an attempt other than the expected one, a missing or wrong token, a duplicate stream.
3. The authenticated header passes the handshake (model fingerprint, layout, length): TRANSFERRING.
4. Each KvBlocks piece is checked (place, sizes, no overlap) and handed to the sink.
5. KvEnd once every layer of every token has arrived, then the stream closes: DONE, and `done`
   resolves to the first token. Any refusal after step 2: FAILED, and `done` raises TransferError.
`cancel()` or a newer attempt's `expect()` makes it CANCELLED; a running stream is cut off at once
(ABORTED) and never writes again. Call every method from the event loop that serves PushKv.
"""

from __future__ import annotations

import asyncio
import enum
import hmac
import time
from dataclasses import dataclass, field
from typing import Protocol

import grpc
import numpy as np

from pdserve.kvcache.codec import KvPiece, decode_blocks
from pdserve.kvcache.layout import HandshakeError, KvLayout, check_handshake
from pdserve.v1 import worker_pb2 as pb
from pdserve.v1 import worker_pb2_grpc

Code = grpc.StatusCode


class KvSink(Protocol):
    def write(self, request_id: str, piece: KvPiece) -> None:
        """Copies the piece into the paged cache; the piece's arrays are read-only views."""


class TransferState(enum.Enum):
    WAITING = "waiting"
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


class TransferError(Exception):
    """Why a transfer failed; `code` is the status its stream was refused with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def _new_future() -> asyncio.Future[int]:
    return asyncio.get_running_loop().create_future()


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
    """time.monotonic() when the stream's header was accepted."""
    finished_at: float | None = None
    cached_blocks: int = 0
    """Leading blocks the decode worker holds already (prefix cache); the stream sends none of them."""

    @property
    def seconds(self) -> float:
        """From the accepted header to DONE/FAILED/CANCELLED (or now); 0 before a stream starts."""
        if self.started_at is None:
            return 0.0
        return (self.finished_at or time.monotonic()) - self.started_at


class _Refusal(Exception):
    def __init__(self, code: grpc.StatusCode, message: str, fails: Transfer | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.fails = fails


@dataclass(eq=False)
class _Stream:
    """The authenticated PushKv call now feeding a transfer."""

    transfer: Transfer
    task: asyncio.Task
    covered: np.ndarray  # [L, num_blocks] bool: (layer, block) cells received
    reading: bool = False
    cut: tuple[grpc.StatusCode, str] | None = None

    def cut_off(self, code: grpc.StatusCode, message: str) -> None:
        """Stops the stream before it writes again; wakes it if it waits for the next chunk."""
        if self.cut is None:
            self.cut = (code, message)
            if self.reading:
                self.task.cancel()


class KvReceiver(worker_pb2_grpc.KvTransferServicer):
    def __init__(self, layout: KvLayout, fingerprint: str, sink: KvSink) -> None:
        self.layout = layout
        self.fingerprint = fingerprint
        self.sink = sink
        self._transfers: dict[str, Transfer] = {}  # waiting or transferring, by request id
        self._streams: dict[str, _Stream] = {}

    def expect(self, request_id: str, attempt: int, transfer_token: bytes, num_tokens: int,
               cached_blocks: int = 0) -> Transfer:
        """Registers a transfer; a higher attempt replaces the old one and cuts off its stream.

        cached_blocks: leading blocks already held; their KV must not be sent.
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
                            cached_blocks=cached_blocks)
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

    async def PushKv(self, request_iterator, context: grpc.aio.ServicerContext) -> pb.PushKvResponse:
        chunks = aiter(request_iterator)
        stream: _Stream | None = None
        try:
            first = await anext(chunks, None)
            if first is None or first.WhichOneof("part") != "header":
                got = "nothing" if first is None else (first.WhichOneof("part") or "an empty KvChunk")
                raise _Refusal(
                    Code.INVALID_ARGUMENT, f"a PushKv stream must start with a KvHeader, got {got}"
                )
            stream = self._admit(first.header)
            first_token_id = await self._receive(stream, chunks)
            return self._finish(stream.transfer, first_token_id)
        except _Refusal as refusal:
            if refusal.fails is not None:
                self._fail(refusal.fails, refusal.code, refusal.message)
            await context.abort(refusal.code, refusal.message)
        except asyncio.CancelledError:
            if stream is not None and stream.cut is not None:  # cut off by cancel() or a newer attempt
                stream.task.uncancel()
                await context.abort(*stream.cut)
            if stream is not None:
                self._fail(stream.transfer, Code.CANCELLED, "the PushKv call was cancelled before KvEnd")
            raise
        except Exception as e:  # a bug here must not leave the decode worker waiting forever
            if stream is not None:
                self._fail(stream.transfer, Code.INTERNAL, f"the decode worker failed receiving KV: {e!r}")
            raise
        finally:
            if stream is not None and self._streams.get(stream.transfer.request_id) is stream:
                del self._streams[stream.transfer.request_id]

    def _admit(self, header: pb.KvHeader) -> _Stream:
        request_id, attempt = header.request_id, header.attempt
        transfer = self._transfers.get(request_id)
        if transfer is None:
            raise _Refusal(
                Code.NOT_FOUND,
                f"no KV transfer is expected for request {request_id!r} on this "
                "decode worker (finished, cancelled, timed out or never registered)",
            )
        if attempt < transfer.attempt:
            raise _Refusal(
                Code.ABORTED,
                f"request {request_id!r} attempt {attempt} is stale: the decode worker "
                f"expects attempt {transfer.attempt}; stop sending it",
            )
        if attempt > transfer.attempt:
            raise _Refusal(
                Code.NOT_FOUND,
                f"request {request_id!r} attempt {attempt} is not expected: the decode "
                f"worker expects attempt {transfer.attempt}",
            )
        if not header.transfer_token:
            raise _Refusal(
                Code.PERMISSION_DENIED,
                f"request {request_id!r}: the header carries no transfer token; "
                "send the token the coordinator issued",
            )
        if not hmac.compare_digest(header.transfer_token, transfer.token):
            raise _Refusal(
                Code.PERMISSION_DENIED,
                f"request {request_id!r}: wrong transfer token; send the token "
                "the coordinator issued for this attempt",
            )
        if transfer.state is not TransferState.WAITING:
            raise _Refusal(
                Code.ALREADY_EXISTS,
                f"request {request_id!r} attempt {attempt} already has a running "
                "stream; send each attempt once",
            )
        try:
            theirs = KvLayout.from_proto(header.layout)
        except ValueError as e:
            raise _Refusal(
                Code.INVALID_ARGUMENT, f"the header's KV layout is invalid: {e}", transfer
            ) from None
        try:
            check_handshake(
                self.layout, self.fingerprint, theirs, header.fingerprint.digest, peer="prefill worker"
            )
        except HandshakeError as e:
            raise _Refusal(Code.FAILED_PRECONDITION, str(e), transfer) from None
        if header.num_tokens != transfer.num_tokens:
            raise _Refusal(
                Code.INVALID_ARGUMENT,
                f"request {request_id!r}: the header says {header.num_tokens} "
                f"tokens, the decode worker expects {transfer.num_tokens}; "
                "send the prompt's true length",
                transfer,
            )
        if header.cached_blocks != transfer.cached_blocks:
            raise _Refusal(
                Code.INVALID_ARGUMENT,
                f"request {request_id!r}: the header skips {header.cached_blocks} cached blocks, the decode "
                f"worker holds {transfer.cached_blocks}; send every block after the ones it holds",
                transfer,
            )
        transfer.state = TransferState.TRANSFERRING
        transfer.started_at = time.monotonic()
        covered = np.zeros((self.layout.num_layers, self.layout.num_blocks(transfer.num_tokens)), dtype=bool)
        covered[:, : transfer.cached_blocks] = True  # held already: a piece there overlaps
        stream = _Stream(transfer, asyncio.current_task(), covered)  # type: ignore[arg-type]
        self._streams[request_id] = stream
        return stream

    async def _receive(self, stream: _Stream, chunks) -> int:
        """Writes every piece; the first token id once KvEnd came and the stream closed."""
        transfer = stream.transfer
        first_token_id: int | None = None
        while True:
            stream.reading = True
            try:
                chunk = await anext(chunks, None)
            finally:
                stream.reading = False
            if stream.cut is not None:
                raise _Refusal(*stream.cut)
            if chunk is None:
                break
            part = chunk.WhichOneof("part")
            if first_token_id is not None:
                raise _Refusal(
                    Code.INVALID_ARGUMENT,
                    f"{part or 'an empty KvChunk'} after KvEnd; KvEnd is last",
                    transfer,
                )
            if part == "blocks":
                self._write(stream, chunk.blocks)
            elif part == "end":
                self._check_complete(stream)
                first_token_id = chunk.end.first_token_id
            elif part == "header":
                raise _Refusal(
                    Code.INVALID_ARGUMENT, "a second KvHeader; one stream carries one transfer", transfer
                )
            else:
                raise _Refusal(Code.INVALID_ARGUMENT, "an empty KvChunk", transfer)
        if first_token_id is None:
            raise _Refusal(
                Code.INVALID_ARGUMENT,
                f"request {transfer.request_id!r}: the stream ended before KvEnd "
                "(the prefill worker closed or cancelled it)",
                transfer,
            )
        return first_token_id

    def _write(self, stream: _Stream, msg: pb.KvBlocks) -> None:
        transfer, bs = stream.transfer, self.layout.block_size
        try:
            piece = decode_blocks(self.layout, msg)
        except ValueError as e:
            raise _Refusal(Code.INVALID_ARGUMENT, str(e), transfer) from None
        token_end = msg.token_start + msg.token_count
        where = f"piece layers {msg.layer_start}+{msg.layer_count} tokens {msg.token_start}+{msg.token_count}"
        if token_end > transfer.num_tokens:
            raise _Refusal(
                Code.INVALID_ARGUMENT,
                f"{where} ends past the prompt's {transfer.num_tokens} tokens",
                transfer,
            )
        if msg.token_count % bs and token_end != transfer.num_tokens:
            raise _Refusal(
                Code.INVALID_ARGUMENT, f"{where} ends inside a block; only the last piece may", transfer
            )
        cells = stream.covered[msg.layer_start : msg.layer_start + msg.layer_count,
                               msg.token_start // bs : -(-token_end // bs)]  # fmt: skip
        if cells.any():
            raise _Refusal(Code.INVALID_ARGUMENT, f"{where} overlaps KV already received", transfer)
        try:
            self.sink.write(transfer.request_id, piece)
        except Exception as e:  # the decode tier's cache refused the piece
            raise _Refusal(
                Code.INTERNAL, f"the decode worker could not store {where}: {e!r}", transfer
            ) from e
        cells[...] = True
        transfer.bytes_received += sum(
            a.nbytes for a in (piece.k, piece.v, piece.k_scales, piece.v_scales) if a is not None
        )

    def _check_complete(self, stream: _Stream) -> None:
        missing_layers, missing_blocks = np.nonzero(~stream.covered)
        if len(missing_layers):
            transfer, bs = stream.transfer, self.layout.block_size
            layer, block = int(missing_layers[0]), int(missing_blocks[0])
            last_token = min((block + 1) * bs, transfer.num_tokens) - 1
            raise _Refusal(
                Code.INVALID_ARGUMENT,
                f"request {transfer.request_id!r}: KvEnd before all KV arrived: {len(missing_layers)} of "
                f"{stream.covered.size} (layer, block) cells missing, the first at layer {layer} tokens "
                f"{block * bs}..{last_token}; send every layer of every token before KvEnd",
                transfer,
            )

    def _finish(self, transfer: Transfer, first_token_id: int) -> pb.PushKvResponse:
        self._forget(transfer)
        transfer.state = TransferState.DONE
        transfer.finished_at = time.monotonic()
        if not transfer.done.done():
            transfer.done.set_result(first_token_id)
        return pb.PushKvResponse(tokens_received=transfer.num_tokens, bytes_received=transfer.bytes_received)

    def _fail(self, transfer: Transfer, code: grpc.StatusCode, message: str) -> None:
        if self._transfers.get(transfer.request_id) is not transfer:
            return  # already superseded or cancelled
        self._forget(transfer)
        transfer.state = TransferState.FAILED
        transfer.finished_at = time.monotonic()
        if not transfer.done.done():
            transfer.done.set_exception(TransferError(code, message))

    def _cancel(self, transfer: Transfer, reason: str) -> None:
        stream = self._streams.get(transfer.request_id)
        if stream is not None and stream.transfer is transfer:
            stream.cut_off(Code.ABORTED, reason)
        self._forget(transfer)
        transfer.state = TransferState.CANCELLED
        transfer.finished_at = time.monotonic()
        transfer.done.cancel()

    def _forget(self, transfer: Transfer) -> None:
        if self._transfers.get(transfer.request_id) is transfer:
            del self._transfers[transfer.request_id]
        stream = self._streams.get(transfer.request_id)
        if stream is not None and stream.transfer is transfer:
            del self._streams[transfer.request_id]
