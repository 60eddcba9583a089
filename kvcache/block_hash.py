"""BlockHasher: a full KV block's name, computed exactly as vLLM 0.32 computes it (`hash_block_tokens`).

A block's hash is `hash_fn((parent hash or NONE_HASH, tuple(block's token ids), extra_keys))`, so equal
hashes mean equal prefixes. `hash_fn` is vLLM's `--prefix-caching-hash-algo`: sha256 (of the pickle, vLLM's
default), sha256_cbor (of canonical CBOR: language-neutral), xxhash / xxhash_cbor (need the xxhash package).
NONE_HASH, the first block's parent, is `hash_fn(seed)`: the seed is PYTHONHASHSEED when set, else the fixed
"vllm-none-hash" for the sha256 algorithms (every process agrees) and random per process for the xxhash ones
(vLLM's choice: their seed must stay secret). A router, vLLM workers and pdserve workers agree on a block's
name when they share the algorithm and the seed (PYTHONHASHSEED: set it fleet-wide, or leave it unset with a
sha256 algorithm). `extra_keys` is None for the base model; a LoRA adapter's blocks carry vLLM's
`("lora", name, path)` (`adapter_key.AdapterKey`), so KV computed with one adapter never names another's block.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Sequence
from typing import Any, Literal

PrefixCachingHashAlgo = Literal["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]
HASH_ALGOS: tuple[PrefixCachingHashAlgo, ...] = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
DEFAULT_HASH_ALGO: PrefixCachingHashAlgo = "sha256"
"""vLLM 0.32's default `--prefix-caching-hash-algo`."""
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
"""vLLM's seed of NONE_HASH for the cryptographic algorithms when PYTHONHASHSEED is unset."""


def _cbor(value: Any) -> bytes:
    import cbor2

    return cbor2.dumps(value, canonical=True)


def _pickle(value: Any) -> bytes:
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def _xxh3(data: bytes) -> bytes:
    try:
        import xxhash
    except ImportError:
        raise ValueError("--prefix-caching-hash-algo xxhash/xxhash_cbor needs the xxhash package "
                         "(pip install xxhash), or pick sha256 / sha256_cbor") from None
    return xxhash.xxh3_128_digest(data)


HASH_FUNCTIONS: dict[str, Callable[[Any], bytes]] = {
    "sha256": lambda v: hashlib.sha256(_pickle(v)).digest(),
    "sha256_cbor": lambda v: hashlib.sha256(_cbor(v)).digest(),
    "xxhash": lambda v: _xxh3(_pickle(v)),
    "xxhash_cbor": lambda v: _xxh3(_cbor(v)),
}


def none_hash_seed(algo: str) -> str:
    """The seed of NONE_HASH, resolved as vLLM's `resolve_none_hash_seed`."""
    seed = os.getenv("PYTHONHASHSEED")
    if seed is not None:
        return seed
    return os.urandom(32).hex() if algo.startswith("xxhash") else DEFAULT_NONE_HASH_SEED


class BlockHasher:
    def __init__(self, algo: str = DEFAULT_HASH_ALGO) -> None:
        if algo not in HASH_FUNCTIONS:
            raise ValueError(f"--prefix-caching-hash-algo must be one of {', '.join(HASH_ALGOS)}, not {algo!r}")
        self.algo = algo
        self.fn = HASH_FUNCTIONS[algo]
        self.none_hash = self.fn(none_hash_seed(algo))
        """The first block's parent (vLLM's NONE_HASH), fixed for this hasher's life."""

    def block(self, parent: bytes | None, token_ids: Sequence[int], extra_keys: tuple | None = None) -> bytes:
        """One block's hash (vLLM's `hash_block_tokens`); extra_keys: the LoRA adapter's (`adapter_key.py`)."""
        return self.fn((parent or self.none_hash, tuple(token_ids), extra_keys))

    def hashes(self, token_ids: list[int], block_size: int, limit: int | None = None,
               extra_keys: tuple | None = None) -> list[bytes]:
        """The chained hash of each full block of token_ids (of the first `limit` blocks when given)."""
        full = len(token_ids) // block_size
        return self.extend([], token_ids, block_size, full if limit is None else min(limit, full), extra_keys)

    def extend(self, hashes: list[bytes], token_ids: list[int], block_size: int, count: int,
               extra_keys: tuple | None = None) -> list[bytes]:
        """`hashes`, the chained hashes of token_ids' first blocks, extended in place to its first `count`
        full blocks (at most as many as it holds); returns the first `count` of them. extra_keys: every
        block's (a request's LoRA adapter: the same for each of its blocks)."""
        count = min(count, len(token_ids) // block_size)
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), count):
            parent = self.block(parent, token_ids[i * block_size : (i + 1) * block_size], extra_keys)
            hashes.append(parent)
        return hashes[:count]


DEFAULT_HASHER = BlockHasher()
"""vLLM's default algorithm, seeded at import (PYTHONHASHSEED or vLLM's fixed seed): what `block_hashes` uses
where no hasher is given (the coordinator's routing keys, the prefill tier's PrefixKv by default)."""
