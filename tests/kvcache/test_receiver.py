"""GrpcKvTransport -> KvReceiver over a real grpc.aio server on 127.0.0.1: delivery and every refusal."""

from __future__ import annotations

import asyncio
import concurrent.futures
import re
import subprocess
import sys
import threading

import grpc
import numpy as np
import pytest

import pdserve.kvcache.sender as kv_sender
from pdserve.kvcache.codec import MAX_CHUNK_BYTES, KvPiece, encode_chunks
from pdserve.kvcache.grpc_receiver import add_receiver_to_server
from pdserve.kvcache.grpc_sender import GrpcKvTransport
from pdserve.kvcache.layout import KvLayout
from pdserve.kvcache.receiver import KvReceiver, Refusal, Status, Transfer, TransferError, TransferState
from pdserve.kvcache.wire import PROTOCOL_VERSION, encode_piece_bytes
from pdserve.v1 import worker_pb2 as pb
from pdserve.v1 import worker_pb2_grpc

from .test_codec import random_kv

LAYOUT = KvLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype="bfloat16")
FINGERPRINT = "c0ffee" * 10 + "beef"
TOKEN = b"coordinator-issued-secret"
NUM_TOKENS = 10  # blocks of 4, 4, 2
SMALL_CHUNKS = 256 + 64  # one block of one layer per message: 9 messages


