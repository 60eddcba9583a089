"""The relay benchmark's SSE client on hand-written HTTP/1.1 responses, cut at every byte: exact counts,
and every way a stream can differ from what the workers sent caught."""

from __future__ import annotations

import asyncio
import json

from pdserve.benchmarks.load.sse_client import SseConnection, completion_request
from pdserve.benchmarks.load.stream_count import StreamCount

REQUEST = completion_request("127.0.0.1", 8000, {"model": "m", "prompt": [1], "max_tokens": 5, "stream": True})


class Transport:
    def __init__(self, conn: SseConnection):
        self.conn = conn
        self.written: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def close(self) -> None:
        self.closed = True
        self.conn.connection_lost(None)

    abort = close


def event(data: dict | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


def text(t: str, finish: str | None = None) -> bytes:
    return event({"id": "c", "choices": [{"index": 0, "text": t, "finish_reason": finish}], "usage": None})


def usage(n: int) -> bytes:
    return event({"id": "c", "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": n}})


def chunked(*chunks: bytes, close: bool = False) -> bytes:
    head = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
            + (b"connection: close\r\n" if close else b"") + b"transfer-encoding: chunked\r\n\r\n")
    return head + b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"


WHOLE = chunked(text("a"), text("aa"), text("a") + text("a", "length"), usage(5), event("[DONE]"))
"""Five tokens in four events (two in one chunk), the usage, [DONE]."""


def feed(response: bytes, piece: int, max_tokens: int = 5, stop: bool = False) -> tuple[StreamCount, Transport]:
    async def run() -> tuple[StreamCount, Transport]:
        count, done = StreamCount(), asyncio.Event()
        if stop:
            done.set()
        conn = SseConnection(REQUEST, max_tokens, count, done)
        transport = Transport(conn)
        conn.connection_made(transport)  # type: ignore[arg-type]
        for i in range(0, len(response), piece):
            conn.data_received(response[i:i + piece])
        return count, transport

    return asyncio.run(run())


def test_a_whole_stream_cut_anywhere_counts_its_tokens_events_and_one_checked_request():
    for piece in range(1, len(WHOLE) + 1):
        count, transport = feed(WHOLE, piece)
        assert (count.tokens, count.messages, count.requests, count.errors, count.mismatches) == (5, 4, 1, 0, 0), piece
        assert transport.written == [REQUEST, REQUEST]  # the next request on the same connection
        assert not transport.closed


def test_an_event_split_across_chunks_is_one_event():
    whole = text("aaa")
    response = chunked(text("a"), whole[:20], whole[20:], text("a", "length"), usage(5), event("[DONE]"))
    count, _ = feed(response, len(response))
    assert (count.tokens, count.messages, count.requests, count.mismatches) == (5, 3, 1, 0)


def test_two_responses_back_to_back_are_two_checked_requests():
    count, transport = feed(WHOLE + WHOLE, 3)
    assert (count.tokens, count.requests, count.mismatches) == (10, 2, 0)
    assert len(transport.written) == 3


def test_every_stream_that_differs_from_what_the_workers_sent_is_a_mismatch():
    cases = {
        "without data: [DONE]": chunked(text("aaaaa", "length"), usage(5)),
        "ended after 4 tokens": chunked(text("aaaa", "length"), usage(4), event("[DONE]")),
        "usage says 6": chunked(text("aaaaa", "length"), usage(6), event("[DONE]")),
        "received 6 tokens": chunked(text("aaaaaa", "length"), usage(6), event("[DONE]")),
        "event after data: [DONE]": chunked(text("aaaaa", "length"), event("[DONE]"), text("a")),
        "inside an event": chunked(text("aaaaa", "length"), event("[DONE]"), b"data: {"),
        "unparsable": chunked(b"data: {not json\n\n"),
    }
    for what, response in cases.items():
        count, _ = feed(response, 1)
        assert count.mismatches >= 1 and count.requests == 0, what
        assert what in count.first_mismatch, (what, count.first_mismatch)


def test_an_error_event_or_status_is_an_error_not_a_mismatch():
    count, _ = feed(chunked(text("aa"), event({"error": {"message": "decode worker gone"}}), event("[DONE]")), 7)
    assert (count.errors, count.mismatches, count.requests, count.tokens) == (1, 0, 0, 2)
    assert "decode worker gone" in count.first_error
    body = b'{"error": {"message": "queue full"}}'
    count, transport = feed(b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                            b"content-length: %d\r\n\r\n%s" % (len(body), body), 5)
    assert (count.errors, count.mismatches, count.requests) == (1, 0, 0)
    assert "HTTP 503" in count.first_error and "queue full" in count.first_error
    assert len(transport.written) == 2  # and the stream goes on


def test_stop_or_connection_close_ends_the_stream_after_its_response():
    for response, stop in ((WHOLE, True), (chunked(text("aaaaa", "length"), usage(5), event("[DONE]"), close=True),
                                           False)):
        count, transport = feed(response, 4, stop=stop)
        assert (count.requests, count.errors, count.mismatches) == (1, 0, 0)
        assert transport.written == [REQUEST] and transport.closed


def test_a_connection_lost_mid_response_is_an_error_unless_stopping():
    async def run(stopping: bool) -> StreamCount:
        count, stop = StreamCount(), asyncio.Event()
        conn = SseConnection(REQUEST, 5, count, stop)
        conn.connection_made(Transport(conn))  # type: ignore[arg-type]
        conn.data_received(WHOLE[:150])
        if stopping:
            stop.set()
        conn.connection_lost(None)
        assert conn.closed.done()
        return count

    assert asyncio.run(run(False)).errors == 1
    assert asyncio.run(run(True)).errors == 0
