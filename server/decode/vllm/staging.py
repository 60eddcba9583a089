"""Where a request's received KV waits for vLLM's workers: in this process (TP 1) or in /dev/shm (TP > 1).

With `--tensor-parallel-size 1` vLLM's model runs in the decode worker's own process, and the pieces
pdserve's receiver checked stay in a list (`LocalKv`). With T > 1 vLLM's multiprocess executor runs the
model in T rank processes; each rank reads the request's pieces from one shared-memory file and writes
its own slice of kv heads into its paged cache.

Life of a staged request (the engine and the connector pass ownership along):
1. Admission: `KvStaging.new(request_id)` opens a stage; with T > 1 an empty file
   `<root>/pdserve-kv-<pid>-<tag>/<attempt>-<request id>` (root: /dev/shm, where tmpfs holds it in memory).
2. The receiver's write threads `append` pieces (each writes at an offset reserved under a lock, so
   pieces of several streams land at once); the KV of admitted requests only, so what lies staged is
   bounded by the blocks the worker promised them.
3. The first token arrives: `seal()` gives the `StagedKv` the connector metadata carries to every
   rank: the file's path and each piece's place in it (`PieceSpan`), a few hundred bytes.
4. Each rank `read(rank, world)`s its kv heads (vLLM's split, `kv_head_range`) and writes them.
5. Once every rank said it read the file (the connector's worker metadata, summed over ranks by vLLM:
   `PendingReads`), or the request was aborted or failed before it was loaded, `release()` unlinks it.
`KvStaging.close()` removes the worker's directory, and a new worker removes those of dead ones
(`kill -9` leaves no stage behind for longer than the next start).
"""

from __future__ import annotations

import itertools
import mmap
import os
import shutil
import tempfile
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

import numpy as np

from pdserve.kvcache.codec import KvPiece

DIR_PREFIX = "pdserve-kv-"


def kv_head_range(num_kv_heads: int, rank: int, world: int) -> tuple[int, int]:
    """The kv heads [start, end) rank `rank` of `world` holds, as vLLM's QKVParallelLinear splits them:
    H/T each when T divides H; when T > H each head is replicated on T/H consecutive ranks."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not one of tensor parallel size {world}'s")
    if world >= num_kv_heads:
        if world % num_kv_heads:
            raise ValueError(f"tensor parallel size {world} is not a multiple of the model's {num_kv_heads} kv heads")
        head = rank // (world // num_kv_heads)
        return head, head + 1
    if num_kv_heads % world:
        raise ValueError(f"tensor parallel size {world} does not divide the model's {num_kv_heads} kv heads")
    per_rank = num_kv_heads // world
    return rank * per_rank, (rank + 1) * per_rank


def head_slice(piece: KvPiece, heads: tuple[int, int]) -> KvPiece:
    """The piece's KV of kv heads [start, end) (views)."""
    start, end = heads
    if (start, end) == (0, piece.k.shape[2]):
        return piece
    return KvPiece(piece.layer_start, piece.token_start, piece.k[:, :, start:end], piece.v[:, :, start:end])


@dataclass(frozen=True)
class LocalKv:
    """A request's pieces in this process (TP 1: vLLM's model runs here)."""

    pieces: tuple[KvPiece, ...]

    @property
    def num_tokens(self) -> int:
        return max((p.token_start + p.num_tokens for p in self.pieces), default=0)

    def read(self, rank: int, world: int) -> list[KvPiece]:
        return [head_slice(p, kv_head_range(p.k.shape[2], rank, world)) for p in self.pieces]

    def release(self) -> None:
        return


@dataclass(frozen=True)
class PieceSpan:
    """Where one piece lies in a stage file: its K [l, n, Hkv, D] at `offset`, its V right after."""

    layer_start: int
    token_start: int
    num_layers: int
    num_tokens: int
    offset: int


@dataclass(frozen=True)
class StagedKv:
    """A request's pieces in a shared-memory file: what the connector metadata carries to every rank."""

    path: str
    dtype: np.dtype
    num_kv_heads: int
    head_dim: int
    spans: tuple[PieceSpan, ...]

    @property
    def num_tokens(self) -> int:
        return max((s.token_start + s.num_tokens for s in self.spans), default=0)

    def read(self, rank: int, world: int) -> list[KvPiece]:
        """This rank's kv heads of every piece, copied out of the file (which is then closed)."""
        start, end = kv_head_range(self.num_kv_heads, rank, world)
        dtype = self.dtype
        pieces = []
        with open(self.path, "rb") as f:
            if not self.spans or os.fstat(f.fileno()).st_size == 0:
                return pieces
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                data = np.frombuffer(mm, np.uint8)
                for s in self.spans:
                    shape = (s.num_layers, s.num_tokens, self.num_kv_heads, self.head_dim)
                    size = int(np.prod(shape)) * dtype.itemsize
                    k = data[s.offset:s.offset + size].view(dtype).reshape(shape)
                    v = data[s.offset + size:s.offset + 2 * size].view(dtype).reshape(shape)
                    pieces.append(KvPiece(s.layer_start, s.token_start, k[:, :, start:end].copy(),
                                          v[:, :, start:end].copy()))
                del data, k, v  # no view may outlive the mapping
        return pieces

    def release(self) -> None:
        Path(self.path).unlink(missing_ok=True)


