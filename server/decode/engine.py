"""The decode loop: continuous batching over the paged KV cache.

Life cycle of a request here:
1. `reserve` takes blocks for prompt + max_tokens from the pool (all or nothing).
2. The KV arrives through the receiver, which writes it into those blocks (`write`).
3. `start` puts the sequence, with the first token (sampled by prefill), into the running set.
4. Each step decodes one token for every running sequence: schedule, run, sample, postprocess.
   Sequences join and leave between steps.
5. `release` gives the blocks back, after the step that may still be writing them.
"""

from __future__ import annotations

import asyncio
import logging

import torch

from pdserve.kvcache.block_pool import BlockPool
from pdserve.kvcache.codec import KvPiece
from pdserve.kvcache.layout import KvLayout
from pdserve.server.decode.kv_cache import PagedKvCache
from pdserve.server.decode.model import DecoderModel
from pdserve.server.decode.sampler import sample
from pdserve.server.decode.sequence import Sequence, SeqState

log = logging.getLogger("pdserve.decode")


class DecodeEngine:
    def __init__(self, model: DecoderModel, layout: KvLayout, num_blocks: int, max_running: int):
        self.model = model
        self.layout = layout
        self.pool = BlockPool(num_blocks)
        self.cache = PagedKvCache(layout, num_blocks)
        self.max_running = max_running
        self.sequences: dict[str, Sequence] = {}
        self.running: list[Sequence] = []
        self._in_step: set[str] = set()
        self._deferred_free: list[list[int]] = []
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.steps = 0

    # ---- capacity ------------------------------------------------------------

    def blocks_needed(self, num_prompt_tokens: int, max_new_tokens: int, max_model_len: int) -> int:
        # The last sampled token's KV is never written, so the cache holds prompt + max_tokens - 1.
        tokens = min(num_prompt_tokens + max_new_tokens - 1, max_model_len)
        return self.layout.num_blocks(max(tokens, num_prompt_tokens))

    def reserve(self, seq: Sequence) -> None:
        """Registers the sequence; its block_table must already be allocated from self.pool."""
        self.sequences[seq.request_id] = seq

    # ---- the KV sink ------------------------------------------------------------

    def write(self, request_id: str, piece: KvPiece) -> None:
        seq = self.sequences.get(request_id)
        if seq is None or seq.state is not SeqState.WAITING_KV:
            raise KeyError(f"request {request_id} holds no blocks on this worker")
        self.cache.write(seq.block_table, piece.layer_start, piece.token_start, piece.k, piece.v,
                         piece.k_scales, piece.v_scales)

    # ---- running ----------------------------------------------------------------

    def start(self, seq: Sequence, first_token: int) -> None:
        """The KV is in place: the first token joins; the sequence decodes from the next step."""
        seq.state = SeqState.RUNNING
        seq.append(first_token)
        if seq.state is SeqState.FINISHED:
            seq.events.put_nowait(None)
            return
        self.running.append(seq)
        self._wakeup.set()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._loop(), name="decode-loop")

    def abort(self, request_id: str, reason: int) -> bool:
        seq = self.sequences.get(request_id)
        if seq is None:
            return False
        if seq.state is not SeqState.FINISHED:
            seq.finish(reason)
            seq.events.put_nowait(None)
        if seq in self.running:
            self.running.remove(seq)
        return True

    def release(self, seq: Sequence) -> None:
        """Frees the sequence's blocks: now, or after the step that is using them."""
        if self.sequences.get(seq.request_id) is seq:
            del self.sequences[seq.request_id]
        if seq in self.running:
            self.running.remove(seq)
        if seq.request_id in self._in_step:
            # The step running in its thread still reads this table: free (and forget) it after.
            self._deferred_free.append(seq.block_table)
            return
        if seq.block_table:
            self.pool.free(seq.block_table)
        seq.block_table = []

    async def _loop(self) -> None:
        while True:
            if not self.running:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            batch = list(self.running)
            self._in_step = {s.request_id for s in batch}
            try:
                tokens = await asyncio.to_thread(self._step, batch)
            except Exception:
                log.exception("decode step of %d requests failed; running them one by one", len(batch))
                tokens = await asyncio.to_thread(self._step_each, batch)
            finally:
                self._in_step = set()
                for blocks in self._deferred_free:
                    self.pool.free(blocks)
                self._deferred_free.clear()
            self.steps += 1
            self._postprocess(batch, tokens)

    def _step(self, batch: list[Sequence]) -> list[int]:
        """One token for every sequence in the batch (runs in a worker thread)."""
        last = torch.tensor([s.output_ids[-1] for s in batch], dtype=torch.int64)  # [B]
        positions = torch.tensor([s.num_tokens - 1 for s in batch], dtype=torch.int64)  # [B]
        width = max(len(s.block_table) for s in batch)
        tables = torch.tensor(
            [s.block_table + [s.block_table[0]] * (width - len(s.block_table)) for s in batch],
            dtype=torch.int64,
        )  # [B, M]
        logits = self.model.decode(last, positions, tables, positions + 1, self.cache)  # [B, V]
        sp = [s.sampling for s in batch]
        next_ids = sample(
            logits,
            torch.tensor([p.temperature for p in sp], dtype=torch.float32),
            torch.tensor([p.top_k for p in sp], dtype=torch.int64),
            torch.tensor([p.top_p for p in sp], dtype=torch.float32),
            [p.seed if p.HasField("seed") else None for p in sp],
            [s.sample_index for s in batch],
        )
        return next_ids.tolist()

    def _step_each(self, batch: list[Sequence]) -> list[int | None]:
        """After a failed batched step: each sequence alone, so only those that fail alone fail (None).
        Rewriting a slot the failed step may have written puts the same values there."""
        tokens: list[int | None] = []
        for seq in batch:
            try:
                tokens.append(self._step([seq])[0])
            except Exception as e:
                log.warning("request %s: its decode step fails on its own (%r); it ends with an error",
                            seq.request_id, e)
                tokens.append(None)
        return tokens

    def _postprocess(self, batch: list[Sequence], tokens: list[int | None] | None) -> None:
        from pdserve.v1 import generation_pb2 as gen_pb

        for i, seq in enumerate(batch):
            if seq.state is not SeqState.RUNNING:
                continue  # aborted or released while the step ran
            if tokens is None or tokens[i] is None:
                seq.finish(gen_pb.FINISH_REASON_ERROR)
            else:
                seq.append(tokens[i])
                seq.events.put_nowait([tokens[i]])
            if seq.state is SeqState.FINISHED:
                seq.events.put_nowait(None)
                if seq in self.running:
                    self.running.remove(seq)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
