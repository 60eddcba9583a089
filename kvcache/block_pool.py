"""Logical KV block ids with reference counts. Pure Python: physical storage lives in the tiers."""

from __future__ import annotations

from collections import Counter, deque


class OutOfBlocks(Exception):
    """An allocation asked for more blocks than are free; nothing was allocated."""

    def __init__(self, requested: int, free: int, total: int) -> None:
        super().__init__(f"asked for {requested} KV blocks but only {free} of {total} are free")
        self.requested = requested
        self.free = free
        self.total = total


class BlockPool:
    """Hands out block ids 0..num_blocks-1: lowest ids first from a fresh pool, freed ids reused FIFO."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_total = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """n blocks, each with ref count 1; all or nothing (OutOfBlocks)."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self._free):
            raise OutOfBlocks(n, len(self._free), self.num_total)
        block_ids = [self._free.popleft() for _ in range(n)]
        for block_id in block_ids:
            self._ref_counts[block_id] = 1
        return block_ids

    def free(self, block_ids: list[int]) -> None:
        """Drops one reference per id; a block returns to the free list when its count reaches 0.

        Validates every id first, so a bad call (a free block, an unknown id) changes nothing.
        """
        for block_id, times in Counter(block_ids).items():
            held = self.ref_count(block_id)
            if times > held:
                state = "already free" if held == 0 else f"held {held} time(s)"
                raise ValueError(f"cannot free block {block_id} {times} time(s): it is {state}")
        for block_id in block_ids:
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free.append(block_id)

    def incref(self, block_ids: list[int]) -> None:
        """Adds one reference per id (a shared prefix); every block must be allocated."""
        for block_id in block_ids:
            if self.ref_count(block_id) == 0:
                raise ValueError(f"cannot share block {block_id}: it is free")
        for block_id in block_ids:
            self._ref_counts[block_id] += 1

    def ref_count(self, block_id: int) -> int:
        if not 0 <= block_id < self.num_total:
            raise ValueError(f"block id {block_id} is outside this pool's 0..{self.num_total - 1}")
        return self._ref_counts[block_id]
