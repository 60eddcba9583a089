"""Runs the model's decode and verify steps for the engine: eagerly, or on CUDA by replaying a CUDA graph
captured per batch bucket (decode) and per (batch bucket, new tokens) (speculative decoding's verify step).

`CudaGraphRunner` keeps one persistent device buffer of inputs, a row per sequence: [token id, position,
context length, block table...]. Each step fills a pinned host copy of it, pads the batch to the next
bucket (1, 2, 4, ..., 256) with rows that write into a pad block no sequence owns, copies it to the
device in one non-blocking transfer and replays that bucket's graph; the logits come back in the
graph's output buffer. A batch larger than the largest bucket, or a table wider than the graphs', runs
eagerly. A verify step of S = 2 .. k + 1 new tokens per row does the same through its own buffer
(`VerifyInputs`) and the graph of (bucket, S), for buckets up to `VERIFY_MAX_BUCKET`.
`--enforce-eager` (vLLM's flag) keeps every step eager.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import Literal

import torch

from pdserve.server import metrics
from pdserve.server.decode.kv_cache import PagedKvCache
from pdserve.server.decode.lora import LoraRows
from pdserve.server.decode.model import DecoderModel

log = logging.getLogger("pdserve.decode")

BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
VERIFY_MAX_BUCKET = 64
"""Verify steps get graphs for buckets up to this one: each (bucket, S) graph keeps logits [bucket, S, V] (at
batch 256, k = 4 and a 128k vocabulary, 1.8 GB for one bucket's graphs); larger verify batches run eagerly."""


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
               context_lens: torch.Tensor, lora: LoraRows | None = None) -> torch.Tensor:
        """Logits f32 [B, V] for token_ids, positions, context_lens [B] and block_tables [B, M] (host tensors);
        lora: each row's LoRA adapter."""
        self.steps["eager"] += 1
        return self.model.decode(token_ids, positions, block_tables, context_lens, self.cache, lora)

    def verify(self, token_ids: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor,
               context_lens: torch.Tensor, pad_slots: torch.Tensor, pad_slot: int) -> torch.Tensor:
        """Logits f32 [B, S, V] of a verify step (`DecoderModel.verify`): token_ids, positions, pad_slots
        [B, S], block_tables [B, M], context_lens [B] (host tensors)."""
        return self.model.verify(token_ids, positions, block_tables, context_lens, self.cache, pad_slots, pad_slot)


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


