"""A tier profile: what one worker's steps cost on one machine, for one model, as the simulator reads it.

Prefill step (one packed token buffer, server/prefill/scheduler.py):
    fixed_s + per_token_s * padded_tokens + per_pair_s * attention pairs
where padded_tokens is the engine's power-of-two bucket of the packed buffer and the attention pairs are
sum over segments of length * (start + length) (each query token reads its context and its own segment).
Decode step (one token for every running sequence, server/decode/scheduler.py):
    fixed_s + per_seq_s * batch + per_context_token_s * sum of contexts + per_resumed_token_s * tokens
    prefilled again for preempted sequences.
KV handoff (prefill's last layer group to the decode worker's cache, after the first token):
    fixed_s + prompt_tokens * kv_bytes_per_token / bytes_per_s.
`ttft_overhead_s` is client-visible latency that occupies no worker (the coordinator, the RPCs).

A profile file is JSON: {"hardware", "model", "source", "prefill", "decode", "handoff", ...}; `measure.py`
writes one from this machine, `roofline.py` projects one onto catalog hardware.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

Source = Literal["measured", "projected", "scripted"]


class ProfileError(ValueError):
    """A profile file is wrong; the message names the field."""


def _check(where: str, **values: float) -> None:
    for name, value in values.items():
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
            raise ProfileError(f"{where}.{name} must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True)
class PrefillCost:
    fixed_s: float
    per_token_s: float
    per_pair_s: float = 0.0

    def __post_init__(self) -> None:
        _check("prefill", fixed_s=self.fixed_s, per_token_s=self.per_token_s, per_pair_s=self.per_pair_s)

    def step_seconds(self, padded_tokens: int, pairs: int) -> float:
        return self.fixed_s + self.per_token_s * padded_tokens + self.per_pair_s * pairs


@dataclass(frozen=True)
class DecodeCost:
    fixed_s: float
    per_seq_s: float
    per_context_token_s: float = 0.0
    per_resumed_token_s: float = 0.0

    def __post_init__(self) -> None:
        _check("decode", fixed_s=self.fixed_s, per_seq_s=self.per_seq_s,
               per_context_token_s=self.per_context_token_s, per_resumed_token_s=self.per_resumed_token_s)

    def step_seconds(self, batch: int, context_tokens: int, resumed_tokens: int = 0) -> float:
        return (self.fixed_s + self.per_seq_s * batch + self.per_context_token_s * context_tokens
                + self.per_resumed_token_s * resumed_tokens)


@dataclass(frozen=True)
class HandoffCost:
    fixed_s: float
    bytes_per_s: float
    kv_bytes_per_token: int

    def __post_init__(self) -> None:
        _check("handoff", fixed_s=self.fixed_s, kv_bytes_per_token=self.kv_bytes_per_token)
        if not (math.isfinite(self.bytes_per_s) and self.bytes_per_s > 0):
            raise ProfileError(f"handoff.bytes_per_s must be > 0, got {self.bytes_per_s!r}")

    def seconds(self, tokens: int) -> float:
        return self.fixed_s + tokens * self.kv_bytes_per_token / self.bytes_per_s


@dataclass(frozen=True)
class Profile:
    hardware: str
    """A catalog name (catalog.json) or a description of the measured machine."""
    model: str
    prefill: PrefillCost
    decode: DecodeCost
    handoff: HandoffCost
    kv_cache_tokens: int
    """Tokens of KV the decode worker's cache holds (its block pool's blocks x block size)."""
    source: Source = "measured"
    ttft_overhead_s: float = 0.0
    chips: int = 1
    """Accelerators one worker of this profile occupies (what it costs per hour)."""
    notes: dict = field(default_factory=dict)
    """Where the numbers came from: the measured rows, the projection's factors."""

    def __post_init__(self) -> None:
        if not self.hardware:
            raise ProfileError("hardware must name the machine or a catalog entry")
        if self.kv_cache_tokens < 1:
            raise ProfileError(f"kv_cache_tokens must be >= 1, got {self.kv_cache_tokens}")
        if self.chips < 1:
            raise ProfileError(f"chips must be >= 1, got {self.chips}")
        _check("profile", ttft_overhead_s=self.ttft_overhead_s)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict, name: str = "profile") -> Profile:
        if not isinstance(doc, dict):
            raise ProfileError(f"{name}: a profile is a JSON object")
        try:
            parts = {k: doc[k] for k in ("prefill", "decode", "handoff")}
            return cls(hardware=doc["hardware"], model=doc.get("model", ""),
                       prefill=PrefillCost(**parts["prefill"]), decode=DecodeCost(**parts["decode"]),
                       handoff=HandoffCost(**parts["handoff"]), kv_cache_tokens=doc["kv_cache_tokens"],
                       source=doc.get("source", "measured"), ttft_overhead_s=doc.get("ttft_overhead_s", 0.0),
                       chips=doc.get("chips", 1), notes=doc.get("notes", {}))
        except KeyError as e:
            raise ProfileError(f"{name}: field {e.args[0]!r} is missing") from None
        except TypeError as e:
            raise ProfileError(f"{name}: {e}") from None

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> Profile:
        try:
            doc = json.loads(path.read_text())
        except OSError as e:
            raise ProfileError(f"cannot read the profile {path}: {e.strerror}; write one with "
                               f"`pdserve plan profile --out {path}`") from None
        except json.JSONDecodeError as e:
            raise ProfileError(f"{path}: not JSON ({e.msg})") from None
        return cls.from_json(doc, str(path))
