"""transformers' greedy tokens, the suite's numerical oracle, computed once per (checkpoint, prompt, length):
the parity, engine and e2e tests of every file ask for the same tiny checkpoints' answers to the same prompts.
The model is loaded once per checkpoint (float32, eval); a checkpoint is named by its path and its files'
modification times, so one rewritten in place is loaded afresh."""

from __future__ import annotations

import functools
from pathlib import Path

import torch


def _identity(model_dir: str | Path) -> tuple[str, tuple[int, ...]]:
    path = Path(model_dir).resolve()
    return str(path), tuple(f.stat().st_mtime_ns for f in sorted(path.glob("*.json")) + sorted(path.glob("*.safetensors")))


@functools.lru_cache(maxsize=8)
def _model(identity: tuple[str, tuple[int, ...]]):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(identity[0], dtype=torch.float32).eval()


@functools.lru_cache(maxsize=4096)
def _greedy(identity: tuple[str, tuple[int, ...]], ids: tuple[int, ...], n: int, stop_at_eos: bool) -> tuple[int, ...]:
    kwargs = {} if stop_at_eos else {"eos_token_id": None}
    with torch.inference_mode():
        out = _model(identity).generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, **kwargs)
    return tuple(out[0, len(ids):].tolist())


def hf_greedy_tokens(model_dir: str | Path, ids: list[int], n: int, stop_at_eos: bool = False) -> list[int]:
    """The n tokens transformers' generate picks greedily after `ids` (fewer when `stop_at_eos` and it ends)."""
    return list(_greedy(_identity(model_dir), tuple(ids), n, stop_at_eos))
