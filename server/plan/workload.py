"""The simulated requests: a trace file, or the distributions and arrivals `pdserve bench` sends.

From `pdserve bench`'s flags (`--input-len`, `--output-len`, `--length-dist`, `--range-ratio`, `--sigma`,
`--request-rate`, `--arrival`, `--duration`, `--num-prompts`, `--seed`, `--dataset`) the requests are the
very ones bench sends with the same flags: the same `datasets.synthetic` (or `datasets.sharegpt`) list,
cycled, at the same `load.arrival_offsets`.

A trace is JSON Lines or CSV, one request a line, with the fields
`arrival_s` (seconds from the start, non-decreasing), `prompt_len` (>= 1), `output_len` (>= 1) and, optional,
`prefix_group` (requests of one group share their first `prefix_len` prompt tokens: a system prompt).
Every field is checked; a bad one is refused naming the line and the field.
"""

from __future__ import annotations

import csv
import io
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from pdserve.server.plan import datasets
from pdserve.server.plan.arrivals import LoadSpec, arrival_offsets
from pdserve.server.plan.bench_flags import make_requests, prompt_count

DEFAULT_VOCAB = 500
"""Token ids are drawn below this, as `pdserve bench` does without --tokenizer."""
FIRST_TOKEN_ID = 10


class WorkloadError(ValueError):
    """A trace or workload flag is wrong; the message names the line and the field."""


@dataclass(frozen=True)
class SimRequest:
    arrival: float
    """Seconds from the run's start."""
    prompt_ids: tuple[int, ...]
    output_len: int
    """Tokens generated (bench sends max_tokens with ignore_eos: exactly this many)."""

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise WorkloadError("prompt_len must be >= 1, got 0")
        if self.output_len < 1:
            raise WorkloadError(f"output_len must be >= 1, got {self.output_len}")
        if not (self.arrival >= 0 and math.isfinite(self.arrival)):
            raise WorkloadError(f"arrival_s must be a finite number >= 0, got {self.arrival}")

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


def from_bench_requests(requests: list[datasets.BenchRequest], load: LoadSpec, *, max_requests: int | None,
                        duration: float | None, vocab_size: int = DEFAULT_VOCAB) -> list[SimRequest]:
    """What `pdserve bench` sends (benchmarks/bench.py `_send_group`): requests[i % len] at the i-th arrival offset, until
    max_requests or the duration."""
    if max_requests is None and duration is None:
        raise WorkloadError("give --num-prompts or --duration")
    if math.isinf(load.rate):
        raise WorkloadError("--request-rate must be finite for a simulation (a closed loop has no arrivals "
                            "to replay); give the rate bench would send at")
    out: list[SimRequest] = []
    for i, offset in enumerate(arrival_offsets(load)):
        if (max_requests is not None and i >= max_requests) or (duration is not None and offset >= duration):
            break
        req = requests[i % len(requests)]
        ids = req.prompt_ids if req.prompt_ids is not None else _ids(random.Random(i), req.prompt_len, vocab_size)
        out.append(SimRequest(offset, tuple(ids), req.output_len))
    return out


def from_args(args) -> list[SimRequest]:
    """The requests `pdserve bench` would send with these flags (its parser's names)."""
    for name in ("input_len", "output_len"):
        if getattr(args, name) < 1:
            raise WorkloadError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not args.request_rate > 0:
        raise WorkloadError(f"--request-rate must be > 0, got {args.request_rate}")
    n = args.num_prompts or (None if args.duration else 100)
    requests = make_requests(args, n or prompt_count(args))
    load = LoadSpec(rate=args.request_rate, arrival=args.arrival, seed=args.seed)
    return from_bench_requests(requests, load, max_requests=n, duration=args.duration,
                               vocab_size=args.vocab_size or DEFAULT_VOCAB)


def _ids(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(n)]


def _field(row: dict, name: str, where: str, kind: type, required: bool = True):
    value = row.get(name)
    if value in (None, ""):
        if required:
            raise WorkloadError(f"{where}: field {name!r} is missing")
        return None
    try:
        number = kind(value) if not isinstance(value, bool) else None
    except (TypeError, ValueError):
        number = None
    if number is None or (kind is int and isinstance(value, float) and not value.is_integer()):
        raise WorkloadError(f"{where}: field {name!r} must be {'an integer' if kind is int else 'a number'}, "
                            f"got {value!r}")
    return number


def parse_trace(text: str, name: str = "trace", vocab_size: int = DEFAULT_VOCAB, seed: int = 0) -> list[SimRequest]:
    """A trace's requests (JSON Lines when the first non-blank character is '{', else CSV with a header)."""
    stripped = text.lstrip()
    if not stripped:
        raise WorkloadError(f"{name}: the trace holds no requests")
    if stripped.startswith("{"):
        rows = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise WorkloadError(f"{name} line {n}: not JSON ({e.msg})") from None
                if not isinstance(row, dict):
                    raise WorkloadError(f"{name} line {n}: a request must be a JSON object")
                rows.append((n, row))
    else:
        rows = [(n, row) for n, row in enumerate(csv.DictReader(io.StringIO(text)), 2)]
    rng = random.Random(seed)
    prefixes: dict[str, list[int]] = {}
    out: list[SimRequest] = []
    last = 0.0
    for n, row in rows:
        where = f"{name} line {n}"
        arrival = _field(row, "arrival_s", where, float)
        prompt_len = _field(row, "prompt_len", where, int)
        output_len = _field(row, "output_len", where, int)
        group = row.get("prefix_group")
        prefix_len = _field(row, "prefix_len", where, int, required=False) or 0
        if not (math.isfinite(arrival) and arrival >= 0):
            raise WorkloadError(f"{where}: field 'arrival_s' must be a finite number >= 0, got {arrival}")
        if arrival < last:
            raise WorkloadError(f"{where}: field 'arrival_s' ({arrival}) is before the line above's ({last}): "
                                f"sort the trace by arrival")
        if prompt_len < 1:
            raise WorkloadError(f"{where}: field 'prompt_len' must be >= 1, got {prompt_len}")
        if output_len < 1:
            raise WorkloadError(f"{where}: field 'output_len' must be >= 1, got {output_len}")
        if not 0 <= prefix_len <= prompt_len:
            raise WorkloadError(f"{where}: field 'prefix_len' must be in [0, prompt_len={prompt_len}], got {prefix_len}")
        if prefix_len and group in (None, ""):
            raise WorkloadError(f"{where}: field 'prefix_len' needs a 'prefix_group'")
        shared: list[int] = []
        if prefix_len:
            key = str(group)
            known = prefixes.setdefault(key, _ids(random.Random(f"prefix:{key}"), prefix_len, vocab_size))
            if len(known) < prefix_len:
                known.extend(_ids(random.Random(f"prefix:{key}:{len(known)}"), prefix_len - len(known), vocab_size))
            shared = known[:prefix_len]
        ids = shared + _ids(rng, prompt_len - len(shared), vocab_size)
        out.append(SimRequest(arrival, tuple(ids), output_len))
        last = arrival
    if not out:
        raise WorkloadError(f"{name}: the trace holds no requests")
    return out


def read_trace(path: Path, vocab_size: int = DEFAULT_VOCAB, seed: int = 0) -> list[SimRequest]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise WorkloadError(f"cannot read the trace {path}: {e.strerror}; give --trace an existing file") from None
    return parse_trace(text, str(path), vocab_size, seed)
