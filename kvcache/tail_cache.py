"""Tails: the KV of ended sequences' last, partial blocks, kept so that the next turn of a conversation reuses it.

The prefix cache names full blocks only, so a conversation's next turn (its history, the model's answer, new text)
would compute again the history's last partial block: up to block_size - 1 tokens a turn. When a sequence ends (or
is preempted), the scheduler hands its last partial block here as a `Tail`, keyed by the hash of the full-block
chain before it (None: the sequence's first block), the adapter's extra hash keys, and the tail's token ids. A new
sequence whose next tokens after its cached full blocks begin with a tail's tokens takes it (`take`): its KV is
copied into a fresh block of the new sequence (which writes after it: copy on write), and the tail is given back
(`add`) unchanged. A tail's block is never in a block table, so its KV never changes while it is here; it leaves
(its block freed) when the LRU bound is passed or when blocks are needed (`PrefixCache.allocate` evicts tails
first). Tails are not full blocks: no KV event names them.

With offload tiers, a tail that leaves is handed to `TailCache.spill` first (its block still intact): the decode
worker saves its KV under `tail_key`, a name of its own that no full block's hash can take, and a later turn loads
it back from there (`server/decode/kv_offload.py`).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

TAIL_KEY_PREFIX = b"pdserve-tail:"
"""Begins every tail's key in the offload tiers: with the 32-byte digest after it, 45 bytes, a length no block hash
has (sha256: 32, xxhash: 8 or 16), so a tail is never found, served or announced as a full block."""


@dataclass(frozen=True)
class Tail:
    block_id: int
    """The block holding the tail's KV in its first len(tokens) slots."""
    parent: bytes | None
    """The hash of the full block before it (None: the first block of its sequence)."""
    extra_keys: tuple | None
    """The adapter's extra hash keys (`adapter_key.extra_keys`): a tail is reused only under the same adapter."""
    tokens: tuple[int, ...]
    """Its token ids (1 .. block_size - 1 of them)."""

    @property
    def key(self) -> tuple:
        return self.parent, self.extra_keys, self.tokens


def tail_key(parent: bytes | None, extra_keys: tuple | None, tokens: tuple[int, ...]) -> bytes:
    """The tail's name in the offload tiers: `TAIL_KEY_PREFIX` and a sha256 of (parent, extra keys, token ids)."""
    return TAIL_KEY_PREFIX + hashlib.sha256(repr((parent, extra_keys, tuple(tokens))).encode()).digest()


def is_tail_key(key: bytes) -> bool:
    """Whether an offload tier's key names a tail (`tail_key`), not a full block."""
    return len(key) == len(TAIL_KEY_PREFIX) + 32 and key.startswith(TAIL_KEY_PREFIX)


class TailCache:
    """At most `max_blocks` tails, least recently used first; each holds one reference to its block, which the
    caller frees for the tails `add` and `evict` return."""

    def __init__(self, max_blocks: int, spill: Callable[[list[Tail]], None] | None = None) -> None:
        self.max_blocks = max_blocks
        self.spill = spill
        """Takes the tails `evict` drops, before their blocks are freed (the offload tiers' save)."""
        self._lru: OrderedDict[tuple, Tail] = OrderedDict()
        self._by_parent: dict[tuple, set[tuple[int, ...]]] = {}
        """(parent, extra keys) -> the token ids of the tails after that chain."""

    def __len__(self) -> int:
        return len(self._lru)

    def add(self, tail: Tail) -> list[int]:
        """Keeps the tail (most recently used); the block ids now unheld: the tail's own when an equal tail is kept
        already, or the least recently used tails' past the bound."""
        if self.max_blocks <= 0:
            return [tail.block_id]
        if tail.key in self._lru:
            self._lru.move_to_end(tail.key)
            return [tail.block_id]
        self._lru[tail.key] = tail
        self._by_parent.setdefault((tail.parent, tail.extra_keys), set()).add(tail.tokens)
        return self.evict(len(self._lru) - self.max_blocks)

    def take(self, parent: bytes | None, extra_keys: tuple | None, tokens: list[int]) -> Tail | None:
        """The longest tail after (parent, extra_keys) whose tokens begin `tokens`, taken out of the cache (its block
        reference now the caller's); None when no tail matches."""
        candidates = self._by_parent.get((parent, extra_keys))
        if not candidates:
            return None
        best = max((t for t in candidates if len(t) <= len(tokens) and list(t) == tokens[: len(t)]),
                   key=len, default=None)
        return None if best is None else self._remove((parent, extra_keys, best))

    def evict(self, n: int) -> list[int]:
        """Drops the n least recently used tails (fewer when fewer are kept), handed to `spill` first; their block
        ids."""
        victims = [self._remove(key) for key in list(self._lru)[: max(n, 0)]]
        if self.spill is not None and victims:
            self.spill(victims)
        return [tail.block_id for tail in victims]

    def _remove(self, key: tuple) -> Tail:
        tail = self._lru.pop(key)
        group = self._by_parent[(tail.parent, tail.extra_keys)]
        group.discard(tail.tokens)
        if not group:
            del self._by_parent[(tail.parent, tail.extra_keys)]
        return tail