@dataclass
class LocalStage:
    """Collects a request's pieces in memory."""

    pieces: list[KvPiece] = field(default_factory=list)

    def append(self, piece: KvPiece) -> None:
        self.pieces.append(piece)  # atomic: the receiver's write threads may append at once

    def seal(self) -> LocalKv:
        return LocalKv(tuple(self.pieces))

    def discard(self) -> None:
        self.pieces.clear()


class SegmentStage:
    """Collects a request's pieces in a shared-memory file, appended from several threads at once."""

    def __init__(self, path: Path):
        self.path = path
        self._lock = threading.Lock()
        self._end = 0
        self._spans: list[PieceSpan] = []
        self._layout: tuple[np.dtype, int, int] | None = None  # dtype, kv heads, head dim
        path.touch(exist_ok=False)

    def append(self, piece: KvPiece) -> None:
        if piece.k_scales is not None:
            raise ValueError("a quantized piece cannot be staged for vLLM (its cache has no per-block scales)")
        layout = (piece.k.dtype, piece.k.shape[2], piece.k.shape[3])
        k, v = np.ascontiguousarray(piece.k), np.ascontiguousarray(piece.v)
        with self._lock:
            if self._layout not in (None, layout):
                raise ValueError(f"piece of {layout} in a stage of {self._layout}")
            self._layout = layout
            offset, self._end = self._end, self._end + k.nbytes + v.nbytes
        # A stage discarded meanwhile raises here (its file is gone); one discarded during the write
        # leaves the bytes in an unlinked inode, freed when this descriptor closes.
        fd = os.open(self.path, os.O_WRONLY)
        try:
            os.pwrite(fd, k.reshape(-1).view(np.uint8), offset)  # bytes: bf16's dtype has no buffer format
            os.pwrite(fd, v.reshape(-1).view(np.uint8), offset + k.nbytes)
        finally:
            os.close(fd)
        with self._lock:
            self._spans.append(PieceSpan(piece.layer_start, piece.token_start, piece.num_layers, piece.num_tokens,
                                         offset))

    def seal(self) -> StagedKv:
        with self._lock:
            dtype, heads, head_dim = self._layout or (np.dtype(np.float32), 1, 1)
            spans = tuple(sorted(self._spans, key=lambda s: s.offset))
        return StagedKv(str(self.path), dtype, heads, head_dim, spans)

    def discard(self) -> None:
        self.path.unlink(missing_ok=True)


Stage = LocalStage | SegmentStage
Staged = LocalKv | StagedKv


class PendingReads:
    """Stages sent to the ranks, each released once `world` ranks reported reading it."""

    def __init__(self, world: int):
        self.world = world
        self._reads: dict[str, tuple[Staged | None, int]] = {}

    def sent(self, key: str, staged: Staged | None) -> None:
        self._reads[key] = (staged, 0)

    def read(self, key: str, ranks: int) -> tuple[bool, Staged | None]:
        """`ranks` more ranks read the stage: (True, the stage, now released) once all have, else (False, None)."""
        if key not in self._reads:
            return False, None
        staged, read = self._reads[key]
        if read + ranks < self.world:
            self._reads[key] = (staged, read + ranks)
            return False, None
        del self._reads[key]
        if staged is not None:
            staged.release()
        return True, staged

    def release_all(self) -> list[str]:
        """Releases every stage still pending; their keys."""
        pending, self._reads = self._reads, {}
        for staged, _ in pending.values():
            if staged is not None:
                staged.release()
        return list(pending)

    def __len__(self) -> int:
        return len(self._reads)


class KvStaging:
    """Opens stages: in memory for one rank, in `<root>/pdserve-kv-<pid>-<tag>/` for several."""

    def __init__(self, shared: bool, root: Path | None = None):
        self.shared = shared
        self.dir: Path | None = None
        self._attempts = itertools.count()
        if shared:
            root = root or default_root()
            remove_dead_workers_stages(root)
            self.dir = root / f"{DIR_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
            self.dir.mkdir()

    def new(self, request_id: str) -> Stage:
        if self.dir is None:
            return LocalStage()
        return SegmentStage(self.dir / f"{next(self._attempts)}-{quote(request_id, safe='')[:100]}")

    def files(self) -> list[str]:
        """The stage files now present (empty in memory)."""
        return sorted(p.name for p in self.dir.iterdir()) if self.dir is not None and self.dir.exists() else []

    def close(self) -> None:
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)


def default_root() -> Path:
    """/dev/shm (memory) where the OS has it, else the temporary directory."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def remove_dead_workers_stages(root: Path) -> list[Path]:
    """Removes the stage directories of decode workers no longer running (a kill -9 leaves them)."""
    removed = []
    for d in root.glob(f"{DIR_PREFIX}*"):
        pid = d.name.removeprefix(DIR_PREFIX).partition("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True
