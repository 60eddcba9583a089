"""DiskStore: a directory of KV blocks, one checked file per block: a local disk, or a directory every worker mounts.

A block's file is `<layout fingerprint>-<block hash hex>.kvb`: a header (magic, the fingerprint, the key's and the
payload's lengths, a blake2b digest of key and payload), the key, then the block's bytes. Life of a save:
1. The bytes go to a temporary file beside the final one (`.<name>.<pid>.<random>.tmp`), then `os.replace` names
   it: readers see a whole file or none, and concurrent writers of the same block (threads, or workers sharing the
   directory) each replace it with the same bytes.
2. Past the capacity, the least recently used files this worker knows of are deleted first.
3. A write that fails (ENOSPC on a full disk, any OSError) deletes its temporary file, logs a line and counts a
   save error: the block is a miss later, never an exception in the caller.
A read checks everything the header says; a file that fails (truncated, a flipped byte, another layout's bytes
under the name) is deleted and is a miss. A worker killed mid-save leaves only a temporary file, which no read
ever opens; at start a store deletes temporary files older than `STALE_TMP_S` (younger ones may be another
worker's save in progress).

A directory several workers share is bounded per worker: each counts and evicts the files it wrote or read.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import secrets
import struct
import threading
import time
from collections import OrderedDict
from pathlib import Path

from pdserve.kvcache.block_store import BlockStore, TierStats
from pdserve.kvcache.kv_events import MEDIUM_STORAGE, KvEventRecorder

log = logging.getLogger("pdserve.kvcache")

MAGIC = b"pdKVblk1"
HEADER = struct.Struct(">8s16sHQ32s")
"""magic, layout fingerprint (16 bytes), key length, payload length, blake2b-256 of key + payload."""
SUFFIX = ".kvb"
STALE_TMP_S = 600.0
"""A temporary file older than this at start is a dead writer's."""


def _digest(key: bytes, data: bytes | memoryview) -> bytes:
    h = hashlib.blake2b(digest_size=32)
    h.update(key)
    h.update(data)
    return h.digest()


