"""A prefill slice of several processes: process 0 serves, every other process replays its steps.

JAX runs a mesh that spans processes as one program per process (multi-controller SPMD): every process
must dispatch the same jitted programs, with the same global shapes, in the same order, or the
collectives inside them never meet. Process 0, the leader, is the worker: gRPC server, scheduler,
prefix KV, every prompt's host state, KV pushes. Each step it packs (`StepInputs`: host arrays only) goes
to the other processes, the followers, before process 0 dispatches it; each runs
`PrefillEngine.dispatch` on it. The outputs process 0 reads come back replicated over the mesh
(sharding.host_readable), so followers keep no state and send nothing back.

Life cycle of a slice:
1. Every process joins it (`jax.distributed`), loads and shards the model, and compiles every step
   shape on its own (compiling runs no collective).
2. `SliceLeader.listen`: process 0 listens on a port of every interface and publishes that port, on the
   host of the slice's coordinator address, with a fresh token, in JAX's key-value store (the slice's
   coordination service, which process 0 runs). `follow`: each follower reads it, connects, and proves it
   holds the token (HMAC with the cluster secret, when one is set); `SliceLeader.accept` waits for all.
3. `SliceLeader.run`: each step goes to every follower, then process 0 dispatches it; a follower
   dispatches each step it reads and waits for it.
4. `SliceLeader.stop` (the worker stops): followers are told to stop and exit 0. A follower that goes
   (its connection closes) ends process 0 with a message naming it, exit 1, and process 0's end ends
   the followers the same way: a step's collectives cannot meet without every process, and a step
   abandoned half-way leaves the rest out of step, so the whole slice restarts (as JAX's own heartbeat
   would end it, minutes later).

The channel is plain TCP inside the slice's network (like JAX's coordinator): each message is a JSON
header (kind, the step's KV formats, each array's name, dtype and shape) after its 8-byte length, then
the arrays' raw bytes.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

from pdserve.server.prefill.step_inputs import StepInputs

log = logging.getLogger("pdserve.prefill")

KEY = "pdserve/prefill/replay"
"""The key in JAX's key-value store under which process 0 publishes the channel's address and token."""
CONNECT_SECONDS = 600.0
"""How long process 0 waits for every follower to connect, and a follower for process 0's address
(each compiles every step shape first, minutes on a TPU)."""
MAX_HELLO_BYTES = 4096
DTYPES = {name: np.dtype(t) for name, t in (("int32", np.int32), ("uint32", np.uint32), ("float32", np.float32),
                                             ("float16", np.float16), ("bfloat16", ml_dtypes.bfloat16),
                                             ("bool", np.bool_))}
"""What a step's arrays may hold."""


def exit_slice(reason: str) -> None:
    """What the loss of a process does by default: say so, then end this one (exit 1)."""
    log.critical("prefill slice: %s; the slice cannot run a step without every process: exiting (restart the "
                 "whole slice)", reason)
    logging.shutdown()
    os._exit(1)


def publish(key: str, value: str) -> None:
    """Sets `key` in JAX's key-value store (the coordination service of jax.distributed)."""
    from jax._src.distributed import global_state  # no public API; orbax and jax's own serialization use it

    global_state.client.key_value_set(key, value)


def lookup(key: str, timeout: float = CONNECT_SECONDS) -> str:
    """`key`'s value in JAX's key-value store, waiting up to `timeout` seconds for it to be set."""
    from jax._src.distributed import global_state

    return global_state.client.blocking_key_value_get(key, int(timeout * 1000))


def coordinator_host() -> str:
    """The host of the slice's coordinator address: process 0's, reachable from every process."""
    from jax._src.distributed import global_state

    return global_state.coordinator_address.rsplit(":", 1)[0].strip("[]")


