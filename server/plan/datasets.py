"""Benchmark requests: synthetic (seeded fixed/uniform/log-normal lengths) or ShareGPT conversations.

A `BenchRequest` carries either prompt token ids (synthetic: every target gets exactly the same
tokens, no tokenizer involved) or prompt text (ShareGPT; its length is counted with the model's
`tokenizer.json` when one is given).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

LengthDist = Literal["fixed", "uniform", "lognormal"]


@dataclass(frozen=True)
class BenchRequest:
    prompt_len: int
    output_len: int  # sent as max_tokens, with ignore_eos
    prompt_ids: tuple[int, ...] | None = None
    prompt_text: str | None = None
    group: str = "default"


def sample_lengths(
    n: int,
    mean: int,
    dist: LengthDist,
    rng: np.random.Generator,
    *,
    range_ratio: float = 0.0,
    sigma: float = 0.5,
    minimum: int = 1,
) -> list[int]:
    """n lengths around `mean`: fixed; uniform in mean*(1 +- range_ratio); log-normal with median mean."""
    if dist == "fixed":
        values = np.full(n, mean)
    elif dist == "uniform":
        lo, hi = int(np.floor(mean * (1 - range_ratio))), int(np.ceil(mean * (1 + range_ratio)))
        values = rng.integers(lo, hi + 1, size=n)
    elif dist == "lognormal":
        values = np.rint(rng.lognormal(mean=np.log(mean), sigma=sigma, size=n))
    else:
        raise ValueError(f"unknown length distribution {dist!r}; choose fixed, uniform or lognormal")
    return [max(minimum, int(v)) for v in values]


def synthetic(
    n: int,
    *,
    input_len: int,
    output_len: int,
    vocab_size: int,
    dist: LengthDist = "fixed",
    range_ratio: float = 0.0,
    sigma: float = 0.5,
    seed: int = 0,
    max_input_len: int | None = None,
    first_token_id: int = 10,
    group: str = "default",
) -> list[BenchRequest]:
    """Prompts of random token ids in [first_token_id, vocab_size), seeded: same seed, same requests."""
    rng = np.random.default_rng(seed)
    ins = sample_lengths(n, input_len, dist, rng, range_ratio=range_ratio, sigma=sigma)
    outs = sample_lengths(n, output_len, dist, rng, range_ratio=range_ratio, sigma=sigma)
    if max_input_len is not None:
        ins = [min(i, max_input_len) for i in ins]
    return [
        BenchRequest(
            prompt_len=i,
            output_len=o,
            group=group,
            prompt_ids=tuple(int(t) for t in rng.integers(first_token_id, vocab_size, size=i)),
        )
        for i, o in zip(ins, outs)
    ]


def _conversations(path: Path) -> list[dict]:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    data = json.loads(text)
    return data if isinstance(data, list) else [data]


def sharegpt(
    path: str | Path,
    n: int,
    *,
    tokenizer_path: str | Path | None = None,
    seed: int = 0,
    output_len: int | None = None,
    max_prompt_len: int = 1024,
    max_total_len: int = 2048,
    group: str = "default",
) -> list[BenchRequest]:
    """The first human turn of each conversation as the prompt; the first reply's length as output length
    (vLLM's sampling). Conversations shorter than 4 tokens or longer than the limits are skipped."""
    count = _counter(tokenizer_path)
    convs = _conversations(Path(path))
    random.Random(seed).shuffle(convs)
    out: list[BenchRequest] = []
    for conv in convs:
        turns = conv.get("conversations") or conv.get("conversation") or []
        if len(turns) < 2:
            continue
        prompt, reply = turns[0].get("value", ""), turns[1].get("value", "")
        p_len, o_len = count(prompt), output_len or count(reply)
        if p_len < 4 or o_len < 4 or p_len > max_prompt_len or p_len + o_len > max_total_len:
            continue
        out.append(BenchRequest(prompt_len=p_len, output_len=o_len, prompt_text=prompt, group=group))
        if len(out) == n:
            break
    if not out:
        raise ValueError(f"{path}: no usable ShareGPT conversations (need 'conversations' with 2+ turns)")
    return out


def _counter(tokenizer_path: str | Path | None):
    if tokenizer_path is None:
        return lambda s: max(1, len(s) // 4)  # ~4 characters a token; the server's usage is what is reported
    from tokenizers import Tokenizer

    path = Path(tokenizer_path)
    tok = Tokenizer.from_file(str(path / "tokenizer.json" if path.is_dir() else path))
    return lambda s: len(tok.encode(s, add_special_tokens=False).ids)
