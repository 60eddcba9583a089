"""What a KV cache looks like, and the handshake that refuses a cache of another shape."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import ml_dtypes
import numpy as np

from pdserve.v1 import worker_pb2 as pb

KvDtype = Literal["float32", "bfloat16", "float16", "fp8_e4m3", "int8"]
ScaleGranularity = Literal["none", "block_head"]
LayoutKind = Literal["heads", "mla_latent"]
"""What a token's KV is: heads (K and V, num_kv_heads x head_dim each) or mla_latent (multi-head latent
attention: one latent of head_dim values, num_kv_heads 1, K only: no V is cached or sent)."""

NUMPY_DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
    "fp8_e4m3": np.dtype(ml_dtypes.float8_e4m3fn),
    "int8": np.dtype(np.int8),
}
QUANTIZED: frozenset[str] = frozenset({"fp8_e4m3", "int8"})


class ModelShape(Protocol):
    """What a cache's layout needs of a model (server/model/config.py ModelConfig has it)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    layer_windows: tuple[int | None, ...]


class HandshakeError(ValueError):
    """The sender's model or KV layout differs from the receiver's."""


@dataclass(frozen=True)
class KvLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: KvDtype
    scale_granularity: ScaleGranularity = "none"
    windows: tuple[int, ...] = ()
    """Each layer's sliding window (0: full attention); () when no layer has one."""
    kind: LayoutKind = "heads"

    def __post_init__(self) -> None:
        if self.dtype not in NUMPY_DTYPES:
            raise ValueError(f"kv dtype {self.dtype!r} is not one of {', '.join(NUMPY_DTYPES)}")
        if min(self.num_layers, self.num_kv_heads, self.head_dim, self.block_size) <= 0:
            raise ValueError(f"every KV layout dimension must be positive: {self}")
        if self.scale_granularity != self.scales_for(self.dtype):
            raise ValueError(f"kv dtype {self.dtype} needs scale granularity block_head, others none")
        bad = len(self.windows) != self.num_layers or min(self.windows) < 0 or not any(self.windows)
        if self.windows and bad:
            raise ValueError(f"layer windows {list(self.windows)}: one per layer ({self.num_layers}), >= 0, "
                             f"some > 0")
        if self.kind not in ("heads", "mla_latent"):
            raise ValueError(f"KV layout kind {self.kind!r} is not heads or mla_latent")
        if self.latent and self.num_kv_heads != 1:
            raise ValueError(f"an mla_latent layout has one latent per token (num_kv_heads 1), not {self.num_kv_heads}")

    @classmethod
    def of(cls, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: KvDtype,
           windows: tuple[int | None, ...] = (), kind: LayoutKind = "heads") -> KvLayout:
        """The layout of a cache of `dtype`, with the scales that dtype carries; windows: each layer's sliding
        window (None or 0: full attention), as ModelConfig.layer_windows gives them."""
        return cls(num_layers, num_kv_heads, head_dim, block_size, dtype, cls.scales_for(dtype),
                   tuple(w or 0 for w in windows), kind)

    @classmethod
    def for_model(cls, model: ModelShape, block_size: int, dtype: KvDtype) -> KvLayout:
        """The layout of a model's cache (server/model/config.py ModelConfig, or anything with its shape): an
        MLA model's (`mla` set) is its latent, num_kv_heads 1 and head_dim the latent's width."""
        kind: LayoutKind = "heads" if getattr(model, "mla", None) is None else "mla_latent"
        return cls.of(num_layers=model.num_layers, num_kv_heads=model.num_kv_heads, head_dim=model.head_dim,
                      block_size=block_size, dtype=dtype, windows=model.layer_windows, kind=kind)

    @property
    def latent(self) -> bool:
        """The cache holds MLA latents: K only."""
        return self.kind == "mla_latent"

    @property
    def value_dim(self) -> int:
        """Each head's V width: head_dim, or 0 for a latent (no V)."""
        return 0 if self.latent else self.head_dim

    @property
    def value_heads(self) -> int:
        """V's heads, and so V's scales per block: num_kv_heads, or 0 for a latent (its V [.., 1, 0] has none)."""
        return 0 if self.latent else self.num_kv_heads

    @staticmethod
    def scales_for(dtype: str) -> ScaleGranularity:
        """Quantized dtypes carry a float32 scale per block per kv head; the others none."""
        return "block_head" if dtype in QUANTIZED else "none"

    @property
    def np_dtype(self) -> np.dtype:
        return NUMPY_DTYPES[self.dtype]

    @property
    def bytes_per_token(self) -> int:
        """K and V bytes of one token over all layers (scales excluded); a latent's K only."""
        return (self.head_dim + self.value_dim) * self.num_layers * self.num_kv_heads * self.np_dtype.itemsize

    def num_blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_behind_windows(self, first_query: int) -> int:
        """Leading blocks that no layer reads again once queries start at `first_query` (see the function)."""
        return blocks_behind_windows(self.windows, self.block_size, first_query)

    def stale_tokens(self, num_tokens: int) -> tuple[int, ...]:
        """Per layer, the leading tokens (whole blocks) of an n-token prompt that no later query reads: a
        windowed layer's query at position p >= n reads keys p - W < j, so the blocks wholly before n - W + 1
        are never read again (0 for a full-attention layer)."""
        if not self.windows:
            return (0,) * self.num_layers
        bs = self.block_size
        return tuple(max(0, num_tokens - w + 1) // bs * bs if w else 0 for w in self.windows)

    def describe(self) -> str:
        return (
            f"layers={self.num_layers} kv_heads={self.num_kv_heads} head_dim={self.head_dim} "
            f"block_size={self.block_size} dtype={self.dtype} scales={self.scale_granularity}"
            + (f" windows={','.join(map(str, self.windows))}" if self.windows else "")
            + (" kind=mla_latent" if self.latent else "")
        )

    def to_proto(self) -> pb.KvLayout:
        return pb.KvLayout(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            block_size=self.block_size,
            dtype=self.dtype,
            scale_granularity=self.scale_granularity,
            layer_windows=self.windows,
            layout_kind="" if self.kind == "heads" else self.kind,
        )

    @classmethod
    def from_proto(cls, msg: pb.KvLayout) -> KvLayout:
        return cls(
            num_layers=msg.num_layers,
            num_kv_heads=msg.num_kv_heads,
            head_dim=msg.head_dim,
            block_size=msg.block_size,
            dtype=msg.dtype,  # type: ignore[arg-type]
            scale_granularity=msg.scale_granularity or "none",  # type: ignore[arg-type]
            windows=tuple(msg.layer_windows),
            kind=msg.layout_kind or "heads",  # type: ignore[arg-type]
        )


def blocks_behind_windows(windows: tuple[int, ...], block_size: int, first_query: int) -> int:
    """The leading blocks wholly behind every layer's sliding window for queries at positions >= first_query
    (a query at p reads keys p - W < j): none when some layer attends to everything (windows empty or a 0
    among them), else those before first_query - max(windows) + 1. A decode cache drops these blocks."""
    if not windows or not all(windows):
        return 0
    return max(0, first_query - max(windows) + 1) // block_size


def check_handshake(
    ours: KvLayout, our_fingerprint: str, theirs: KvLayout, their_fingerprint: str, *, peer: str = "sender"
) -> None:
    """Raises HandshakeError naming both sides when the model or the layout differ."""
    if our_fingerprint != their_fingerprint:
        raise HandshakeError(
            f"model fingerprint mismatch: {peer} serves {their_fingerprint[:16]}…, this worker "
            f"{our_fingerprint[:16]}…; both tiers must load the same checkpoint"
        )
    if ours != theirs:
        raise HandshakeError(f"KV layout mismatch: {peer} sends [{theirs.describe()}], this worker holds [{ours.describe()}]")
