"""Closed-loop OpenAI SSE streams from a client that costs little per event: raw asyncio, HTTP/1.1 keep-alive.

For the relay benchmark (`coordinator.py`). With httpx, the client process's work per event (h11
events, line iteration, per-chunk objects) outweighed the coordinator's on a 2-core machine, so the
client set the pace of the SSE rows. This client does only what a client must, in one `data_received`
per read: it frames the HTTP/1.1 response (status line, headers, chunked transfer coding or a
Content-Length body), splits the body into SSE events, parses every event's JSON and counts the text
of its choices (the benchmark's token is one character: one character is one token), and checks each
stream against what the fake workers sent: its tokens equal `max_tokens` and the usage the server
reports (`stream_options.include_usage`), it ends with `data: [DONE]`, nothing follows, and no event is
cut off. A stream cut by the end of a case (`stop`) is only checked not to exceed `max_tokens`.

Life cycle of one stream (`SseConnection`): connect; send the request; read its response; when the
terminating chunk arrives, check it, and send the next request on the same connection (unless the
server said `Connection: close`, or `stop` is set: then close; `run_sse_streams` reconnects).

As a process of its own (the benchmark runs one or several, so their CPU is measured apart from the
coordinator's and the benchmark's), on uvloop: each line on stdin asks for the counts so far (one JSON
line on stdout); the end of stdin stops the streams, and the final counts follow.

    python -m pdserve.benchmarks.load.sse_client --port P --streams N --body '{"model": ..., "stream": true, ...}'
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from pdserve.benchmarks.load.stream_count import StreamCount

_HEAD, _SIZE, _DATA, _DATA_END, _TRAILER, _BODY, _CLOSED = range(7)
"""Where the response parser is: headers; a chunk's size line, its data, the CRLF after it; the trailer
(after the last chunk); a Content-Length body; the connection is closing (nothing more is read)."""


def completion_request(host: str, port: int, body: dict) -> bytes:
    """One streamed `/v1/completions` POST, as bytes sent as they are for every request of a stream."""
    payload = json.dumps(body).encode()
    return (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nContent-Length: {len(payload)}\r\n\r\n").encode() + payload


class SseConnection(asyncio.Protocol):
    """One keep-alive connection running one closed-loop stream: a request, its SSE response, the next."""

    def __init__(self, request: bytes, max_tokens: int, count: StreamCount, stop: asyncio.Event):
        self.request = request
        self.max_tokens = max_tokens
        self.count = count
        self.stop = stop
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        """Done when the connection is gone (closed by either side)."""
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._new_response()
        self._waiting = False
        """A request is out and its response has not ended."""

    def _new_response(self) -> None:
        self._state = _HEAD
        self._status = 0
        self._left = 0  # bytes left of the chunk or the Content-Length body
        self._close_after = False
        self._body = bytearray()  # body bytes not yet split into events
        self._tokens = 0
        self._usage: int | None = None
        self._done = False  # `data: [DONE]` arrived
        self._failed = False  # an error event arrived (counted as an error, not a mismatch)

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._send()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._waiting and not self.stop.is_set():
            self.count.error(f"the server closed the connection mid-response ({exc!r}), "
                             f"{self._tokens} tokens in")
        if not self.closed.done():
            self.closed.set_result(None)

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        try:
            pos = self._parse(buf)
        except (ValueError, KeyError, TypeError) as e:  # bad framing or JSON: nothing further can be trusted
            self.count.mismatch(f"unparsable response ({e!r}) near {bytes(buf[:200])!r}")
            self._waiting = False
            self._state = _CLOSED
            self.transport.abort()
            return
        del buf[:pos]

    # parsing

    def _parse(self, buf: bytearray) -> int:
        """Consumes what `buf` holds of the response; returns how far it got."""
        pos, end = 0, len(buf)
        while pos < end:
            state = self._state
            if state == _CLOSED:
                return end
            if state == _DATA or state == _BODY:
                n = min(self._left, end - pos)
                self._body += buf[pos:pos + n]
                pos += n
                self._left -= n
                if self._left == 0:
                    self._state = _DATA_END if state == _DATA else _TRAILER
                    if self._status == 200:
                        self._events()
                    if state == _BODY:
                        self._ended()
                continue
            if state == _DATA_END:
                if end - pos < 2:
                    break
                if buf[pos:pos + 2] != b"\r\n":
                    raise ValueError("no CRLF after a chunk's data")
                pos += 2
                self._state = _SIZE
                continue
            if state == _HEAD:
                i = buf.find(b"\r\n\r\n", pos)
                if i < 0:
                    break
                self._head(bytes(buf[pos:i]))
                pos = i + 4
                continue
            i = buf.find(b"\r\n", pos)
            if i < 0:
                break
            line = bytes(buf[pos:i])
            pos = i + 2
            if state == _SIZE:
                size = int(line.partition(b";")[0], 16)
                self._state, self._left = (_TRAILER, 0) if size == 0 else (_DATA, size)
            elif not line:  # _TRAILER: the blank line that ends the response
                self._ended()
        return pos

    def _head(self, head: bytes) -> None:
        status_line, *lines = head.split(b"\r\n")
        self._status = int(status_line.split(b" ", 2)[1])
        headers = {}
        for line in lines:
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip().lower()
        self._close_after = headers.get(b"connection") == b"close"
        if self._status == 200 and not headers.get(b"content-type", b"").startswith(b"text/event-stream"):
            raise ValueError(f"a 200 response that is not an event stream: {head[:300]!r}")
        if headers.get(b"transfer-encoding") == b"chunked":
            self._state = _SIZE
        elif b"content-length" in headers:
            self._left = int(headers[b"content-length"])
            self._state = _BODY
            if not self._left:
                self._ended()
        else:
            raise ValueError(f"a response with neither chunks nor a length: {head[:300]!r}")

    def _events(self) -> None:
        """Takes every whole SSE event out of the body read so far."""
        body, start = self._body, 0
        while (j := body.find(b"\n\n", start)) >= 0:
            self._event(body[start:j])
            start = j + 2
        del body[:start]

    def _event(self, event: bytearray) -> None:
        if event.startswith(b"data: ") and b"\n" not in event:
            data = event[6:]
        else:  # the general form: several data lines (joined by newlines), comments, other fields
            data = b"\n".join(line[6:] if line.startswith(b"data: ") else line[5:]
                              for line in event.split(b"\n") if line.startswith(b"data:"))
        if self._done:
            raise ValueError(f"an event after data: [DONE]: {bytes(event[:200])!r}")
        if data == b"[DONE]":
            self._done = True
            return
        chunk = json.loads(data)
        if "error" in chunk:
            self._failed = True
            self.count.error(f"error event: {chunk['error']}")
            return
        choices = chunk["choices"]
        if chunk.get("usage"):
            self._usage = chunk["usage"]["completion_tokens"]
        if choices:
            n = 0
            for c in choices:
                n += len(c["text"])
            self._tokens += n
            self.count.tokens += n
            self.count.messages += 1
            if self._tokens > self.max_tokens:
                self.count.mismatch(f"a stream received {self._tokens} tokens; it asked for {self.max_tokens}")

    def _ended(self) -> None:
        """The response ended (its last chunk, or its whole Content-Length body): check it, go on."""
        self._waiting = False
        count = self.count
        if self._status != 200:
            count.error(f"HTTP {self._status}: {bytes(self._body[:300])!r}")
        elif self._failed:
            pass  # counted when its error event arrived
        elif self._body:
            count.mismatch(f"the stream ended inside an event: {bytes(self._body[:200])!r}")
        elif not self._done:
            count.mismatch(f"the stream ended without data: [DONE] after {self._tokens} tokens")
        elif self._usage is not None and self._usage != self._tokens:
            count.mismatch(f"the stream's usage says {self._usage} completion tokens; it carried {self._tokens}")
        else:
            count.ended(self._tokens, self.max_tokens, "SSE")
        if self._close_after or self.stop.is_set():
            self._state = _CLOSED
            self.transport.close()
        else:
            self._send()

    def _send(self) -> None:
        self._new_response()
        self._waiting = True
        self.transport.write(self.request)


async def run_sse_streams(host: str, port: int, body: dict, streams: int, count: StreamCount,
                          stop: asyncio.Event, ramp_s: float = 0.002) -> None:
    """`streams` closed-loop streams of `body` (a streamed completions request) until `stop`; stream i
    starts after i * ramp_s seconds."""
    loop = asyncio.get_running_loop()
    request = completion_request(host, port, body)
    live: set[SseConnection] = set()

    async def one(i: int) -> None:
        await asyncio.sleep(i * ramp_s)
        while not stop.is_set():
            conn = SseConnection(request, body["max_tokens"], count, stop)
            try:
                await loop.create_connection(lambda: conn, host, port)
            except OSError as e:
                count.error(f"connect to {host}:{port}: {e!r}")
                await asyncio.sleep(0.1)
                continue
            live.add(conn)
            if stop.is_set():  # connected after close_at_stop went through `live`
                conn.transport.abort()
            try:
                await conn.closed
            finally:
                live.discard(conn)

    async def close_at_stop() -> None:
        await stop.wait()
        for conn in list(live):
            conn.transport.abort()

    await asyncio.gather(close_at_stop(), *(one(i) for i in range(streams)))


async def serve_counts(port: int, body: dict, streams: int, ramp_s: float) -> None:
    """Runs the streams; answers each line on stdin with the counts so far; stops at the end of stdin."""
    count, stop = StreamCount(), asyncio.Event()
    streaming = asyncio.create_task(run_sse_streams("127.0.0.1", port, body, streams, count, stop, ramp_s))
    loop = asyncio.get_running_loop()
    stdin = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
    while await stdin.readline():
        print(json.dumps(vars(count)), flush=True)
    stop.set()
    await asyncio.wait_for(streaming, 60)
    print(json.dumps(vars(count)), flush=True)


def main() -> None:
    import uvloop

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True, help="the server's HTTP port on 127.0.0.1")
    p.add_argument("--streams", type=int, required=True)
    p.add_argument("--body", required=True, help="the streamed /v1/completions request, JSON (with max_tokens)")
    p.add_argument("--ramp-s", type=float, default=0.002, help="stream i starts after i * this many seconds")
    args = p.parse_args()
    uvloop.run(serve_counts(args.port, json.loads(args.body), args.streams, args.ramp_s))


if __name__ == "__main__":
    main()