class SliceLeader:
    """Process 0's end of the channel: every step to every follower, before process 0 runs it."""

    def __init__(self, listener: socket.socket, address: str, token: bytes, num_followers: int,
                 secret: str | None = None, on_lost: Callable[[str], None] = exit_slice):
        self.address = address
        self.num_followers = num_followers
        self._listener = listener
        self._token = token
        self._secret = secret
        self._on_lost = on_lost
        self._followers: dict[int, socket.socket] = {}
        """process index -> its connection."""
        self._lock = threading.Lock()
        self._stopping = False

    @classmethod
    def listen(cls, num_followers: int, host: str, secret: str | None = None,
               publish: Callable[[str, str], None] = publish,
               on_lost: Callable[[str], None] = exit_slice) -> SliceLeader:
        """Listens on a free port of every interface and publishes `host`:port and a fresh token under KEY."""
        if socket.has_dualstack_ipv6():
            listener = socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True)
        else:
            listener = socket.create_server(("", 0))
        address = f"{host}:{listener.getsockname()[1]}"
        token = secrets.token_bytes(32)
        publish(KEY, json.dumps({"address": address, "token": token.hex()}))
        return cls(listener, address, token, num_followers, secret, on_lost)

    def accept(self, timeout: float = CONNECT_SECONDS) -> None:
        """Waits until every follower has connected and proved the token; refuses anything else."""
        deadline = time.monotonic() + timeout
        while len(self._followers) < self.num_followers:
            self._listener.settimeout(max(0.0, deadline - time.monotonic()))
            try:
                conn, peer = self._listener.accept()
            except TimeoutError:
                missing = sorted(set(range(1, self.num_followers + 1)) - set(self._followers))
                raise TimeoutError(f"processes {missing} of the prefill slice did not connect to process 0's replay "
                                   f"channel ({self.address}) within {timeout:.0f} s: start them with the same "
                                   "--coordinator-address and --num-processes, and let them reach that port") from None
            problem = self._greet(conn)
            if problem is not None:
                log.warning("prefill slice: refused a replay connection from %s: %s", peer, problem)
                conn.close()
        for process, conn in self._followers.items():
            threading.Thread(target=self._watch, args=(process, conn), name=f"replay-watch-{process}",
                             daemon=True).start()
        log.info("prefill slice: %d followers connected; they replay every step", self.num_followers)

    def _greet(self, conn: socket.socket) -> str | None:
        """Reads a follower's hello; keeps the connection and returns None, or says what is wrong."""
        conn.settimeout(10.0)
        try:
            message = _receive(conn, max_header=MAX_HELLO_BYTES, arrays=False)
        except (OSError, ValueError) as e:
            return f"no valid hello ({e})"
        if message is None or message[0].get("kind") != "hello":
            return "no hello"
        hello = message[0]
        process = hello.get("process")
        if not hmac.compare_digest(str(hello.get("proof", "")), proof(self._secret, self._token)):
            return "a wrong token (not a process of this slice, or another --cluster-secret-file)"
        if not isinstance(process, int) or not 1 <= process <= self.num_followers or process in self._followers:
            return f"process index {process!r} is not a follower still missing"
        conn.settimeout(None)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._followers[process] = conn
        return None

    def _watch(self, process: int, conn: socket.socket) -> None:
        """Followers send nothing after their hello: a read returns only when the connection ends."""
        try:
            conn.recv(1)
        except OSError:
            pass
        if not self._stopping:
            self._on_lost(f"process {process} stopped (its replay connection to process 0 closed)")

    def run(self, inputs: StepInputs, dispatch: Callable[[StepInputs], Any]) -> Any:
        """Sends the step to every follower, then dispatches it here."""
        with self._lock:
            if self._stopping:
                raise RuntimeError("the prefill slice is stopping: it runs no more steps")
            header, arrays = {"kind": "step", "formats": inputs.formats}, inputs.arrays()
            for process, conn in self._followers.items():
                try:
                    _send(conn, header, arrays)
                except OSError as e:
                    self._on_lost(f"process {process} could not be sent a step ({e})")
                    raise
        try:
            return dispatch(inputs)
        except Exception as e:
            self._on_lost(f"process 0 failed to dispatch a step the other processes run ({e!r})")
            raise

    def stop(self) -> None:
        """Tells every follower to stop (each exits 0) and closes the channel."""
        with self._lock:
            self._stopping = True
            for conn in self._followers.values():
                try:
                    _send(conn, {"kind": "stop"})
                except OSError:
                    pass  # gone already
                _close(conn)
            self._listener.close()


