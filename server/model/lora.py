"""PEFT LoRA adapters: a checkpoint (`adapter_config.json` + `adapter_model.safetensors`) read and checked against
the base model, in numpy (the coordinator checks adapters with it; the decode tier packs them for torch).

An adapter may target any subset of a layer's projections (q/k/v/o_proj of attention, gate/up/down_proj of a
dense MLP), in any layers, at one rank r up to `--max-lora-rank` (vLLM's allowed values). Each projection W [out,
in] gains `scaling * B @ A` with A [r, in] (`lora_A.weight`), B [out, r] (`lora_B.weight`) and `scaling` =
lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora (peft's rule). What pdserve cannot serve is refused at
load with the reason: a shape that does not fit the base model (another base), a rank over the maximum, a missing
file, DoRA, biases, per-module rank or alpha patterns, embeddings or an LM head among the targets.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from pdserve.server.model.config import ModelConfig, ModelLoadError
from pdserve.server.model.weights import read_safetensors

MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""vLLM 0.32's `--max-lora-rank` choices (`MaxLoRARanks`)."""
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_FLOATS = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.float64), np.dtype(ml_dtypes.bfloat16))
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class LoraLoadError(ModelLoadError):
    """An adapter pdserve cannot serve (the message says why and what to change)."""


class LoraNotFound(LoraLoadError):
    """No adapter at the path: vLLM's LoRAAdapterNotFoundError (404)."""

    def __init__(self, name: str, path: str):
        super().__init__(f"Loading lora {name} failed: No adapter found for {path}")


@dataclass(frozen=True)
class LoraCheckpoint:
    name: str
    path: str
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]
    """(layer, projection) -> (A [r, in], B [out, r]) float32, for each projection the adapter targets."""

    @property
    def targets(self) -> tuple[str, ...]:
        """The projections it changes in some layer, in PROJECTIONS' order."""
        present = {proj for _, proj in self.weights}
        return tuple(p for p in PROJECTIONS if p in present)


def projection_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each projection's (in, out) features in one layer of the base model (no MLP ones for a mixture of experts)."""
    d, H, Hkv, D, inter = (config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim,
                           config.intermediate_size)
    shapes = {"q_proj": (d, H * D), "k_proj": (d, Hkv * D), "v_proj": (d, Hkv * D), "o_proj": (H * D, d)}
    if config.moe is None:
        shapes.update(gate_proj=(d, inter), up_proj=(d, inter), down_proj=(inter, d))
    return shapes


def load_lora(name: str, path: str | Path, config: ModelConfig, max_rank: int) -> LoraCheckpoint:
    """The adapter at `path` checked against the base model's config; LoraNotFound or LoraLoadError if not."""
    folder = Path(path)
    if not (folder / CONFIG_FILE).is_file() or not (folder / WEIGHTS_FILE).is_file():
        raise LoraNotFound(name, str(path))
    where = f"LoRA adapter {name!r} ({path})"
    try:
        raw = json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoraLoadError(f"{where}: {CONFIG_FILE} is not JSON ({e})") from e
    rank, scaling = _rank_and_scaling(raw, where, max_rank)
    try:
        tensors = read_safetensors(folder / WEIGHTS_FILE)
    except (OSError, ModelLoadError) as e:
        raise LoraLoadError(f"{where}: {WEIGHTS_FILE} cannot be read ({e})") from e
    return LoraCheckpoint(name, str(path), rank, scaling, _weights(tensors, config, rank, where))


def _rank_and_scaling(raw: dict, where: str, max_rank: int) -> tuple[int, float]:
    if not isinstance(raw, dict) or raw.get("peft_type", "LORA") != "LORA":
        raise LoraLoadError(f"{where}: not a LoRA adapter (peft_type {raw.get('peft_type')!r}; pdserve serves LORA)")
    for setting, off in (("use_dora", False), ("bias", "none"), ("lora_bias", False), ("modules_to_save", None),
                         ("fan_in_fan_out", False), ("rank_pattern", {}), ("alpha_pattern", {}),
                         ("layer_replication", None), ("trainable_token_indices", None)):
        if raw.get(setting, off) not in (off, None, {}, False):
            raise LoraLoadError(f"{where}: {setting}={raw[setting]!r} is not served (train the adapter with "
                                f"{setting}={off!r})")
    rank, alpha = raw.get("r"), raw.get("lora_alpha", raw.get("r"))
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise LoraLoadError(f"{where}: {CONFIG_FILE} needs an integer r >= 1 and a number lora_alpha")
    if rank > max_rank:
        raise LoraLoadError(f"{where}: its rank {rank} exceeds --max-lora-rank {max_rank}; start the server with "
                            f"--max-lora-rank {min(r for r in MAX_LORA_RANKS if r >= rank)} or more")
    scaling = alpha / math.sqrt(rank) if raw.get("use_rslora") else alpha / rank
    return rank, float(scaling)


def _weights(tensors: dict[str, np.ndarray], config: ModelConfig, rank: int,
             where: str) -> dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]:
    shapes = projection_shapes(config)
    halves: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise LoraLoadError(f"{where}: tensor {key} is not a LoRA weight of a layer's projection; pdserve serves "
                                f"adapters of {', '.join(PROJECTIONS)} only")
        layer, proj, half = int(match[1]), match[2], match[3]
        if proj not in shapes:
            raise LoraLoadError(f"{where}: tensor {key} targets {proj}, which this base model has no dense weight for "
                                f"(targets served: {', '.join(shapes)})")
        if layer >= config.num_layers:
            raise LoraLoadError(f"{where}: tensor {key} is for layer {layer}; the base model has {config.num_layers} "
                                f"layers: the adapter was trained on another base model")
        if tensor.dtype not in _FLOATS:
            raise LoraLoadError(f"{where}: tensor {key} has dtype {tensor.dtype}; LoRA weights are floats")
        halves.setdefault((layer, proj), {})[half] = tensor
    if not halves:
        raise LoraLoadError(f"{where}: {WEIGHTS_FILE} holds no LoRA weights")
    weights = {}
    for (layer, proj), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise LoraLoadError(f"{where}: layer {layer} {proj} has lora_{''.join(pair)} without its other half")
        fan_in, fan_out = shapes[proj]
        a, b = pair["A"], pair["B"]
        if a.shape != (rank, fan_in) or b.shape != (fan_out, rank):
            raise LoraLoadError(f"{where}: layer {layer} {proj} has lora_A {tuple(a.shape)} and lora_B "
                                f"{tuple(b.shape)}; this base model (and r={rank}) needs {(rank, fan_in)} and "
                                f"{(fan_out, rank)}: the adapter was trained on another base model")
        weights[layer, proj] = (a.astype(np.float32), b.astype(np.float32))
    return weights
