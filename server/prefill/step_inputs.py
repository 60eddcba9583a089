"""One prefill step's device work as host arrays: what `ModelRunner.dispatch` runs.

The engine packs a step (step_packing.py `step_inputs`) into this value, then dispatches its programs
(model_runner.py). On a
slice of several processes, process 0 sends the same value to every other process first (replay.py),
and each runs `dispatch` on it too: the same programs, with the same global shapes, in the same order.
It holds everything a step's programs read, so the other processes keep no state of their own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pdserve.server.prefill.model import Packing


@dataclass(frozen=True)
class StepInputs:
    tokens: np.ndarray
    """int32 [1, T]: the packed prompts' tokens (padding 0)."""
    packing: Packing
    """Host arrays: positions, segments [1, T]; context positions, segments [1, C]."""
    context: np.ndarray
    """[2, L, 1, C, Hkv, D] in the compute dtype: k and v of the segments' earlier tokens."""
    formats: tuple[tuple[str, int], ...]
    """(wire dtype, block size) the step's KV is converted to, one conversion each."""
    head_rows: np.ndarray | None = None
    """int32 [R]: the buffer index of each finishing prompt's last token (R a power of two); None:
    no prompt finishes, so no head and no sampling."""
    penalties: tuple[np.ndarray, ...] | None = None
    """`sampler.penalize`'s arguments after the logits; None: no prompt asks for penalties."""
    sampling: tuple[np.ndarray, ...] | None = None
    """`sampler.sample`'s columns after the logits (with head_rows)."""
    next_tokens: np.ndarray | None = None
    """int32 [1, T]: the token each position predicts, when a prompt asks for prompt logprobs."""
    lora_slots: np.ndarray | None = None
    """int32 [1, T]: each token's LoRA device slot (0: the base model, and padding), under --enable-lora (every
    step then has it, base-only ones all zeros: one program either way); None without it."""

    def arrays(self) -> dict[str, np.ndarray]:
        """Every array by a flat name (`packing.segments`, `sampling.3`): what the replay sends."""
        out = {"tokens": self.tokens, "context": self.context,
               **{f"packing.{name}": a for name, a in self.packing._asdict().items()}}
        for name in ("head_rows", "next_tokens", "lora_slots"):
            if (a := getattr(self, name)) is not None:
                out[name] = a
        for name in ("penalties", "sampling"):
            for i, a in enumerate(getattr(self, name) or ()):
                out[f"{name}.{i}"] = a
        return out

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray], formats: tuple[tuple[str, int], ...]) -> StepInputs:
        """The inverse of `arrays`."""
        def tuple_of(name: str) -> tuple[np.ndarray, ...] | None:
            items = sorted((int(k.split(".")[1]), a) for k, a in arrays.items() if k.startswith(name + "."))
            return tuple(a for _, a in items) or None

        packing = Packing(*(arrays[f"packing.{name}"] for name in Packing._fields))
        return cls(arrays["tokens"], packing, arrays["context"], tuple(formats), arrays.get("head_rows"),
                   tuple_of("penalties"), tuple_of("sampling"), arrays.get("next_tokens"), arrays.get("lora_slots"))
