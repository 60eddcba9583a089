"""One step's segments as host arrays (`StepInputs`): the token buffer, its packing, the context beside
it, the finishing prompts' head rows and their sampling columns.

The engine (engine.py) takes a step's segments from the scheduler and its `StepShape`; `step_inputs`
packs them end to end into the shape's buffer (each segment on a block boundary, its earlier tokens'
KV in the context) and gives each segment's offset in it. What a prompt asks of its first token
(temperature, top-k/p, min-p, seed, penalties, min_tokens, its grammar's first mask) becomes columns over
the head's rows, a power of two, by the same rules the decode tier applies (sampling_rules.py, finish.py,
structured/).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.server import seeded
from pdserve.server.finish import blocked_ids
from pdserve.server.model.config import ModelConfig
from pdserve.server.prefill.model import Packing
from pdserve.server.prefill.scheduler import Segment, aligned
from pdserve.server.prefill.shapes import StepShape, pow2
from pdserve.server.prefill.step_inputs import StepInputs
from pdserve.server.sampling_rules import repetition_penalty_of, top_p_of
from pdserve.server.structured.bitmask import unconstrained
from pdserve.server.structured.constraint import Constraint


class Job(Protocol):
    """What packing reads of a prompt (the engine's PrefillJob)."""

    token_ids: list[int]
    sampling: gen_pb.SamplingParams
    sample_index: int
    kv_dtype: str
    block_size: int
    context: np.ndarray | None
    constraint: Constraint | None

    @property
    def num_tokens(self) -> int: ...


def step_inputs(step: list[Segment[Job]], shape: StepShape, model_config: ModelConfig, dtype, vocab_size: int,
                bucket: Callable[[int], int],
                penalized: Callable[[int, int], tuple[int, int]] | None = None,
                lora_slots: Sequence[int] | None = None) -> tuple[StepInputs, list[int]]:
    """The step's device work as host arrays, and each segment's offset in the token buffer. dtype: the
    compute dtype (the context's); bucket: a prompt length's bucket (the penalties' padded prompts);
    penalized(rows, length): the compiled (rows, length) penalized sampling pads those to (default: as they are);
    lora_slots: each segment's LoRA device slot under --enable-lora (None without it)."""
    tokens, packing, context, offsets = pack(step, shape, model_config, dtype)
    slots = None
    if lora_slots is not None:
        slots = np.zeros((1, shape.tokens), np.int32)  # [1, T]
        for s, off, slot in zip(step, offsets, lora_slots, strict=True):
            slots[0, off : off + s.length] = slot
    finishing = [(i, s) for i, s in enumerate(step) if s.last]
    head_rows = penalties = sampling = ahead = None
    if finishing:
        rows = pow2(len(finishing))
        jobs = [s.job for _, s in finishing]
        penalties = penalty_columns(jobs, rows, vocab_size, model_config.eos_token_ids, bucket)
        if penalties is not None and penalized is not None:
            compiled_rows, length = penalized(rows, penalties[0].shape[1])
            if (compiled_rows, length) != (rows, penalties[0].shape[1]):
                rows = compiled_rows
                penalties = penalty_columns(jobs, rows, vocab_size, model_config.eos_token_ids, lambda n: length)
        head_rows = np.zeros((rows,), np.int32)
        head_rows[: len(finishing)] = [offsets[i] + s.length - 1 for i, s in finishing]
        sampling = sampling_columns(jobs, rows, vocab_size)
    if any(s.job.sampling.HasField("prompt_logprobs") for s in step):  # this pass's hidden state
        ahead = next_tokens(step, offsets, shape)
    formats = tuple(sorted({(s.job.kv_dtype, s.job.block_size) for s in step}))
    return StepInputs(tokens, packing, context, formats, head_rows, penalties, sampling, ahead, slots), offsets


def pack(step: list[Segment[Job]], shape: StepShape, model_config: ModelConfig, dtype):
    """Host arrays of the step: tokens, Packing, context k and v [L, 1, C, Hkv, D], segment offsets."""
    c = model_config
    align = max(s.job.block_size for s in step)
    tokens = np.zeros((1, shape.tokens), np.int32)  # [1, T]
    positions = np.zeros((1, shape.tokens), np.int32)
    segments = np.full((1, shape.tokens), -1, np.int32)
    context = np.zeros((2, c.num_layers, 1, shape.context, c.num_kv_heads, c.head_dim), np.dtype(dtype))
    context_positions = np.zeros((1, shape.context), np.int32)  # [1, C]
    context_segments = np.full((1, shape.context), -2, np.int32)
    offsets: list[int] = []
    at, ctx_at = 0, 0
    for i, s in enumerate(step):
        offsets.append(at)
        tokens[0, at : at + s.length] = s.job.token_ids[s.start : s.end]
        positions[0, at : at + s.length] = np.arange(s.start, s.end)
        segments[0, at : at + s.length] = i
        at += aligned(s.length, align)
        if s.start:
            context[:, :, 0, ctx_at : ctx_at + s.start] = s.job.context[:, :, : s.start]
            context_positions[0, ctx_at : ctx_at + s.start] = np.arange(s.start)
            context_segments[0, ctx_at : ctx_at + s.start] = i
            ctx_at += s.start
    packing = Packing(positions, segments, context_positions, context_segments)
    return tokens, packing, context, offsets


def next_tokens(step: list[Segment[Job]], offsets: list[int], shape: StepShape) -> np.ndarray:
    """int32 [1, T]: the token each position of the buffer predicts (position p: token p + 1)."""
    out = np.zeros((1, shape.tokens), np.int32)
    for i, s in enumerate(step):
        ahead = s.job.token_ids[s.start + 1 : s.end + 1]
        out[0, offsets[i] : offsets[i] + len(ahead)] = ahead
    return out


def penalty_columns(jobs: Sequence[Job], rows: int, vocab_size: int, eos_ids: Sequence[int],
                    bucket: Callable[[int], int]) -> tuple[np.ndarray, ...] | None:
    """`sampler.penalize`'s arguments after the logits, for each prompt's penalties and min_tokens (None
    when none asks: the logits are sampled as they are)."""
    sp = [j.sampling for j in jobs]
    blocked = np.zeros((rows, vocab_size), dtype=bool)  # [R, V]
    for i, job in enumerate(jobs):
        banned = [t for t in blocked_ids(job.sampling, eos_ids, job.sample_index) if 0 <= t < vocab_size]
        blocked[i, banned] = True
    repetition = [repetition_penalty_of(p) for p in sp]
    if not (blocked.any() or any(p.presence_penalty or p.frequency_penalty for p in sp)
            or any(r != 1.0 for r in repetition)):
        return None
    lengths = column([j.num_tokens for j in jobs], np.int32, rows)
    tokens = np.zeros((rows, bucket(int(lengths.max()))), np.int32)  # [R, S]: the whole prompts
    for i, job in enumerate(jobs):
        tokens[i, : job.num_tokens] = job.token_ids
    lengths[len(jobs):] = 1
    return (tokens, lengths, column([j.sample_index for j in jobs], np.int32, rows),
            column([p.presence_penalty for p in sp], np.float32, rows),
            column([p.frequency_penalty for p in sp], np.float32, rows),
            np.concatenate([np.asarray(repetition, np.float32), np.ones(rows - len(jobs), np.float32)]), blocked)


def sampling_columns(jobs: Sequence[Job], rows: int, vocab_size: int) -> tuple[np.ndarray, ...]:
    """`sampler.sample`'s columns after the logits: each prompt's sampling parameters (a seed drawn here
    when it has none) and its grammar's mask of the next token (all ones without one), padded to the
    head's rows."""
    sp = [j.sampling for j in jobs]
    masks = unconstrained(rows, vocab_size)  # [R, ceil(V / 32)]
    for row, job in zip(masks, jobs):
        if job.constraint is not None:
            job.constraint.fill(row)
    return (
        column([p.temperature for p in sp], np.float32, rows),
        column([p.top_k for p in sp], np.int32, rows),
        column([top_p_of(p) for p in sp], np.float32, rows),
        column([seeded.fold(p.seed) if p.HasField("seed") else secrets.randbits(32) for p in sp], np.uint32, rows),
        column([j.sample_index for j in jobs], np.int32, rows),
        column([p.min_p for p in sp], np.float32, rows),
        masks,
    )


def column(values: list, dtype, rows: int) -> np.ndarray:
    """values padded with zeros to the batch's rows."""
    out = np.zeros((rows,), dtype=dtype)
    out[: len(values)] = values
    return out
