"""Runs the model's decode step for the engine: eagerly, or on CUDA by replaying a CUDA graph captured
per batch bucket.

`CudaGraphRunner` keeps one persistent device buffer of inputs, a row per sequence: [token id, position,
context length, block table...]. Each step fills a pinned host copy of it, pads the batch to the next
bucket (1, 2, 4, ..., 256) with rows that write into a pad block no sequence owns, copies it to the
device in one non-blocking transfer and replays that bucket's graph; the logits come back in the
graph's output buffer. A batch larger than the largest bucket, or a table wider than the graphs', runs
eagerly. `--enforce-eager` (vLLM's flag) keeps every step eager.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import Literal

import torch

from pdserve.server import metrics
from pdserve.server.decode.kv_cache import PagedKvCache
from pdserve.server.decode.model import DecoderModel

log = logging.getLogger("pdserve.decode")

BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def bucket_for(batch: int, buckets: tuple[int, ...] = BUCKETS) -> int | None:
    """The smallest bucket holding the batch; None when it is larger than them all."""
    i = bisect.bisect_left(buckets, batch)
    return buckets[i] if i < len(buckets) else None


RunnerKind = Literal["graphs", "eager"]


class EagerRunner:
    def __init__(self, model: DecoderModel, cache: PagedKvCache):
        self.model = model
        self.cache = cache
        self.steps: dict[RunnerKind, int] = {"graphs": 0, "eager": 0}
        """Decode steps run so far, by how they ran (what a benchmark's rows name)."""

    def kind(self, batch: int, width: int = 0) -> RunnerKind:
        """How a step of `batch` rows with tables `width` blocks wide runs: always eagerly here."""
        return "eager"

    def decode(self, token_ids: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor,
               context_lens: torch.Tensor) -> torch.Tensor:
        """Logits f32 [B, V] for token_ids, positions, context_lens [B] and block_tables [B, M] (host tensors)."""
        self.steps["eager"] += 1
        return self.model.decode(token_ids, positions, block_tables, context_lens, self.cache)


class GraphInputs:
    """The decode step's inputs as one int64 buffer [rows, 3 + max_blocks], pinned on the host when the
    device is CUDA, mirrored on the device: columns token id, position, context length, block table."""

    def __init__(self, rows: int, max_blocks: int, pad_block: int, device: torch.device):
        self.max_blocks = max_blocks
        self.pad_block = pad_block
        pinned = device.type == "cuda"
        self.host = torch.zeros(rows, 3 + max_blocks, dtype=torch.int64, pin_memory=pinned)  # [R, 3 + M]
        self.device = self.host.to(device) if pinned else self.host.clone()  # [R, 3 + M]
        self._copied = torch.cuda.Event() if pinned else None
        none = torch.zeros(0, dtype=torch.int64)
        self.fill(rows, none, none, none[:, None], none)  # every row a pad row, before any step (and warm-up)
        self.device.copy_(self.host)

    def fill(self, rows: int, token_ids: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor,
             context_lens: torch.Tensor) -> None:
        """The host buffer's first `rows` rows: the batch, then pad rows (token 0 at position 0 of the pad
        block, context 1); the table's columns past its width point at the pad block too."""
        if self._copied is not None:
            self._copied.synchronize()  # the last step's transfer has read the host buffer
        B, width = block_tables.shape
        host = self.host
        host[:B, 0] = token_ids
        host[:B, 1] = positions
        host[:B, 2] = context_lens
        host[:B, 3 : 3 + width] = block_tables
        host[:B, 3 + width :] = self.pad_block
        host[B:rows, :3] = torch.tensor([0, 0, 1])
        host[B:rows, 3:] = self.pad_block

    def upload(self, rows: int) -> None:
        self.device[:rows].copy_(self.host[:rows], non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def views(self, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(token ids [R], positions [R], block tables [R, M], context lengths [R]) on the device: column
        views of the buffer, strided by its row (3 + M); the tables' rows contiguous. The paged kernel reads
        the lengths through their stride."""
        d = self.device[:rows]
        return d[:, 0], d[:, 1], d[:, 3:], d[:, 2]


class CudaGraphRunner:
    """Decode steps replayed from CUDA graphs, one per bucket up to max_batch's."""

    def __init__(self, model: DecoderModel, cache: PagedKvCache, max_batch: int, max_blocks: int, pad_block: int,
                 buckets: tuple[int, ...] = BUCKETS):
        self.model = model
        self.cache = cache
        self.eager = EagerRunner(model, cache)
        top = bucket_for(max_batch, buckets) or buckets[-1]
        self.buckets = tuple(b for b in buckets if b <= top)
        self.inputs = GraphInputs(top, max_blocks, pad_block, cache.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.steps: dict[RunnerKind, int] = {"graphs": 0, "eager": 0}
        """Decode steps run so far, by how they ran: replayed from a graph, or eagerly (no bucket, too wide,
        or its capture failed)."""
        self.outputs: dict[int, torch.Tensor] = {}  # bucket -> logits [bucket, V] written by its graph

    def capture(self) -> list[int]:
        """One graph per bucket, the largest first (the others reuse its memory pool); prints progress.
        A bucket whose capture fails is logged as an error and counted (pdserve_cuda_graph_capture_failures),
        and its batches run eagerly; returns the buckets that failed."""
        t0 = time.perf_counter()
        pool = None
        failed = []
        for bucket in sorted(self.buckets, reverse=True):
            try:
                graph = self._capture(bucket, pool)
            except Exception:
                failed.append(bucket)
                metrics.cuda_graph_capture_failures.inc()
                log.exception("capturing the decode step's CUDA graph for batch %d FAILED: its batches run eagerly "
                              "(slower); --enforce-eager skips CUDA graphs altogether", bucket)
                self._synchronize()
                continue
            pool = graph.pool()
            self.graphs[bucket] = graph
            log.info("captured the decode step's CUDA graph for batch %d (%.1f s so far)", bucket,
                     time.perf_counter() - t0)
        self._synchronize()
        return failed

    def _synchronize(self) -> None:
        if self.cache.device.type == "cuda":
            torch.cuda.synchronize(self.cache.device)

    def kind(self, batch: int, width: int = 0) -> RunnerKind:
        """How a step of `batch` rows with tables `width` blocks wide runs: "graphs" when its bucket was
        captured and the table fits the graphs' width, else "eager"."""
        bucket = bucket_for(batch, self.buckets)
        return "graphs" if bucket in self.graphs and width <= self.inputs.max_blocks else "eager"

    def _capture(self, bucket: int, pool) -> torch.cuda.CUDAGraph:
        args = (*self.inputs.views(bucket), self.cache)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up: kernels compiled, workspaces allocated
            for _ in range(2):
                self.model.decode(args[0], args[1], args[2], args[3], self.cache)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self.outputs[bucket] = self.model.decode(args[0], args[1], args[2], args[3], self.cache)
        return graph

    def decode(self, token_ids: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor,
               context_lens: torch.Tensor) -> torch.Tensor:
        """As `EagerRunner.decode`; the logits are a view of the bucket's output, valid until the next step."""
        B, width = block_tables.shape
        kind = self.kind(B, width)
        self.steps[kind] += 1
        if kind == "eager":
            return self.eager.decode(token_ids, positions, block_tables, context_lens)
        bucket = bucket_for(B, self.buckets)
        self.inputs.fill(bucket, token_ids, positions, block_tables, context_lens)
        self.inputs.upload(bucket)
        self.graphs[bucket].replay()
        return self.outputs[bucket][:B]