def follow(run: Callable[[StepInputs], None], process: int, secret: str | None = None,
           lookup: Callable[[str], str] = lookup, on_lost: Callable[[str], None] = exit_slice) -> None:
    """A follower's loop: connects to process 0 (found under KEY), then runs each step it sends (`run`
    dispatches it and waits) until it says stop."""
    published = json.loads(lookup(KEY))
    host, port = published["address"].rsplit(":", 1)
    try:
        conn = socket.create_connection((host, int(port)), timeout=CONNECT_SECONDS)
    except OSError as e:
        raise ConnectionError(f"cannot reach process 0's replay channel at {published['address']} ({e}): the slice's "
                              "processes must reach each other's ports, as they reach the coordinator address") from e
    conn.settimeout(None)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    _send(conn, {"kind": "hello", "process": process, "proof": proof(secret, bytes.fromhex(published["token"]))})
    log.info("prefill slice: process %d connected to process 0 at %s; replaying its steps", process,
             published["address"])
    steps = 0
    with conn:
        while True:
            try:
                message = _receive(conn)
            except (OSError, ValueError) as e:
                message, error = None, e
            else:
                error = None
            if message is None:
                on_lost(f"process 0's replay connection closed without a stop ({error or 'end of stream'})")
                return
            header, arrays = message
            if header.get("kind") == "stop":
                log.info("prefill slice: process 0 stopped the slice after %d steps; process %d exits", steps, process)
                return
            if header.get("kind") != "step":
                on_lost(f"process 0 sent a message of kind {header.get('kind')!r}, not a step or a stop")
                return
            try:
                run(StepInputs.from_arrays(arrays, tuple((d, int(b)) for d, b in header["formats"])))
            except Exception as e:
                log.exception("prefill slice: process %d failed a step", process)
                on_lost(f"process {process} failed a step ({e!r})")
                return
            steps += 1


def proof(secret: str | None, token: bytes) -> str:
    """What a follower sends to show it belongs: the token, keyed with the cluster secret when set."""
    return hmac.new((secret or "").encode(), token, "sha256").hexdigest()


def _close(conn: socket.socket) -> None:
    """Ends the connection, waking a thread blocked reading it."""
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    conn.close()


def _send(conn: socket.socket, header: dict, arrays: dict[str, np.ndarray] | None = None) -> None:
    arrays = {name: np.require(a, requirements="C") for name, a in (arrays or {}).items()}
    specs = [[name, a.dtype.name, list(a.shape)] for name, a in arrays.items()]
    head = json.dumps({**header, "arrays": specs}).encode()
    conn.sendall(struct.pack("!Q", len(head)) + head)
    for a in arrays.values():
        conn.sendall(a.reshape(-1).view(np.uint8))


def _receive(conn: socket.socket, max_header: int = 1 << 20, arrays: bool = True
             ) -> tuple[dict, dict[str, np.ndarray]] | None:
    """One message (header, arrays); None when the stream ends before one starts. arrays=False: a
    message that carries arrays is refused before anything is allocated for them."""
    size = _read(conn, 8, at_start=True)
    if size is None:
        return None
    (length,) = struct.unpack("!Q", size)
    if length > max_header:
        raise ValueError(f"a replay header of {length} bytes (at most {max_header})")
    header = json.loads(_read(conn, length))
    if not isinstance(header, dict):
        raise ValueError("a replay header that is not a JSON object")
    if header.get("arrays") and not arrays:
        raise ValueError("arrays in a message that has none")
    out = {}
    for name, dtype, shape in header.pop("arrays", []):
        if dtype not in DTYPES:
            raise ValueError(f"a replay array {name!r} of dtype {dtype!r}, not one of {', '.join(DTYPES)}")
        a = np.empty(shape, DTYPES[dtype])
        _read_into(conn, a.reshape(-1).view(np.uint8))
        out[name] = a
    return header, out


def _read(conn: socket.socket, n: int, at_start: bool = False) -> bytes | None:
    buf = bytearray(n)
    got = _read_into(conn, memoryview(buf), at_start)
    return None if got is None else bytes(buf)


def _read_into(conn: socket.socket, buf, at_start: bool = False) -> int | None:
    view, got = memoryview(buf).cast("B"), 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if n == 0:
            if at_start and got == 0:
                return None
            raise ConnectionError(f"the replay stream ended inside a message ({got} of {len(view)} bytes)")
        got += n
    return got
