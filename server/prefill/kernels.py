"""The compute paths a prefill model's layers run with, chosen at load and handed to the model at the edge
(model.py stays pure math): its dense matmuls, and optionally a fused MLP and an attention of another kind.

The defaults are XLA's (`xla_matmul`, attention.py's `attention`): what every backend runs. The CPU backend's
onednn-bf16 path (matmul.py's `OnednnWeights.kernels`, host_attention.py) replaces them where measured faster.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax

from pdserve.server.prefill.attention import attention
from pdserve.server.prefill.matmul import Matmul, xla_matmul

FusedMlp = Callable[..., jax.Array | None]
"""mlp(h [B, S, H], w_gate, w_up, w_down, act) -> [B, S, H], or None where it cannot (the matmuls then do)."""
Attention = Callable[..., jax.Array]
"""attention.py's `attention` signature: (q, k, v, q_pos, q_seg, k_pos, k_seg, window, *, own_keys_from, scale,
softcap) -> [B, S, Hq, D], the same rule."""


class Kernels(NamedTuple):
    matmul: Matmul = xla_matmul
    mlp: FusedMlp | None = None
    """None: gate, up and down are three `matmul`s."""
    attention: Attention = attention


def as_kernels(kernels: Matmul | Kernels) -> Kernels:
    """A model entry point's `matmul` argument (a `Matmul`, or `Kernels`) as `Kernels`."""
    return kernels if isinstance(kernels, Kernels) else Kernels(matmul=kernels)
