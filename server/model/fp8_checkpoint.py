"""Block-scaled fp8 checkpoints as DeepSeek-V3/R1 ship them (transformers' finegrained fp8, `quant_method: fp8`).

config.json's `quantization_config` is {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
"activation_scheme": "dynamic"} (optionally `modules_to_not_convert`). Each quantized linear `X` stores `X.weight`
as float8_e4m3fn [out, in] beside `X.weight_scale_inv`, float32 [ceil(out / 128), ceil(in / 128)]: the weight is
fp8 x scale_inv of its block, the last block of a row or column ragged where out or in is not a multiple of 128
(transformers' `FP8Linear` sizes its scales so). `weight_block_size: null` means one scale per tensor. Everything
else (embeddings, norms, routers, lm_head, the modules_to_not_convert) is stored in its float dtype.

Neither tier has a matmul over block-scaled fp8 weights yet, so both read the checkpoint through
`DequantizedTensors`: each weight is dequantized in float32 (fp8 x scale, the product transformers' dequantizer
computes) when a tier reads it, then cast to the dtype it asks for.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from pdserve.server.model.config import ModelLoadError

SCALE_SUFFIX = "_scale_inv"
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)


@dataclass(frozen=True)
class Fp8Blocks:
    """A checkpoint's fp8 weight scheme, read from its quantization_config."""

    block: tuple[int, int] | None
    """[rows, cols] one scale covers; None: one scale per tensor."""
    not_converted: tuple[str, ...] = ()
    """modules_to_not_convert: module names (or regexes, or suffixes, as transformers matches them) stored
    unquantized."""

    @classmethod
    def from_config(cls, quant: Any) -> Fp8Blocks:
        """The scheme of a quantization_config; raises ValueError saying what is not served and why."""
        if not isinstance(quant, dict) or quant.get("quant_method") != "fp8":
            method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
            raise ValueError(f"quant_method {method!r}: pdserve loads fp8 (e4m3, block-scaled) checkpoints only; serve "
                             "the unquantized checkpoint and quantize at load with --quantization fp8 or int8")
        if quant.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"fmt {quant['fmt']!r}: only e4m3 fp8 weights are read (DeepSeek-V3/R1's format)")
        if quant.get("activation_scheme", "dynamic") != "dynamic":
            raise ValueError(f"activation_scheme {quant['activation_scheme']!r}: static activation scales are not "
                             "applied by pdserve; only 'dynamic' fp8 checkpoints are served")
        block = quant.get("weight_block_size")
        if block is not None and (not isinstance(block, list) or len(block) != 2
                                  or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise ValueError(f"weight_block_size {block!r}: expected two positive integers [rows, cols] or null")
        skip = quant.get("modules_to_not_convert") or ()
        if not isinstance(skip, (list, tuple)) or not all(isinstance(s, str) for s in skip):
            raise ValueError(f"modules_to_not_convert {skip!r}: expected a list of module names")
        for pattern in skip:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"modules_to_not_convert entry {pattern!r} is not a valid pattern ({e})") from e
        return cls(tuple(block) if block is not None else None, tuple(skip))

    def describe(self) -> str:
        blocks = f"{self.block[0]}x{self.block[1]} block scales" if self.block else "one scale per tensor"
        return f"fp8 e4m3 checkpoint ({blocks})"

    def converts(self, module: str) -> bool:
        """Whether a module may be stored quantized (transformers' `should_convert_module` rule)."""
        boundary = r"(?:(?<=\.)|(?=\.|$))"
        return not any(re.match(rf"(?:{key}){boundary}", module) or module.endswith(key) for key in self.not_converted)


def scheme_of(model_dir: str | Path) -> Fp8Blocks | None:
    """The fp8 scheme config.json in model_dir declares, None for a checkpoint without quantization_config."""
    config = Path(model_dir) / "config.json"
    if not config.exists():
        return None
    try:
        quant = json.loads(config.read_text()).get("quantization_config")
    except (json.JSONDecodeError, AttributeError) as e:
        raise ModelLoadError(f"{config} is not a JSON object ({e}); fix or re-download it") from e
    if not quant:
        return None
    try:
        return Fp8Blocks.from_config(quant)
    except ValueError as e:
        raise ModelLoadError(f"config.json sets quantization_config with {e}") from e


