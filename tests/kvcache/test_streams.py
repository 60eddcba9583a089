"""Layer groups over parallel streams, the versioned header, KvAbort and the lease, through both
transports: gRPC on 127.0.0.1 and the in-memory one."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from pdserve.kvcache.grpc_receiver import add_receiver_to_server
from pdserve.kvcache.grpc_sender import GrpcKvTransport
from pdserve.kvcache.layout import KvLayout
from pdserve.kvcache.local import LocalKvTransport
from pdserve.kvcache.receiver import WRITES_IN_FLIGHT, KvReceiver, TransferError, TransferState
from pdserve.kvcache.sender import KvPoll
from pdserve.kvcache.tensors import KvTensors
from pdserve.v1 import worker_pb2 as pb

from .test_codec import random_kv
from .test_receiver import (
    FINGERPRINT,
    LAYOUT,
    NUM_TOKENS,
    SMALL_CHUNKS,
    TOKEN,
    GatedSink,
    RecordingSink,
    make_header,
)

ADDRESS = "decode-0"


class Pair:
    """A receiver and a transport to it: over gRPC on 127.0.0.1 or in memory."""

    def __init__(self, kind: str, layout: KvLayout, num_streams: int) -> None:
        self.kind, self.layout = kind, layout
        self.sink = RecordingSink()
        self.receiver = KvReceiver(layout, FINGERPRINT, self.sink)
        self.server: grpc.aio.Server | None = None
        if kind == "grpc":
            self.server = grpc.aio.server()
            add_receiver_to_server(self.receiver, self.server)
            self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
            self.transport = GrpcKvTransport(num_streams=num_streams, max_chunk_bytes=SMALL_CHUNKS)
        else:
            self.address = ADDRESS
            self.transport = LocalKvTransport({ADDRESS: self.receiver}, num_streams=num_streams,
                                              max_chunk_bytes=SMALL_CHUNKS)

    def header(self, **fields) -> pb.KvHeader:
        base = dict(request_id="r1", attempt=0, transfer_token=TOKEN, num_tokens=NUM_TOKENS)
        return make_header(layout=self.layout, **(base | fields))

    async def close(self) -> None:
        await self.transport.close()
        if self.server is not None:
            await self.server.stop(None)


@pytest.fixture(params=["grpc", "local"])
async def pairs(request):
    made: list[Pair] = []

    async def make(num_streams: int = 1, layout: KvLayout = LAYOUT) -> Pair:
        pair = Pair(request.param, layout, num_streams)
        if pair.server is not None:
            await pair.server.start()
        made.append(pair)
        return pair

    yield make
    for pair in made:
        await pair.close()


async def test_layer_groups_over_three_streams_arrive_bit_exact(pairs):
    pair = await pairs(num_streams=3)
    transfer = pair.receiver.expect("r1", 0, TOKEN, NUM_TOKENS)
    k, v, _, _ = random_kv(LAYOUT, NUM_TOKENS)
    sender = await pair.transport.open(pair.address, pair.header(), LAYOUT)
    assert (sender.poll(), transfer.state, transfer.num_streams) == (
        KvPoll.WAITING_FOR_INPUT, TransferState.TRANSFERRING, 3)
    await sender.send(KvTensors(0, 0, k[:2], v[:2]))  # layers 0-1, as the first group finishes
    await sender.send(KvTensors(2, 0, k[2:], v[2:]))  # layer 2
    assert sender.poll() is KvPoll.TRANSFERRING
    reply = await sender.finish(first_token_id=11)
    assert (sender.poll(), await transfer.done, reply.bytes_received) == (KvPoll.SUCCESS, 11, k.nbytes + v.nbytes)
    assert transfer.state is TransferState.DONE and transfer.stream_indexes == {0, 1, 2}
    got_k, got_v = pair.sink.assemble("r1", LAYOUT, NUM_TOKENS)
    assert got_k.tobytes() == k.tobytes() and got_v.tobytes() == v.tobytes()
    assert len(pair.sink.writes) == 9  # one block of one layer per message
    if pair.kind == "grpc":
        assert sorted(pair.transport._channels) == [(pair.address, i) for i in range(3)]


async def test_quantized_groups_carry_their_scales(pairs):
    layout = KvLayout(2, 2, 8, 4, "int8", "block_head")
    pair = await pairs(num_streams=2, layout=layout)
    transfer = pair.receiver.expect("r1", 0, TOKEN, 7)
    k, v, ks, vs = random_kv(layout, 7, seed=5)
    sender = await pair.transport.open(pair.address, pair.header(num_tokens=7), layout)
    for layer in range(2):
        await sender.send(KvTensors(layer, 0, k[layer:layer + 1], v[layer:layer + 1], ks[layer:layer + 1],
                                    vs[layer:layer + 1]))
    await sender.finish(3)
    assert await transfer.done == 3
    pieces = sorted((p.layer_start, p.token_start, p.k_scales.tobytes()) for _, p in pair.sink.writes)
    assert pieces == [(layer, t, ks[layer:layer + 1, t // 4:t // 4 + 1].tobytes()) for layer in range(2) for t in (0, 4)]
    assert transfer.bytes_received == k.nbytes + v.nbytes + ks.nbytes + vs.nbytes


async def test_an_unknown_protocol_version_is_refused_naming_both(pairs):
    pair = await pairs()
    transfer = pair.receiver.expect("r1", 0, TOKEN, NUM_TOKENS)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await pair.transport.open(pair.address, pair.header(protocol_version=9), LAYOUT)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.value.details() == (
        "KV protocol version mismatch: the prefill worker speaks version 9, this decode worker 2; "
        "run the same pdserve release on both tiers"
    )
    with pytest.raises(TransferError, match="protocol version mismatch"):
        await transfer.done


async def test_an_abort_frees_the_transfer_at_once_with_the_reason(pairs):
    pair = await pairs(num_streams=2)
    transfer = pair.receiver.expect("r1", 0, TOKEN, NUM_TOKENS)
    k, v, _, _ = random_kv(LAYOUT, NUM_TOKENS)
    sender = await pair.transport.open(pair.address, pair.header(), LAYOUT)
    await sender.send(KvTensors(0, 0, k[:1], v[:1]))  # one of three layer groups, then the prefill dies
    await sender.abort("prefill failed: RuntimeError('device lost')")
    with pytest.raises(TransferError) as failure:
        await asyncio.wait_for(transfer.done, 5)
    assert failure.value.code == grpc.StatusCode.ABORTED
    assert str(failure.value) == (
        "the prefill worker gave up request 'r1' attempt 0: prefill failed: RuntimeError('device lost')"
    )
    assert (sender.poll(), transfer.state, pair.receiver.pending()) == (KvPoll.FAILED, TransferState.FAILED, 0)


async def test_a_refusal_on_one_stream_fails_the_sender(pairs):
    pair = await pairs(num_streams=2)
    pair.receiver.sink = FailOnLayer(2)
    transfer = pair.receiver.expect("r1", 0, TOKEN, NUM_TOKENS)
    k, v, _, _ = random_kv(LAYOUT, NUM_TOKENS)
    sender = await pair.transport.open(pair.address, pair.header(), LAYOUT)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await sender.send(KvTensors(0, 0, k, v))
        await sender.finish(1)
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert "could not store piece layers 2+1" in err.value.details()
    assert sender.poll() is KvPoll.FAILED
    with pytest.raises(TransferError):
        await transfer.done


class FailOnLayer(RecordingSink):
    def __init__(self, layer: int) -> None:
        super().__init__()
        self.layer = layer

    def write(self, request_id, piece) -> None:
        if piece.layer_start == self.layer:
            raise RuntimeError("cache full")
        super().write(request_id, piece)


async def test_the_lease_starts_with_the_header_and_restarts_with_every_chunk(pairs):
    pair = await pairs()
    transfer = pair.receiver.expect("r1", 0, TOKEN, NUM_TOKENS)
    waiting = asyncio.ensure_future(transfer.wait(lease=0.4))
    await asyncio.sleep(0.6)  # the prompt queues in the prefill tier: no clock runs yet
    assert not waiting.done() and transfer.last_activity is None
    k, v, _, _ = random_kv(LAYOUT, NUM_TOKENS)
    sender = await pair.transport.open(pair.address, pair.header(), LAYOUT)
    for layer in range(3):  # each group comes within the lease, the whole transfer takes longer (0.6 s)
        await asyncio.sleep(0.1)
        await sender.send(KvTensors(layer, 0, k[layer:layer + 1], v[layer:layer + 1]))
        await asyncio.sleep(0.1)
    await sender.finish(4)
    assert await waiting == 4


async def test_a_stalled_transfer_times_out_after_the_lease(pairs):
    pair = await pairs()
    transfer = pair.receiver.expect("r1", 0, TOKEN, NUM_TOKENS)
    sender = await pair.transport.open(pair.address, pair.header(), LAYOUT)
    with pytest.raises(TimeoutError, match=r"no KV for r1 within the 0.2 s lease"):
        await transfer.wait(lease=0.2)
    sender.cancel()


def test_local_transport_needs_a_known_address():
    async def run():
        transport = LocalKvTransport({})
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await transport.open("nowhere", make_header(request_id="r", transfer_token=TOKEN), LAYOUT)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE

    asyncio.run(run())


def test_whole_kv_send_checks_the_arrays_first():
    async def run():
        transport = LocalKvTransport({})
        k, v, _, _ = random_kv(LAYOUT, NUM_TOKENS)
        with pytest.raises(ValueError, match="quantize first"):
            await transport.send("nowhere", make_header(num_tokens=NUM_TOKENS), LAYOUT, k.astype(np.float32), v, 1)

    asyncio.run(run())


async def _until(predicate) -> None:
    while not predicate():
        await asyncio.sleep(0.01)


async def test_a_stream_reads_on_while_its_pieces_are_written_and_ends_once_all_are(pairs):
    pair = await pairs()
    sink = pair.receiver.sink = GatedSink()
    transfer = pair.receiver.expect("r1", 0, TOKEN, NUM_TOKENS)
    k, v, _, _ = random_kv(LAYOUT, NUM_TOKENS)
    sender = await pair.transport.open(pair.address, pair.header(), LAYOUT)
    sending = asyncio.ensure_future(sender.send(KvTensors(0, 0, k, v)))  # 9 pieces, one stream
    await asyncio.wait_for(_until(lambda: sink.running == WRITES_IN_FLIGHT), 10)
    assert (sink.writes, transfer.done.done(), transfer.bytes_received) == ([], False, 0)
    sink.gate.set()
    await sending
    await sender.finish(first_token_id=5)
    assert await transfer.done == 5 and transfer.bytes_received == k.nbytes + v.nbytes
    assert (sink.most, len(sink.writes)) == (WRITES_IN_FLIGHT, 9)
    got_k, got_v = sink.assemble("r1", LAYOUT, NUM_TOKENS)
    assert got_k.tobytes() == k.tobytes() and got_v.tobytes() == v.tobytes()


async def test_a_cancelled_transfer_skips_the_writes_still_queued(pairs):
    pair = await pairs()
    sink = GatedSink()
    pair.receiver = KvReceiver(LAYOUT, FINGERPRINT, sink, write_threads=1)  # one write runs, the rest queue
    if pair.kind == "local":
        pair.transport.receivers[ADDRESS] = pair.receiver
    else:
        await pair.server.stop(None)
        pair.server = grpc.aio.server()
        add_receiver_to_server(pair.receiver, pair.server)
        pair.address = f"127.0.0.1:{pair.server.add_insecure_port('127.0.0.1:0')}"
        await pair.server.start()
    pair.receiver.expect("r1", 0, TOKEN, NUM_TOKENS)
    k, v, _, _ = random_kv(LAYOUT, NUM_TOKENS)
    sender = await pair.transport.open(pair.address, pair.header(), LAYOUT)
    sending = asyncio.ensure_future(sender.send(KvTensors(0, 0, k, v)))
    await asyncio.wait_for(_until(lambda: sink.running == 1 and len(pair.receiver._writes.get("r1", ())) == 4), 10)
    pair.receiver.cancel("r1")  # the decode worker gave the request up: its stream is cut
    sink.gate.set()
    await asyncio.wait_for(pair.receiver.settle("r1"), 10)
    assert len(sink.writes) == 1  # the running write landed; the three queued behind it wrote nothing
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await sending
        await sender.finish(first_token_id=5)
    assert err.value.code() == grpc.StatusCode.ABORTED


async def test_windowed_layers_send_only_the_blocks_their_window_still_needs(pairs):
    """Layers 0 and 2 with a window of 6 tokens, layer 1 global, a 21-token prompt in blocks of 4: the next
    query (position 21) reads keys 16.. in a windowed layer, so blocks 0-3 of layers 0 and 2 are never sent;
    the transfer completes, and the bytes are the global layer's 6 blocks plus 2 blocks of each windowed one."""
    layout = KvLayout(3, 2, 8, 4, "bfloat16", windows=(6, 0, 6))
    assert layout.stale_tokens(21) == (16, 0, 16) and layout.stale_tokens(5) == (0, 0, 0)
    pair = await pairs(num_streams=2, layout=layout)
    transfer = pair.receiver.expect("r1", 0, TOKEN, 21)
    k, v, _, _ = random_kv(layout, 21, seed=7)
    sender = await pair.transport.open(pair.address, pair.header(num_tokens=21), layout)
    await sender.send(KvTensors(0, 0, k[:2], v[:2]))  # layer groups: 0-1 (windowed, global), then 2
    await sender.send(KvTensors(2, 0, k[2:], v[2:]))
    assert await (sender.finish(first_token_id=4)) is not None and await transfer.done == 4
    cells = {(layer, t) for _, p in pair.sink.writes for layer in range(p.layer_start, p.layer_start + p.num_layers)
             for t in range(p.token_start, p.token_start + p.num_tokens, 4)}
    assert cells == {(1, t) for t in range(0, 21, 4)} | {(layer, t) for layer in (0, 2) for t in (16, 20)}
    per_token = 2 * 2 * 8 * 2  # K and V of one layer's token
    assert transfer.bytes_received == per_token * (21 + 2 * (21 - 16))
    got_k, _ = pair.sink.assemble("r1", layout, 21)
    assert got_k[1].tobytes() == k[1].tobytes() and got_k[0, 16:].tobytes() == k[0, 16:].tobytes()


async def test_a_sender_whose_windows_differ_is_refused_naming_both(pairs):
    ours = KvLayout(3, 2, 8, 4, "bfloat16", windows=(6, 0, 6))
    pair = await pairs(layout=ours)
    pair.receiver.expect("r1", 0, TOKEN, NUM_TOKENS)
    theirs = KvLayout(3, 2, 8, 4, "bfloat16")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await pair.transport.open(pair.address, make_header(layout=theirs, request_id="r1", attempt=0,
                                                            transfer_token=TOKEN, num_tokens=NUM_TOKENS), theirs)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "windows=6,0,6" in err.value.details() and "scales=none]" in err.value.details()
