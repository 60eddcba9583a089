"""Token log-probabilities as the wire carries them (`TokenLogprob`), shared by both tiers.

A logprob is of the model's own next-token distribution (log-softmax of the raw logits, before
temperature, top-k/top-p or penalties), as vLLM returns by default and `transformers` computes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pdserve.v1 import generation_pb2 as gen_pb

MAX_LOGPROBS = 20
"""The most alternatives a request may ask for per position (OpenAI's top_logprobs limit)."""


def token_logprob(token_id: int, logprob: float, top_ids: Sequence[int], top_logprobs: Sequence[float],
                  num_top: int) -> gen_pb.TokenLogprob:
    return gen_pb.TokenLogprob(token_id=int(token_id), logprob=float(logprob),
                               top_token_ids=[int(i) for i in top_ids[:num_top]],
                               top_logprobs=[float(x) for x in top_logprobs[:num_top]])


def from_logits(logits: np.ndarray, token_ids: Sequence[int], num_top: int) -> list[gen_pb.TokenLogprob]:
    """logits f32 [B, V] and the token chosen in each row -> one TokenLogprob per row."""
    logits = np.asarray(logits, dtype=np.float32)  # [B, V]
    shifted = logits - logits.max(axis=-1, keepdims=True)
    logprobs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))  # [B, V]
    top = np.argsort(-logprobs, axis=-1, kind="stable")[:, :num_top]  # [B, num_top]
    return [token_logprob(t, row[t], top_row, row[top_row], num_top)
            for t, row, top_row in zip(token_ids, logprobs, top)]
