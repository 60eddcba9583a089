"""Shared fixtures: tiny checkpoints of every family, built once per session through transformers."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

pytest_plugins = ["tests.loop_watch"]  # autouse: reports a held event loop

FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]


@pytest.fixture(scope="session")
def tiny_models_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny-models")


def _tiny(tiny_models_dir: Path, family: str, dtype: str = "float32") -> Path:
    from pdserve.server.model.tiny import make_tiny_model

    out = tiny_models_dir / f"{family}-{dtype}"
    if not (out / "config.json").exists():
        make_tiny_model(out, family, dtype=dtype)  # type: ignore[arg-type]
    return out


@pytest.fixture(scope="session")
def tiny_model(tiny_models_dir):
    """tiny_model(family, dtype="float32") -> the checkpoint's directory (built once)."""
    return lambda family, dtype="float32": _tiny(tiny_models_dir, family, dtype)


@pytest.fixture(scope="session")
def tiny_fp8_pair(tiny_models_dir, tiny_model):
    """tiny_fp8_pair(family) -> (fp8 checkpoint, its float32 twin): the tiny checkpoint's `*_proj` weights in fp8
    e4m3 with 128x128 block scales as DeepSeek-V3 ships them, layer 0's o_proj left float32 through
    modules_to_not_convert; the twin holds fp8 x scale (server/model/tiny_fp8.py; built once)."""
    from pdserve.server.model.tiny_fp8 import make_fp8_pair

    def build(family: str) -> tuple[Path, Path]:
        fp8, twin = tiny_models_dir / f"{family}-fp8", tiny_models_dir / f"{family}-fp8-twin"
        if not (twin / "config.json").exists():
            make_fp8_pair(tiny_model(family), fp8, twin, not_converted=["model.layers.0.self_attn.o_proj"])
        return fp8, twin

    return build


@pytest.fixture(scope="session")
def tiny_draft(tiny_models_dir):
    """tiny_draft(family) -> a smaller checkpoint (server/model/tiny.py DRAFT_SHAPE, its own random weights) with
    the tiny models' tokenizer: a draft model for draft_model speculation (built once)."""
    from pdserve.server.model.tiny import DRAFT_SHAPE, make_tiny_model

    def build(family: str) -> Path:
        out = tiny_models_dir / f"{family}-draft"
        if not (out / "config.json").exists():
            make_tiny_model(out, family, seed=1, shape=DRAFT_SHAPE)  # type: ignore[arg-type]
        return out

    return build


@pytest.fixture(scope="session")
def tiny_byte_fallback_model(tiny_models_dir) -> Path:
    """A tiny llama whose tokenizer is SentencePiece-style BPE with byte fallback (Llama 2's layout: `<0xXX>`
    pieces, "▁" for spaces, BOS added; server/model/tiny.py `train_byte_fallback_tokenizer`), built once."""
    from pdserve.server.model.tiny import make_tiny_model

    out = tiny_models_dir / "llama-byte-fallback"
    if not (out / "config.json").exists():
        make_tiny_model(out, "llama", tokenizer="byte-fallback")
    return out


@pytest.fixture(scope="session", params=FAMILIES)
def family_model(request, tiny_models_dir) -> tuple[str, Path]:
    return request.param, _tiny(tiny_models_dir, request.param)


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Every prefill worker compiles all its batch shapes at start (server/prefill/engine.py `warmup`); the
# workers the tests start (and their subprocesses) share JAX's persistent compilation cache, so each
# program compiles once per machine rather than once per worker.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"pdserve-tests-jax-cache-{os.getuid()}"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


def pytest_configure(config):
    """The suite's own torch work (transformers' oracles, the engines tests run in-process) on one thread. On
    2 cores a second OpenMP thread spins beside the servers the tests start: 8 greedy generates of a tiny model
    took 6.0 CPU seconds on torch's default 2 threads and 0.16 on one (2026-12-07), and 3 parity tests' CPU,
    their servers' included, fell from 89 to 69 s. Servers set their own threads (`--threads`)."""
    import torch

    torch.set_num_threads(1)


LORA_SPECS = {
    "ada": dict(rank=8, targets=("q_proj", "v_proj", "down_proj"), seed=1),
    "bob": dict(rank=16, targets=("k_proj", "o_proj", "gate_proj", "up_proj"), seed=2, use_rslora=True),
    "cy": dict(rank=4, targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), seed=3),
}
"""The tiny llama's PEFT adapters: different ranks (8, 16 with rsLoRA, 4) and target modules."""


@pytest.fixture(scope="session")
def tiny_loras(tiny_model) -> tuple[Path, dict[str, Path]]:
    """(the tiny llama's directory, {adapter name: its PEFT folder}) for LORA_SPECS, built once with peft."""
    from pdserve.server.model.tiny_lora import make_tiny_lora

    base = tiny_model("llama")
    out = {}
    for name, spec in LORA_SPECS.items():
        folder = base.parent / f"llama-lora-{name}"
        if not (folder / "adapter_model.safetensors").exists():
            make_tiny_lora(base, folder, **spec)
        out[name] = folder
    return base, out