class DiskStore(BlockStore):
    medium = MEDIUM_STORAGE

    def __init__(self, path: str | Path, capacity_bytes: int, fingerprint: str, *, name: str = "disk",
                 locality: str = "LOCAL", events: KvEventRecorder | None = None) -> None:
        """fingerprint: 32 hex digits (`block_bytes.layout_fingerprint`); capacity_bytes: 0 is unbounded."""
        if capacity_bytes < 0:
            raise ValueError(f"the {name} KV tier's size must be >= 0 (0: unbounded), got {capacity_bytes}")
        self.fingerprint = bytes.fromhex(fingerprint)
        if len(self.fingerprint) != 16:
            raise ValueError(f"a layout fingerprint is 32 hex digits, not {fingerprint!r}")
        self.path = Path(path)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"the {name} KV tier's directory {self.path} cannot be created ({e}); give a "
                             f"writable path") from None
        self.name = name
        self.locality = locality
        self.capacity_bytes = capacity_bytes
        self.events = events
        self.stats = TierStats()
        self._prefix = fingerprint + "-"
        self._index: OrderedDict[bytes, int] = OrderedDict()
        """Key -> file size, of the files this worker knows, least recently used first."""
        self._used = 0
        self._lock = threading.Lock()
        self._scan()

    @property
    def used_bytes(self) -> int:
        return self._used

    def file_for(self, key: bytes) -> Path:
        return self.path / f"{self._prefix}{key.hex()}{SUFFIX}"

    def _scan(self) -> None:
        """Indexes this layout's files (oldest first: the least recently used) and deletes dead writers'
        temporary files."""
        found: list[tuple[float, bytes, int]] = []
        now = time.time()
        for entry in os.scandir(self.path):
            try:
                if entry.name.endswith(".tmp") and now - entry.stat().st_mtime > STALE_TMP_S:
                    os.unlink(entry.path)
                elif entry.name.startswith(self._prefix) and entry.name.endswith(SUFFIX):
                    st = entry.stat()
                    found.append((st.st_mtime, bytes.fromhex(entry.name[len(self._prefix):-len(SUFFIX)]), st.st_size))
            except (OSError, ValueError):
                continue  # gone meanwhile (another worker), or not a name of ours
        for _, key, size in sorted(found):
            self._index[key] = size
            self._used += size
        with self._lock:
            self._make_room(0)

    def get(self, key: bytes) -> bytes | None:
        path = self.file_for(key)
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except OSError:
            with self._lock:
                self._forget(key)
                self.stats.misses += 1
            return None
        data = self._check(key, raw)
        with self._lock:
            if data is None:
                self.stats.rejected += 1
                self.stats.misses += 1
                self._unlink(path)
                self._forget(key)
                return None
            self.stats.hits += 1
            self.stats.bytes_read += len(data)
            if key in self._index:
                self._index.move_to_end(key)
            else:  # another worker's file (a shared directory): this worker bounds it from now on
                self._index[key] = len(raw)
                self._used += len(raw)
                self._make_room(0, keep=key)
        return data

    def _check(self, key: bytes, raw: bytes) -> bytes | None:
        """The payload when the file is whole and names this layout and key; else None (logged)."""
        if len(raw) < HEADER.size:
            log.warning("%s KV tier: %s is truncated (%d bytes); dropped, a miss", self.name, key.hex()[:16], len(raw))
            return None
        magic, fingerprint, key_len, length, digest = HEADER.unpack_from(raw)
        body = memoryview(raw)[HEADER.size :]
        if magic != MAGIC or fingerprint != self.fingerprint or key_len != len(key) \
                or len(body) != key_len + length or bytes(body[:key_len]) != key:
            log.warning("%s KV tier: %s has a bad header or length; dropped, a miss", self.name, key.hex()[:16])
            return None
        payload = body[key_len:]
        if _digest(key, payload) != digest:
            log.warning("%s KV tier: %s fails its checksum; dropped, a miss", self.name, key.hex()[:16])
            return None
        return bytes(payload)

    def put(self, key: bytes, data: bytes) -> bool:
        size = HEADER.size + len(key) + len(data)
        if self.capacity_bytes and size > self.capacity_bytes:
            return False
        path = self.file_for(key)
        with self._lock:
            if key in self._index:
                if path.exists():
                    self._index.move_to_end(key)
                    return True
                self._forget(key)  # another worker deleted it (a shared directory): written again
            self._make_room(size)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        header = HEADER.pack(MAGIC, self.fingerprint, len(key), len(data), _digest(key, data))
        try:
            self._write(tmp, header + key + data)
            os.replace(tmp, path)
        except OSError as e:
            self._unlink(tmp)
            with self._lock:
                self.stats.save_errors += 1
                first = self.stats.save_errors == 1
            if first or self.stats.save_errors % 1000 == 0:
                why = "the disk is full" if e.errno in (errno.ENOSPC, errno.EDQUOT) else str(e)
                log.warning("%s KV tier at %s: cannot save a block (%s; %d saves failed so far): it will be a miss; "
                            "free space or lower --kv-offloading-%s-size", self.name, self.path, why,
                            self.stats.save_errors, self.name)
            return False
        with self._lock:
            if key not in self._index:
                self._index[key] = size
                self._used += size
            self.stats.saves += 1
            self.stats.bytes_written += len(data)
            if self.events is not None:
                self.events.offloaded(key, self.medium, self.locality)
        return True

    @staticmethod
    def _write(path: Path, blob: bytes) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(blob)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)

    def contains(self, key: bytes) -> bool:
        with self._lock:
            if key in self._index:
                return True
        return self.file_for(key).exists()  # another worker's save (a shared directory)

    def evict(self, key: bytes) -> bool:
        with self._lock:
            known = key in self._index
            self._forget(key)
            removed = self._unlink(self.file_for(key))
            if (known or removed) and self.events is not None:
                self.events.removed(key, self.medium, self.locality)
            if known or removed:
                self.stats.evictions += 1
            return known or removed

    def _make_room(self, size: int, keep: bytes | None = None) -> None:
        """Deletes the least recently used files until `size` more bytes fit (under the lock)."""
        if not self.capacity_bytes:
            return
        while self._used + size > self.capacity_bytes and self._index:
            key = next(iter(self._index))
            if key == keep:
                if len(self._index) == 1:
                    return
                self._index.move_to_end(key)
                continue
            self._forget(key)
            self._unlink(self.file_for(key))
            self.stats.evictions += 1
            if self.events is not None:
                self.events.removed(key, self.medium, self.locality)

    def _forget(self, key: bytes) -> None:
        size = self._index.pop(key, None)
        if size is not None:
            self._used -= size

    @staticmethod
    def _unlink(path: Path) -> bool:
        try:
            os.unlink(path)
            return True
        except OSError:
            return False
