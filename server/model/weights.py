"""Reads HF safetensors checkpoints (one file or sharded with an index) into numpy arrays.

The (simple) format is read here directly: an 8-byte little-endian header length, a JSON header,
then the raw tensor bytes, viewed in place through a memory map. Not safetensors' own numpy reader
(`safe_open(framework="numpy")`, safetensors 0.8): it does read bfloat16 (through ml_dtypes), but it
fails on FP8 checkpoints (F8_E4M3: it looks for `numpy.float8_e4m3fn`, which numpy lacks), and
`get_tensor` copies every tensor into memory, where the memory map here reads lazily.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from pathlib import Path

import ml_dtypes
import numpy as np

from pdserve.server.model.config import ModelLoadError
from pdserve.server.model.fp8_checkpoint import DequantizedTensors, scheme_of

_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}


EXPERT_NAMES = {
    "mixtral": {"router": "block_sparse_moe.gate", "gate": "block_sparse_moe.experts.{e}.w1.weight",
                "up": "block_sparse_moe.experts.{e}.w3.weight", "down": "block_sparse_moe.experts.{e}.w2.weight"},
    "qwen3_moe": {"router": "mlp.gate", "gate": "mlp.experts.{e}.gate_proj.weight",
                  "up": "mlp.experts.{e}.up_proj.weight", "down": "mlp.experts.{e}.down_proj.weight"},
}
EXPERT_NAMES["deepseek_v2"] = EXPERT_NAMES["deepseek_v3"] = EXPERT_NAMES["qwen3_moe"]
"""Each MoE family's checkpoint names (per layer) of the router and of expert e's projections."""


def read_header(path: Path) -> tuple[dict, int]:
    """The JSON header of a safetensors file and the offset its data starts at."""
    with open(path, "rb") as f:
        raw_len = f.read(8)
        if len(raw_len) != 8:
            raise ModelLoadError(f"{path} is truncated: no safetensors header")
        (n,) = struct.unpack("<Q", raw_len)
        if n > 100 * 2**20:
            raise ModelLoadError(f"{path} is corrupt: header length {n} is implausible")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"{path} is corrupt: its header is not JSON ({e})") from e
    return header, 8 + n


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    header, data_start = read_header(path)
    data = np.memmap(path, dtype=np.uint8, mode="r")
    out: dict[str, np.ndarray] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(meta["dtype"])
        if dtype is None:
            raise ModelLoadError(f"{path}: tensor {name} has unsupported dtype {meta['dtype']}")
        begin, end = meta["data_offsets"]
        if data_start + end > data.size:
            raise ModelLoadError(f"{path} is truncated: tensor {name} runs past the end of the file")
        flat = np.asarray(data[data_start + begin : data_start + end]).view(dtype)
        out[name] = flat.reshape(meta["shape"])
    return out


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(f"{index} is corrupt: {e}") from e
        files = [model_dir / f for f in sorted(set(weight_map.values()))]
    elif (model_dir / "model.safetensors").exists():
        files = [model_dir / "model.safetensors"]
    else:
        raise ModelLoadError(
            f"no weights in {model_dir}: expected model.safetensors or model.safetensors.index.json"
        )
    missing = [str(f) for f in files if not f.exists()]
    if missing:
        raise ModelLoadError(f"weight shards are missing: {', '.join(missing)}")
    return files


def load_weights(model_dir: str | Path, dtype: np.dtype | None = None) -> Mapping[str, np.ndarray]:
    """Every tensor of the checkpoint, by its HF name, in the dtype it is stored in; in an fp8 block-scaled
    checkpoint (`fp8_checkpoint`) each fp8 weight dequantized when read, into dtype (default float32)."""
    weights: dict[str, np.ndarray] = {}
    for path in checkpoint_files(model_dir):
        weights.update(read_safetensors(path))
    scheme = scheme_of(model_dir)
    return weights if scheme is None else DequantizedTensors(weights, scheme, dtype)
