"""Prompts and a clock to drive the prefill scheduler by hand (no engine, no model)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(eq=False)
class Job:
    name: str
    num_tokens: int
    dropped: bool = False
    computed: int = 0
    block_size: int = 16

    def cancelled(self) -> bool:
        return self.dropped


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def bucket(n: int) -> int:
    """Power-of-two length buckets from 16, as the engine's."""
    return max(16, 1 << (n - 1).bit_length())