class RecordingSink:
    def __init__(self) -> None:
        self.writes: list[tuple[str, KvPiece]] = []

    def write(self, request_id: str, piece: KvPiece) -> None:
        self.writes.append((request_id, piece))

    def assemble(self, request_id: str, layout: KvLayout, num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        shape = (layout.num_layers, num_tokens, layout.num_kv_heads, layout.head_dim)  # [L, T, Hkv, D]
        k, v = np.zeros(shape, layout.np_dtype), np.zeros(shape, layout.np_dtype)
        for rid, p in self.writes:
            if rid == request_id:
                k[
                    p.layer_start : p.layer_start + p.num_layers, p.token_start : p.token_start + p.num_tokens
                ] = p.k
                v[
                    p.layer_start : p.layer_start + p.num_layers, p.token_start : p.token_start + p.num_tokens
                ] = p.v
        return k, v


class GatedSink(RecordingSink):
    """Writes wait for `gate`; counts the writes running at once (the pool's threads)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.running = self.most = 0
        self._lock = threading.Lock()

    def write(self, request_id, piece) -> None:
        with self._lock:
            self.running += 1
            self.most = max(self.most, self.running)
        self.gate.wait(10)
        with self._lock:
            self.running -= 1
            self.writes.append((request_id, piece))


class Harness:
    def __init__(self, layout: KvLayout, max_chunk_bytes: int) -> None:
        self.sink = RecordingSink()
        self.receiver = KvReceiver(layout, FINGERPRINT, self.sink)
        self.sender = GrpcKvTransport(max_chunk_bytes=max_chunk_bytes)
        self.server = grpc.aio.server()
        add_receiver_to_server(self.receiver, self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.channel = grpc.aio.insecure_channel(self.address)
        self.stub = worker_pb2_grpc.KvTransferStub(self.channel)

    def expect(self, request_id: str = "r1", attempt: int = 0, num_tokens: int = NUM_TOKENS) -> Transfer:
        return self.receiver.expect(request_id, attempt, TOKEN, num_tokens)

    async def send(self, k, v, *, first_token_id: int = 42, layout: KvLayout = LAYOUT, **header_fields):
        fields = dict(request_id="r1", attempt=0, transfer_token=TOKEN, num_tokens=k.shape[1])
        header = make_header(layout=layout, **(fields | header_fields))
        return await self.sender.send(self.address, header, layout, k, v, first_token_id)

    def open_stream(self) -> tuple[grpc.aio.StreamUnaryCall, asyncio.Queue]:
        """A PushKv call fed by hand: put KvChunks on the queue, None to close the stream."""
        queue: asyncio.Queue = asyncio.Queue()

        async def chunks():
            while (chunk := await queue.get()) is not None:
                yield chunk

        return self.stub.PushKv(chunks()), queue

    async def close(self) -> None:
        await self.channel.close()
        await self.sender.close()
        await self.server.stop(None)


def make_header(*, layout: KvLayout = LAYOUT, fingerprint: str = FINGERPRINT, **fields) -> pb.KvHeader:
    fields.setdefault("protocol_version", PROTOCOL_VERSION)
    return pb.KvHeader(
        fingerprint=pb.ModelFingerprint(digest=fingerprint), layout=layout.to_proto(), **fields
    )


def block_chunks(k, v, layout: KvLayout = LAYOUT) -> list[pb.KvChunk]:
    return list(encode_chunks(layout, k, v, max_chunk_bytes=SMALL_CHUNKS))


async def refused(call_or_coro) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call_or_coro
    return err.value


async def eventually(condition, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.005)


@pytest.fixture
async def harnesses():
    """harnesses(layout, max_chunk_bytes) -> a started Harness, closed after the test."""
    made: list[Harness] = []

    async def make(layout: KvLayout = LAYOUT, max_chunk_bytes: int = SMALL_CHUNKS) -> Harness:
        harness = Harness(layout, max_chunk_bytes)
        await harness.server.start()
        made.append(harness)
        return harness

    yield make
    for harness in made:
        await harness.close()


@pytest.fixture
async def h(harnesses) -> Harness:
    return await harnesses()


async def test_push_delivers_bit_exact_kv_and_the_first_token(h):
    transfer = h.expect()
    assert (transfer.state, h.receiver.pending()) == (TransferState.WAITING, 1)
    k, v, _, _ = random_kv(LAYOUT, NUM_TOKENS)
    response = await h.send(k, v, first_token_id=42)
    assert await transfer.done == 42
    assert (response.tokens_received, response.bytes_received) == (10, k.nbytes + v.nbytes)
    assert (transfer.state, transfer.bytes_received, h.receiver.pending()) == (TransferState.DONE, 1920, 0)
    assert transfer.seconds > 0
    assert [(p.layer_start, p.token_start, p.num_tokens) for _, p in h.sink.writes] == [
        (layer, t, n) for t, n in ((0, 4), (4, 4), (8, 2)) for layer in range(3)
    ]
    k2, v2 = h.sink.assemble("r1", LAYOUT, NUM_TOKENS)
    assert k2.tobytes() == k.tobytes() and v2.tobytes() == v.tobytes()


async def test_quantized_push_carries_the_scales_bit_exact(harnesses):
    layout = KvLayout(2, 2, 8, 4, "fp8_e4m3", "block_head")
    harness = await harnesses(layout)
    transfer = harness.expect(num_tokens=7)
    k, v, k_scales, v_scales = random_kv(layout, 7, seed=3)
    header = make_header(layout=layout, request_id="r1", transfer_token=TOKEN, num_tokens=7)
    await harness.sender.send(harness.address, header, layout, k, v, 7, k_scales=k_scales, v_scales=v_scales)
    assert await transfer.done == 7
    got = {(p.layer_start, p.token_start): p for _, p in harness.sink.writes}
    assert sorted(got) == [(0, 0), (0, 4), (1, 0), (1, 4)]
    for (layer, t), piece in got.items():
        assert piece.k.tobytes() == k[layer : layer + 1, t : t + 4].tobytes()
        assert piece.v.tobytes() == v[layer : layer + 1, t : t + 4].tobytes()
        assert piece.k_scales.tobytes() == k_scales[layer : layer + 1, t // 4 : t // 4 + 1].tobytes()
        assert piece.v_scales.tobytes() == v_scales[layer : layer + 1, t // 4 : t // 4 + 1].tobytes()
    assert transfer.bytes_received == k.nbytes + v.nbytes + k_scales.nbytes + v_scales.nbytes


async def test_a_big_push_streams_lazily_over_one_cached_channel(harnesses, monkeypatch):
    encoded: list[int] = []

    def counting_encode(*args, **kwargs):
        encoded.append(1)
        return encode_piece_bytes(*args, **kwargs)

    monkeypatch.setattr(kv_sender, "encode_piece_bytes", counting_encode)
    layout = KvLayout(4, 8, 128, 16, "float32")  # a block of all layers: 512 KiB
    harness = await harnesses(layout, max_chunk_bytes=2**20 + 64)  # two blocks (1 MiB) per message
    encoded_at_writes: list[int] = []
    harness.sink.write = lambda rid, piece: encoded_at_writes.append(len(encoded))  # type: ignore[method-assign]
    transfer = harness.expect(num_tokens=16 * 32)
    k, v, _, _ = random_kv(layout, 16 * 32)
    await harness.send(k, v, layout=layout)
    assert await transfer.done == 42
    assert len(encoded) == 16 and transfer.bytes_received == k.nbytes + v.nbytes
    assert encoded_at_writes[0] < 16, encoded_at_writes  # the stream did not encode everything up front
    transfer = harness.receiver.expect("r2", 0, TOKEN, 16)
    await harness.send(k[:, :16], v[:, :16], layout=layout, request_id="r2")
    assert await transfer.done == 42
    assert list(harness.sender._channels) == [(harness.address, 0)]


async def test_a_full_size_chunk_fits_grpc_default_message_limit(harnesses):
    layout = KvLayout(1, 1, 16, 1, "float32")  # 128 bytes a block: 32767 blocks fill one 4 MiB message
    harness = await harnesses(layout, max_chunk_bytes=MAX_CHUNK_BYTES)  # the server keeps grpc's 4 MiB limit
    transfer = harness.expect(num_tokens=32767)
    k, v, _, _ = random_kv(layout, 32767)
    size = next(encode_chunks(layout, k, v)).ByteSize()
    assert size == 32767 * 128 + 14 + 5 <= MAX_CHUNK_BYTES == 4 * 2**20  # payload, KvBlocks' fields, wrapper
    await harness.send(k, v, layout=layout)
    assert (await transfer.done, len(harness.sink.writes)) == (42, 1)


class FailingSink:
    def write(self, request_id: str, piece: KvPiece) -> None:
        raise RuntimeError("cache full")


async def test_a_sink_error_fails_the_transfer(h):
    h.receiver.sink = FailingSink()
    transfer = h.expect()
    k, v, _, _ = random_kv(LAYOUT, NUM_TOKENS)
    err = await refused(h.send(k, v))
    assert err.code() == grpc.StatusCode.INTERNAL
    assert err.details() == (
        "the decode worker could not store piece layers 0+1 tokens 0+4: RuntimeError('cache full')"
    )
    with pytest.raises(TransferError, match=r"cache full"):
        await transfer.done
    assert (transfer.state, transfer.bytes_received) == (TransferState.FAILED, 0)


async def test_sender_refuses_a_header_that_does_not_match_the_arrays(h):
    k, v, _, _ = random_kv(LAYOUT, NUM_TOKENS)
    with pytest.raises(ValueError, match=r"header says 9 tokens but k holds 10"):
        await h.sender.send(h.address, make_header(num_tokens=9), LAYOUT, k, v, 1)
    other = KvLayout(3, 2, 8, 8, "bfloat16")
    with pytest.raises(ValueError, match=r"header layout \[.*block_size=8.*\] is not the layout of the KV"):
        await h.sender.send(h.address, make_header(layout=other, num_tokens=10), LAYOUT, k, v, 1)
    with pytest.raises(ValueError, match=r"quantize first"):
        await h.sender.send(h.address, make_header(num_tokens=10), LAYOUT, k.astype(np.float32), v, 1)


async def test_wrong_or_missing_token_is_refused_without_disturbing_the_transfer(h):
    transfer = h.expect()
    k, v, _, _ = random_kv(LAYOUT, NUM_TOKENS)
    err = await refused(h.send(k, v, transfer_token=b"guess"))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    assert (
        err.details()
        == "request 'r1': wrong transfer token; send the token the coordinator issued for this attempt"
    )
    err = await refused(h.send(k, v, transfer_token=b""))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "the header carries no transfer token" in err.details()
    assert (transfer.state, transfer.done.done(), h.sink.writes) == (TransferState.WAITING, False, [])
    await h.send(k, v, first_token_id=5)
    assert await transfer.done == 5


async def test_unknown_request_is_not_found(h):
    k, v, _, _ = random_kv(LAYOUT, NUM_TOKENS)
    err = await refused(h.send(k, v, request_id="nobody"))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    assert "no KV transfer is expected for request 'nobody'" in err.details()
    transfer = h.expect(attempt=2)
    err = await refused(h.send(k, v, attempt=3))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    assert "attempt 3 is not expected: the decode worker expects attempt 2" in err.details()
    assert (transfer.state, h.sink.writes) == (TransferState.WAITING, [])


async def test_fingerprint_mismatch_fails_the_transfer_naming_both(h):
    transfer = h.expect()
    k, v, _, _ = random_kv(LAYOUT, NUM_TOKENS)
    err = await refused(h.send(k, v, fingerprint="0123456789abcdef" * 4))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.details() == (
        "model fingerprint mismatch: prefill worker serves 0123456789abcdef…, this worker "
        "c0ffeec0ffeec0ff…; both tiers must load the same checkpoint"
    )
    with pytest.raises(TransferError, match=r"model fingerprint mismatch") as failure:
        await transfer.done
    assert failure.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert (transfer.state, h.receiver.pending(), h.sink.writes) == (TransferState.FAILED, 0, [])


async def test_layout_mismatch_fails_the_transfer_naming_both(h):
    transfer = h.expect()
    theirs = KvLayout(3, 2, 8, 4, "float16")
    k, v, _, _ = random_kv(theirs, NUM_TOKENS)
    err = await refused(h.send(k, v, layout=theirs))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.details() == (
        "KV layout mismatch: prefill worker sends [layers=3 kv_heads=2 head_dim=8 block_size=4 "
        "dtype=float16 scales=none], this worker holds [layers=3 kv_heads=2 head_dim=8 block_size=4 "
        "dtype=bfloat16 scales=none]"
    )
    with pytest.raises(TransferError, match=r"KV layout mismatch"):
        await transfer.done
    assert (transfer.state, h.sink.writes) == (TransferState.FAILED, [])


async def test_num_tokens_mismatch_is_invalid(h):
    transfer = h.expect(num_tokens=11)
    k, v, _, _ = random_kv(LAYOUT, NUM_TOKENS)
    err = await refused(h.send(k, v))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == (
        "request 'r1': the header says 10 tokens, the decode worker expects 11; send the prompt's true length"
    )
    with pytest.raises(TransferError):
        await transfer.done
    assert transfer.state == TransferState.FAILED


async def test_a_newer_attempt_cuts_off_the_old_stream(h):
    old = h.expect(attempt=0)
    k0, v0, _, _ = random_kv(LAYOUT, NUM_TOKENS, seed=0)
    call, queue = h.open_stream()
    queue.put_nowait(
        pb.KvChunk(header=make_header(request_id="r1", attempt=0, transfer_token=TOKEN, num_tokens=10))
    )
    old_chunks = block_chunks(k0, v0)
    queue.put_nowait(old_chunks[0])
    await eventually(lambda: len(h.sink.writes) == 1)
    assert old.state == TransferState.TRANSFERRING

    new = h.expect(attempt=1)
    with pytest.raises(ValueError, match=r"attempt 1 is not newer than the expected attempt 1"):
        h.expect(attempt=1)
    for chunk in old_chunks[1:]:  # the dead attempt keeps sending
        queue.put_nowait(chunk)
    err = await refused(call)
    assert err.code() == grpc.StatusCode.ABORTED
    assert "attempt 0 was superseded by attempt 1" in err.details()
    assert (old.state, old.done.cancelled(), h.receiver.pending()) == (TransferState.CANCELLED, True, 1)
    assert len(h.sink.writes) == 1

    err = await refused(h.send(k0, v0, attempt=0))  # a stale stream that starts late
    assert err.code() == grpc.StatusCode.ABORTED
    assert "attempt 0 is stale: the decode worker expects attempt 1" in err.details()
    assert (new.state, len(h.sink.writes)) == (TransferState.WAITING, 1)

    k1, v1, _, _ = random_kv(LAYOUT, NUM_TOKENS, seed=1)
    await h.send(k1, v1, attempt=1, first_token_id=7)
    assert await new.done == 7
    h.sink.writes = h.sink.writes[1:]  # the only attempt-0 piece, written before the cut
    k2, v2 = h.sink.assemble("r1", LAYOUT, NUM_TOKENS)
    assert k2.tobytes() == k1.tobytes() and v2.tobytes() == v1.tobytes()


async def test_cancel_mid_stream_aborts_it(h):
    transfer = h.expect()
    k, v, _, _ = random_kv(LAYOUT, NUM_TOKENS)
    call, queue = h.open_stream()
    queue.put_nowait(pb.KvChunk(header=make_header(request_id="r1", transfer_token=TOKEN, num_tokens=10)))
    chunks = block_chunks(k, v)
    queue.put_nowait(chunks[0])
    queue.put_nowait(chunks[1])
    await eventually(lambda: len(h.sink.writes) == 2)
    h.receiver.cancel("r1")
    queue.put_nowait(chunks[2])
    err = await refused(call)
    assert err.code() == grpc.StatusCode.ABORTED
    assert err.details() == "request 'r1' was cancelled on the decode worker; stop sending its KV"
    assert (transfer.state, transfer.done.cancelled(), h.receiver.pending()) == (
        TransferState.CANCELLED,
        True,
        0,
    )
    assert len(h.sink.writes) == 2
    assert (await refused(h.send(k, v))).code() == grpc.StatusCode.NOT_FOUND
    h.receiver.cancel("r1")  # cancelling twice is harmless


async def test_a_duplicate_stream_is_refused_and_the_first_completes(h):
    transfer = h.expect()
    k, v, _, _ = random_kv(LAYOUT, NUM_TOKENS)
    call, queue = h.open_stream()
    queue.put_nowait(pb.KvChunk(header=make_header(request_id="r1", transfer_token=TOKEN, num_tokens=10)))
    await eventually(lambda: transfer.state == TransferState.TRANSFERRING)
    err = await refused(h.send(k, v))
    assert err.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "request 'r1' attempt 0 already has a running stream" in err.details()
    for chunk in block_chunks(k, v):
        queue.put_nowait(chunk)
    queue.put_nowait(pb.KvChunk(end=pb.KvEnd(first_token_id=9)))
    queue.put_nowait(None)
    response = await call
    assert (response.tokens_received, await transfer.done, len(h.sink.writes)) == (10, 9, 9)


HEADER = pb.KvChunk(header=make_header(request_id="r1", transfer_token=TOKEN, num_tokens=NUM_TOKENS))
END = pb.KvChunk(end=pb.KvEnd(first_token_id=1))


def bad_blocks(**fields) -> pb.KvChunk:
    msg = pb.KvBlocks(layer_count=1, token_count=4, k=bytes(128), v=bytes(128))
    for name, value in fields.items():
        setattr(msg, name, value)
    return pb.KvChunk(blocks=msg)


def streams() -> dict[str, tuple[list[pb.KvChunk], str, int]]:
    """Malformed streams: (chunks, what the refusal says, pieces written before it)."""
    k, v, _, _ = random_kv(LAYOUT, NUM_TOKENS)
    chunks = block_chunks(k, v)
    return {
        "no header": ([chunks[0], END], r"^a PushKv stream must start with a KvHeader, got blocks$", 0),
        "empty stream": ([], r"^a PushKv stream must start with a KvHeader, got nothing$", 0),
        "missing end": (
            [HEADER, *chunks],
            r"^request 'r1': the stream ended before KvEnd \(the prefill worker closed or cancelled it\)$",
            9,
        ),
        "incomplete": (
            [HEADER, *chunks[:4], *chunks[5:], END],
            r"^request 'r1': KvEnd before all KV arrived: 1 of 9 \(layer, block\) cells missing, "
            r"the first at layer 1 tokens 4\.\.7; send every layer of every token before KvEnd$",
            8,
        ),
        "second header": (
            [HEADER, chunks[0], HEADER],
            r"^a second KvHeader; one stream carries one transfer$",
            1,
        ),
        "blocks after end": ([HEADER, *chunks, END, chunks[0]], r"^blocks after KvEnd; KvEnd is last$", 9),
        "duplicate piece": (
            [HEADER, chunks[0], chunks[0]],
            r"layers 0\+1 tokens 0\+4 overlaps KV already received",
            1,
        ),
        "tokens past the end": (
            [HEADER, bad_blocks(token_start=8)],
            r"tokens 8\+4 ends past the prompt's 10 tokens",
            0,
        ),
        "layer past the end": ([HEADER, bad_blocks(layer_start=3)], r"the layout has only 3 layers", 0),
        "partial block inside": (
            [HEADER, bad_blocks(token_count=2, k=bytes(64), v=bytes(64))],
            r"tokens 0\+2 ends inside a block; only the last piece may",
            0,
        ),
        "bad sizes": ([HEADER, bad_blocks(k=bytes(127))], r"k has 127 bytes, expected 128", 0),
        "empty chunk": ([HEADER, pb.KvChunk()], r"^an empty KvChunk$", 0),
    }


@pytest.mark.parametrize("case", list(streams()))
async def test_malformed_streams_are_invalid_and_fail_the_transfer(h, case):
    chunks, message, written = streams()[case]
    transfer = h.expect()
    call, queue = h.open_stream()
    for chunk in [*chunks, None]:
        queue.put_nowait(chunk)
    err = await refused(call)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() is not None and re.search(message, err.details()), err.details()
    assert len(h.sink.writes) == written
    if case in ("no header", "empty stream"):  # no request id: nothing to fail
        assert transfer.state == TransferState.WAITING
        return
    with pytest.raises(TransferError, match=message) as failure:
        await transfer.done
    assert failure.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert (transfer.state, h.receiver.pending()) == (TransferState.FAILED, 0)


async def test_a_sender_that_dies_mid_stream_fails_the_transfer(h):
    transfer = h.expect()
    k, v, _, _ = random_kv(LAYOUT, NUM_TOKENS)
    call, queue = h.open_stream()
    queue.put_nowait(HEADER)
    queue.put_nowait(block_chunks(k, v)[0])
    await eventually(lambda: len(h.sink.writes) == 1)
    call.cancel()
    # gRPC shows the handler a cancelled call as the end of the stream (or cancels the handler)
    with pytest.raises(TransferError, match=r"(stream ended|call was cancelled) before KvEnd"):
        await asyncio.wait_for(transfer.done, 5)
    assert (transfer.state, h.receiver.pending(), len(h.sink.writes)) == (TransferState.FAILED, 0, 1)


def test_expect_refuses_bad_registrations():
    receiver = KvReceiver(LAYOUT, FINGERPRINT, RecordingSink())
    with pytest.raises(ValueError, match=r"a transfer token is required"):
        receiver.expect("r1", 0, b"", 10)
    with pytest.raises(ValueError, match=r"num_tokens must be >= 0"):
        receiver.expect("r1", 0, TOKEN, -1)


async def test_blocks_the_receiver_holds_are_not_sent(harnesses):
    h = await harnesses()
    k, v, _, _ = random_kv(LAYOUT, NUM_TOKENS, seed=5)
    transfer = h.receiver.expect("r1", 0, TOKEN, NUM_TOKENS, cached_blocks=2)  # tokens 0..7 held
    reply = await h.send(k, v, cached_blocks=2)
    assert await transfer.done == 42
    assert [(p.layer_start, p.token_start, p.num_tokens) for _, p in h.sink.writes] == [(0, 8, 2), (1, 8, 2), (2, 8, 2)]
    got_k, got_v = h.sink.assemble("r1", LAYOUT, NUM_TOKENS)
    bits = lambda a: a[:, 8:].view(np.uint16)  # noqa: E731  (random bit patterns include NaNs)
    assert np.array_equal(bits(got_k), bits(k)) and np.array_equal(bits(got_v), bits(v))
    assert reply.bytes_received == transfer.bytes_received == 2 * 3 * 2 * 2 * 8 * 2  # K+V, 3 layers, 2 tokens


async def test_a_sender_that_disagrees_on_the_held_blocks_is_refused(harnesses):
    h = await harnesses()
    k, v, _, _ = random_kv(LAYOUT, NUM_TOKENS, seed=6)
    transfer = h.receiver.expect("r1", 0, TOKEN, NUM_TOKENS, cached_blocks=1)
    err = await refused(h.send(k, v))  # sends every block
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "holds 1" in err.details()
    with pytest.raises(TransferError):
        await transfer.done


async def test_a_failed_transfer_drops_the_writes_still_queued(h):
    sink = h.receiver.sink = GatedSink()
    h.receiver._pool = concurrent.futures.ThreadPoolExecutor(1)  # one write runs, the others queue behind it
    transfer = h.expect()
    k, v, _, _ = random_kv(LAYOUT, NUM_TOKENS)
    call, queue = h.open_stream()
    queue.put_nowait(pb.KvChunk(header=make_header(request_id="r1", transfer_token=TOKEN, num_tokens=10)))
    for chunk in block_chunks(k, v)[:3]:  # under WRITES_IN_FLIGHT: the stream reads on
        queue.put_nowait(chunk)
    await eventually(lambda: sink.running == 1 and len(h.receiver._writes.get("r1", ())) == 3)
    queue.put_nowait(pb.KvChunk(abort=pb.KvAbort(reason="device lost")))
    assert (await refused(call)).code() == grpc.StatusCode.ABORTED
    assert transfer.state is TransferState.FAILED
    sink.gate.set()
    await h.receiver.settle("r1")
    assert len(sink.writes) == 1  # the running write landed; the two queued behind it wrote nothing
    with pytest.raises(TransferError, match="device lost"):
        await transfer.done


def test_the_state_machine_imports_no_grpc():
    code = "import sys, pdserve.kvcache.receiver; print(sorted(m for m in sys.modules if m.split('.')[0] == 'grpc'))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"


async def test_the_state_machine_alone_refuses_a_stranger_and_fails_on_a_mismatch():
    receiver = KvReceiver(LAYOUT, FINGERPRINT, RecordingSink())
    transfer = receiver.expect("r1", 0, TOKEN, NUM_TOKENS)
    with pytest.raises(Refusal) as stranger:
        receiver.begin(make_header(request_id="r1", attempt=0, transfer_token=b"guess", num_tokens=NUM_TOKENS))
    assert (stranger.value.status, stranger.value.fails, transfer.state) == (
        Status.PERMISSION_DENIED, None, TransferState.WAITING)
    with pytest.raises(Refusal) as mismatch:
        receiver.begin(make_header(request_id="r1", attempt=0, transfer_token=TOKEN, num_tokens=NUM_TOKENS - 1))
    assert (mismatch.value.status, mismatch.value.fails, transfer.state) == (
        Status.INVALID_ARGUMENT, transfer, TransferState.FAILED)
    assert str(mismatch.value) == ("request 'r1': the header says 9 tokens, the decode worker expects 10; "
                                   "send the prompt's true length")
    with pytest.raises(TransferError) as failure:
        await transfer.done
    assert (failure.value.status, failure.value.code) == (Status.INVALID_ARGUMENT, grpc.StatusCode.INVALID_ARGUMENT)


@pytest.mark.parametrize("expected, sent, words", [
    ("ada", "", "the KV was computed with the base model, this decode worker decodes it with LoRA adapter 'ada'"),
    ("", "bob", "the KV was computed with LoRA adapter 'bob', this decode worker decodes it with the base model"),
    ("ada", "bob", "the KV was computed with LoRA adapter 'bob', this decode worker decodes it with LoRA adapter 'ada'"),
])
async def test_kv_computed_with_another_adapter_is_refused(h, expected, sent, words):
    transfer = h.receiver.expect("r1", 0, TOKEN, NUM_TOKENS, lora_name=expected)
    k, v, _, _ = random_kv(LAYOUT, NUM_TOKENS)
    err = await refused(h.send(k, v, lora_name=sent))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.details() == f"request 'r1': {words}; KV belongs to its adapter: prefill with the same one"
    with pytest.raises(TransferError):
        await transfer.done
    assert h.sink.writes == []


async def test_kv_of_the_expected_adapter_is_taken(h):
    transfer = h.receiver.expect("r1", 0, TOKEN, NUM_TOKENS, lora_name="ada")
    k, v, _, _ = random_kv(LAYOUT, NUM_TOKENS)
    await h.send(k, v, first_token_id=7, lora_name="ada")
    assert await transfer.done == 7
