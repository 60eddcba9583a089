"""A tier profile: what one worker's steps cost on one machine, for one model, as the simulator reads it.

Prefill step (one packed token buffer, server/prefill/scheduler.py):
    fixed_s + per_token_s * padded_tokens + per_pair_s * attention pairs
where padded_tokens is the engine's power-of-two bucket of the packed buffer and the attention pairs are
sum over segments of length * (start + length) (each query token reads its context and its own segment).
Decode step (one token for every running sequence, server/decode/scheduler.py):
    fixed_s + per_seq_s * batch + per_context_token_s * sum of contexts + per_resumed_token_s * tokens
    prefilled again for preempted sequences.
A cold prefill step (after the worker was idle `cold_after_s`) lasts `cold_factors`' factor times as long on
cores of its own, keeping as many fewer busy: its CPU is the same, so a step that shares the cores anyway
is as long cold as warm.
Per request, beside the steps (the KV sent or received, the RPCs, admission: CPU the worker's process spends
between steps, which delays its next one):
    per_request_s + per_request_token_s * prompt_tokens     (prefill and decode alike)
KV handoff (prefill's last layer group to the decode worker's cache, after the first token):
    fixed_s + prompt_tokens * kv_bytes_per_token / bytes_per_s.
`ttft_overhead_s` is client-visible latency that occupies no worker (the coordinator, the RPCs).
Each is a worker's CPU work on cores of its own: a profile measured on a shared host has the share each
worker got divided out (`measure.py`). `host_cpu` holds what the simulator needs to put the workers on a
shared host again (contention.py): the coordinator's and the load client's CPU seconds per request and per
token, the cores the prefill worker's steps keep busy.

Decode steps depend on the decode worker's weight and KV dtypes (its --weight-dtype and --kv-dtype):
`dtypes` names the pair `decode` was measured at ("WEIGHT/KV", e.g. "auto/auto"), and `decode_dtypes`
holds the other pairs measured, each with its decode cost, KV bytes per token and cache size;
`with_dtypes` gives the profile of one pair, and refuses a pair the file did not measure.

A profile file is JSON: {"hardware", "model", "source", "prefill", "decode", "handoff", ...}; `measure.py`
writes one from this machine, `roofline.py` projects one onto catalog hardware.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Literal

from pdserve.server.plan.contention import HostCpu

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
    per_request_s: float = 0.0
    per_request_token_s: float = 0.0
    cold_after_s: float = 0.0
    """A step that starts after the worker was idle this long is cold (0: no step is)."""
    cold_factors: tuple[tuple[int, float], ...] = ()
    """(padded tokens, factor) by padded length: a cold step of at least that length lasts `factor` times as
    long on cores of its own and keeps 1/factor as many busy (the same CPU, less of it in parallel: measured
    on 2 cores, XLA's second thread is slow to join a step that follows an idle gap). The factor of the
    longest entry at most the step's length applies; none below the first."""

    def __post_init__(self) -> None:
        _check("prefill", fixed_s=self.fixed_s, per_token_s=self.per_token_s, per_pair_s=self.per_pair_s,
               per_request_s=self.per_request_s, per_request_token_s=self.per_request_token_s,
               cold_after_s=self.cold_after_s)
        try:
            factors = tuple((int(n), float(f)) for n, f in self.cold_factors)
        except (TypeError, ValueError):
            raise ProfileError(f"prefill.cold_factors must be [padded tokens, factor] pairs, got "
                               f"{self.cold_factors!r}") from None
        for n, f in factors:
            if n < 1 or not (math.isfinite(f) and f >= 1):
                raise ProfileError(f"prefill.cold_factors: each padded length >= 1 and factor >= 1, got [{n}, {f}]")
        object.__setattr__(self, "cold_factors", tuple(sorted(factors)))

    def step_seconds(self, padded_tokens: int, pairs: int) -> float:
        return self.fixed_s + self.per_token_s * padded_tokens + self.per_pair_s * pairs

    def cold_factor(self, padded_tokens: int, idle_s: float) -> float:
        """How much longer a step of `padded_tokens` lasts after the worker was idle `idle_s` seconds."""
        if not self.cold_after_s or idle_s < self.cold_after_s:
            return 1.0
        return next((f for n, f in reversed(self.cold_factors) if n <= padded_tokens), 1.0)

    def request_seconds(self, prompt_tokens: int) -> float:
        """The worker's CPU for one request beside its steps (its KV sent, its RPCs)."""
        return self.per_request_s + self.per_request_token_s * prompt_tokens


@dataclass(frozen=True)
class DecodeCost:
    fixed_s: float
    per_seq_s: float
    per_context_token_s: float = 0.0
    per_resumed_token_s: float = 0.0
    per_request_s: float = 0.0
    per_request_token_s: float = 0.0

    def __post_init__(self) -> None:
        _check("decode", fixed_s=self.fixed_s, per_seq_s=self.per_seq_s,
               per_context_token_s=self.per_context_token_s, per_resumed_token_s=self.per_resumed_token_s,
               per_request_s=self.per_request_s, per_request_token_s=self.per_request_token_s)

    def request_seconds(self, prompt_tokens: int) -> float:
        """The worker's CPU for one request beside its steps (its KV received, its Decode call, admission)."""
        return self.per_request_s + self.per_request_token_s * prompt_tokens

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
class DtypeRow:
    """The decode tier at one (weight, KV) dtype pair."""

    decode: DecodeCost
    kv_bytes_per_token: int
    kv_cache_tokens: int

    def __post_init__(self) -> None:
        if self.kv_bytes_per_token < 1 or self.kv_cache_tokens < 1:
            raise ProfileError(f"decode_dtypes: kv_bytes_per_token and kv_cache_tokens must be >= 1, got "
                               f"{self.kv_bytes_per_token} and {self.kv_cache_tokens}")


def dtype_pair(weight: str, kv: str) -> str:
    return f"{weight}/{kv}"


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
    host_cpu: HostCpu = field(default_factory=HostCpu)
    """The front's CPU per request and token and the workers' threads, as measured (its `cores`: None)."""
    dtypes: str = "auto/auto"
    """The decode worker's "WEIGHT/KV" dtypes (--weight-dtype/--kv-dtype) `decode` was measured at."""
    decode_dtypes: dict[str, DtypeRow] = field(default_factory=dict)
    """The other pairs measured."""

    @property
    def measured_dtypes(self) -> list[str]:
        return [self.dtypes, *self.decode_dtypes]

    def with_dtypes(self, weight: str | None, kv: str | None) -> Profile:
        """This profile with the decode row of --weight-dtype `weight` and --kv-dtype `kv` (None: the
        measured default's)."""
        main_w, main_kv = self.dtypes.split("/")
        pair = dtype_pair(weight or main_w, kv or main_kv)
        if pair == self.dtypes:
            return self
        row = self.decode_dtypes.get(pair)
        if row is None:
            raise ProfileError(f"the profile of {self.hardware} measured decode at weight/KV dtypes "
                               f"{', '.join(self.measured_dtypes)}, not {pair}: measure it with "
                               f"`pdserve plan profile --decode-dtypes {','.join([*self.measured_dtypes, pair])}`")
        return replace(self, decode=row.decode, kv_cache_tokens=row.kv_cache_tokens, dtypes=pair, decode_dtypes={},
                       handoff=replace(self.handoff, kv_bytes_per_token=row.kv_bytes_per_token))

    def __post_init__(self) -> None:
        if not self.hardware:
            raise ProfileError("hardware must name the machine or a catalog entry")
        if self.kv_cache_tokens < 1:
            raise ProfileError(f"kv_cache_tokens must be >= 1, got {self.kv_cache_tokens}")
        if self.chips < 1:
            raise ProfileError(f"chips must be >= 1, got {self.chips}")
        _check("profile", ttft_overhead_s=self.ttft_overhead_s)
        if not isinstance(self.dtypes, str) or self.dtypes.count("/") != 1:
            raise ProfileError(f"dtypes must be \"WEIGHT/KV\" (e.g. \"auto/auto\"), got {self.dtypes!r}")

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
                       chips=doc.get("chips", 1), notes=doc.get("notes", {}),
                       host_cpu=HostCpu.from_json(doc.get("host_cpu", {})), dtypes=doc.get("dtypes", "auto/auto"),
                       decode_dtypes=_dtype_rows(doc.get("decode_dtypes", {})))
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


def _dtype_rows(doc: dict) -> dict[str, DtypeRow]:
    if not isinstance(doc, dict):
        raise ProfileError("decode_dtypes must be an object {\"WEIGHT/KV\": {decode, kv_bytes_per_token, kv_cache_tokens}}")
    rows = {}
    for pair, row in doc.items():
        if not isinstance(row, dict) or pair.count("/") != 1:
            raise ProfileError(f"decode_dtypes.{pair}: a \"WEIGHT/KV\" key with {{decode, kv_bytes_per_token, "
                               f"kv_cache_tokens}}")
        try:
            rows[pair] = DtypeRow(DecodeCost(**row["decode"]), row["kv_bytes_per_token"], row["kv_cache_tokens"])
        except KeyError as e:
            raise ProfileError(f"decode_dtypes.{pair}: field {e.args[0]!r} is missing") from None
    return rows
