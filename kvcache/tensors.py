"""KvTensors: one stretch of a prompt's KV, the value that travels from the prefill tier to the cache."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class KvTensors:
    """The KV of layers [layer_start, +num_layers) for tokens [token_start, +num_tokens).

    On the prefill side a whole layer group of a prompt (possibly a strided view into the batch's host
    copy); on the decode side a received piece (read-only views on the message's bytes).
    """

    layer_start: int
    token_start: int
    k: np.ndarray  # [l, n, Hkv, D] in the wire dtype
    v: np.ndarray  # [l, n, Hkv, D]
    k_scales: np.ndarray | None = None  # [l, blocks covered, Hkv] float32, for quantized dtypes only
    v_scales: np.ndarray | None = None

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.k.shape[1]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.k, self.v, self.k_scales, self.v_scales) if a is not None)