class VerifyInputs:
    """A verify step's inputs as one int64 buffer [rows, 3 S + 1 + max_blocks] (S = k + 1, the most new tokens
    a row has), pinned on the host when the device is CUDA, mirrored on the device: columns token ids [S],
    positions [S], pad entries [S] (1: its K/V goes to the pad slot), context length, block table. A step of
    fewer new tokens uses the first columns of each group."""

    def __init__(self, rows: int, max_new: int, max_blocks: int, pad_block: int, device: torch.device):
        self.max_new = max_new
        self.max_blocks = max_blocks
        self.pad_block = pad_block
        pinned = device.type == "cuda"
        self.host = torch.zeros(rows, 3 * max_new + 1 + max_blocks, dtype=torch.int64, pin_memory=pinned)
        self.device = self.host.to(device) if pinned else self.host.clone()  # [R, 3 S + 1 + M]
        self._copied = torch.cuda.Event() if pinned else None
        none = torch.zeros(0, max_new, dtype=torch.int64)
        self.fill(rows, none, none, none, none[:, :0], none[:, 0])  # every row a pad row
        self.device.copy_(self.host)

    def fill(self, rows: int, token_ids: torch.Tensor, positions: torch.Tensor, pad_slots: torch.Tensor,
             block_tables: torch.Tensor, context_lens: torch.Tensor) -> None:
        """The host buffer's first `rows` rows: the batch [B, S], then pad rows (every entry token 0 at position
        0 writing the pad slot, context 1, tables of the pad block)."""
        if self._copied is not None:
            self._copied.synchronize()  # the last step's transfer has read the host buffer
        B, S = token_ids.shape
        width = block_tables.shape[1]
        n, host, table = self.max_new, self.host, 3 * self.max_new + 1
        host[:B, :S] = token_ids
        host[:B, n : n + S] = positions
        host[:B, 2 * n : 2 * n + S] = pad_slots
        host[:B, 3 * n] = context_lens
        host[:B, table : table + width] = block_tables
        host[:B, table + width :] = self.pad_block
        host[B:rows, : 2 * n] = 0
        host[B:rows, 2 * n : 3 * n] = 1
        host[B:rows, 3 * n] = 1
        host[B:rows, table:] = self.pad_block

    def upload(self, rows: int) -> None:
        self.device[:rows].copy_(self.host[:rows], non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def views(self, rows: int, new: int) -> tuple[torch.Tensor, ...]:
        """(token ids [R, S], positions [R, S], block tables [R, M], context lengths [R], pad entries [R, S]) on
        the device for S = new: column views of the buffer, rows strided by its width."""
        d, n = self.device[:rows], self.max_new
        return d[:, :new], d[:, n : n + new], d[:, 3 * n + 1 :], d[:, 3 * n], d[:, 2 * n : 2 * n + new]


class CudaGraphRunner:
    """Decode steps replayed from CUDA graphs, one per bucket up to max_batch's; with verify_new (k + 1, the most
    new tokens a verify step has) verify steps too, one graph per (bucket, S) for S in 2 .. k + 1."""

    def __init__(self, model: DecoderModel, cache: PagedKvCache, max_batch: int, max_blocks: int, pad_block: int,
                 buckets: tuple[int, ...] = BUCKETS, verify_new: int = 0):
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
        self.pad_slot = pad_block * cache.block_size
        self.verify_buckets = tuple(b for b in self.buckets if b <= VERIFY_MAX_BUCKET) if verify_new > 1 else ()
        self.verify_new = tuple(range(2, verify_new + 1))
        self.verify_inputs = VerifyInputs(max(self.verify_buckets), verify_new, max_blocks, pad_block, cache.device) \
            if self.verify_buckets else None
        self.verify_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.verify_outputs: dict[tuple[int, int], torch.Tensor] = {}  # (bucket, S) -> logits [bucket, S, V]
        self.verify_steps: dict[RunnerKind, int] = {"graphs": 0, "eager": 0}
        """Verify steps run so far, by how they ran."""
        self._pool = None

    def capture(self) -> list[int]:
        """One graph per bucket, the largest first (the others reuse its memory pool); prints progress.
        A bucket whose capture fails is logged as an error and counted (pdserve_cuda_graph_capture_failures),
        and its batches run eagerly; returns the buckets that failed."""
        t0 = time.perf_counter()
        failed = []
        for bucket in sorted(self.buckets, reverse=True):
            try:
                graph = self._capture(bucket, self._pool)
            except Exception:
                failed.append(bucket)
                metrics.cuda_graph_capture_failures.inc()
                log.exception("capturing the decode step's CUDA graph for batch %d FAILED: its batches run eagerly "
                              "(slower); --enforce-eager skips CUDA graphs altogether", bucket)
                self._synchronize()
                continue
            self._pool = graph.pool()
            self.graphs[bucket] = graph
            log.info("captured the decode step's CUDA graph for batch %d (%.1f s so far)", bucket,
                     time.perf_counter() - t0)
        self._synchronize()
        return failed

    def capture_verify(self) -> list[tuple[int, int]]:
        """One verify graph per (bucket, S), the largest first, in the decode graphs' memory pool; a failed
        capture is logged and counted as a decode bucket's is, and its steps run eagerly. Returns those failed."""
        t0 = time.perf_counter()
        failed = []
        for bucket in sorted(self.verify_buckets, reverse=True):
            for new in sorted(self.verify_new, reverse=True):
                try:
                    graph = self._capture_verify(bucket, new, self._pool)
                except Exception:
                    failed.append((bucket, new))
                    metrics.cuda_graph_capture_failures.inc()
                    log.exception("capturing the verify step's CUDA graph for batch %d x %d new tokens FAILED: those "
                                  "steps run eagerly (slower); --enforce-eager skips CUDA graphs altogether", bucket,
                                  new)
                    self._synchronize()
                    continue
                self._pool = graph.pool()
                self.verify_graphs[(bucket, new)] = graph
            log.info("captured the verify step's CUDA graphs for batch %d, %s new tokens (%.1f s so far)", bucket,
                     "/".join(map(str, self.verify_new)), time.perf_counter() - t0)
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

    def _capture_verify(self, bucket: int, new: int, pool) -> torch.cuda.CUDAGraph:
        tokens, positions, tables, lens, pad = self.verify_inputs.views(bucket, new)
        run = lambda: self.model.verify(tokens, positions, tables, lens, self.cache, pad, self.pad_slot)  # noqa: E731
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                run()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self.verify_outputs[(bucket, new)] = run()
        return graph

    def verify_kind(self, batch: int, new: int, width: int = 0) -> RunnerKind:
        """How a verify step of `batch` rows of `new` tokens, tables `width` blocks wide, runs."""
        bucket = bucket_for(batch, self.verify_buckets) if self.verify_buckets else None
        fits = self.verify_inputs is not None and width <= self.verify_inputs.max_blocks
        return "graphs" if (bucket, new) in self.verify_graphs and fits else "eager"

    def verify(self, token_ids: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor,
               context_lens: torch.Tensor, pad_slots: torch.Tensor, pad_slot: int) -> torch.Tensor:
        """As `EagerRunner.verify`; replayed, the logits are a view of the graph's output, valid until the next
        verify step. pad_slot must be the runner's own (its graphs write there)."""
        if pad_slot != self.pad_slot:
            raise ValueError(f"the verify step's pad slot {pad_slot} is not the CUDA graphs' {self.pad_slot}: give "
                             f"the speculator and the runner the same pad block")
        B, new = token_ids.shape
        kind = self.verify_kind(B, new, block_tables.shape[1])
        self.verify_steps[kind] += 1
        if kind == "eager":
            return self.eager.verify(token_ids, positions, block_tables, context_lens, pad_slots, pad_slot)
        bucket = bucket_for(B, self.verify_buckets)
        self.verify_inputs.fill(bucket, token_ids, positions, pad_slots, block_tables, context_lens)
        self.verify_inputs.upload(bucket)
        self.verify_graphs[(bucket, new)].replay()
        return self.verify_outputs[(bucket, new)][:B]

    def decode(self, token_ids: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor,
               context_lens: torch.Tensor, lora: LoraRows | None = None) -> torch.Tensor:
        """As `EagerRunner.decode`; the logits are a view of the bucket's output, valid until the next step. A
        step with LoRA adapters runs eagerly (no graph holds their gather yet)."""
        B, width = block_tables.shape
        kind = "eager" if lora is not None else self.kind(B, width)
        self.steps[kind] += 1
        if kind == "eager":
            return self.eager.decode(token_ids, positions, block_tables, context_lens, lora)
        bucket = bucket_for(B, self.buckets)
        self.inputs.fill(bucket, token_ids, positions, block_tables, context_lens)
        self.inputs.upload(bucket)
        self.graphs[bucket].replay()
        return self.outputs[bucket][:B]