def dequantize(name: str, weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int] | None) -> np.ndarray:
    """weight [..., rows, cols] fp8 x its block's scale [..., ceil(rows / br), ceil(cols / bc)], in float32."""
    if block is None:
        if scale_inv.size != 1:
            raise ModelLoadError(f"{name}{SCALE_SUFFIX} has shape {list(scale_inv.shape)}; weight_block_size null "
                                 "means one scale per tensor: is config.json's quantization_config the checkpoint's?")
        return weight.astype(np.float32) * np.float32(scale_inv.reshape(()))
    if weight.ndim < 2:
        raise ModelLoadError(f"{name} is fp8 with shape {list(weight.shape)}: block scales need a matrix")
    rows, cols = weight.shape[-2:]
    br, bc = block
    grid = (*weight.shape[:-2], -(-rows // br), -(-cols // bc))
    if tuple(scale_inv.shape) != grid:
        raise ModelLoadError(
            f"{name}{SCALE_SUFFIX} has shape {list(scale_inv.shape)}; a {list(weight.shape)} weight in {br}x{bc} "
            f"blocks needs {list(grid)} (one scale per block, the last one ragged): the checkpoint does not match "
            "config.json's weight_block_size; re-download it or fix weight_block_size")
    scale = np.repeat(np.repeat(scale_inv.astype(np.float32), br, axis=-2)[..., :rows, :], bc, axis=-1)[..., :cols]
    return weight.astype(np.float32) * scale


class DequantizedTensors(Mapping[str, np.ndarray]):
    """A checkpoint's tensors by name with every fp8 weight dequantized when read (lazily: one weight at a time in
    memory) and cast to `dtype` when one is given, the `_scale_inv` tensors consumed; the others as stored."""

    def __init__(self, stored: Mapping[str, np.ndarray], scheme: Fp8Blocks, dtype: np.dtype | None = None):
        """Checks the pairing at once: every fp8 tensor has its scale, every scale its fp8 weight, and no module
        listed in modules_to_not_convert is stored quantized."""
        self.stored, self.scheme, self.dtype = stored, scheme, dtype
        for name, tensor in stored.items():
            if name.endswith(SCALE_SUFFIX):
                weight = name[: -len(SCALE_SUFFIX)]
                if weight not in stored:
                    raise ModelLoadError(f"the checkpoint holds {name} but no {weight}: it is incomplete; "
                                         "re-download it")
                if stored[weight].dtype != FP8:
                    raise ModelLoadError(f"{weight} is {stored[weight].dtype}, not float8_e4m3fn, yet has a "
                                         f"{SCALE_SUFFIX}: the checkpoint is not the fp8 one config.json describes")
                if not scheme.converts(weight.rsplit(".", 1)[0]):
                    raise ModelLoadError(f"{weight} is stored fp8 but its module is in modules_to_not_convert: "
                                         "config.json's quantization_config is not the checkpoint's")
            elif tensor.dtype == FP8 and name + SCALE_SUFFIX not in stored:
                raise ModelLoadError(f"{name} is float8_e4m3fn but the checkpoint has no {name}{SCALE_SUFFIX}: "
                                     "its values cannot be recovered; re-download the checkpoint")
        self.names = [n for n in stored if not n.endswith(SCALE_SUFFIX)]
        self.quantized = sum(1 for n in stored if n.endswith(SCALE_SUFFIX))
        """How many weights the checkpoint stores in fp8."""

    def __getitem__(self, name: str) -> np.ndarray:
        if name.endswith(SCALE_SUFFIX):
            raise KeyError(name)
        tensor = self.stored[name]
        if (scale := self.stored.get(name + SCALE_SUFFIX)) is not None:
            tensor = dequantize(name, tensor, scale, self.scheme.block)
            return tensor if self.dtype is None else tensor.astype(self.dtype)
        return tensor

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and not name.endswith(SCALE_SUFFIX) and name in self.stored

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def load_note(model_dir: str | Path, tier: str, dtype: str, device: str) -> str | None:
    """The start-up log line saying how a tier holds an fp8 checkpoint's weights; None for other checkpoints."""
    scheme = scheme_of(model_dir)
    if scheme is None:
        return None
    hint = " (its fp8 matmul with per-channel scales: --quantization fp8, which requantizes them)" \
        if device == "cuda" else ""
    return (f"{tier} weights: {scheme.describe()} dequantized to {dtype} at load: the {tier} tier has no "
            f"block-scaled fp8 matmul on {device}, so the weights are not kept fp8{hint}")
