"""An fp8 block-scaled copy of a tiny checkpoint (`tiny.py`) as DeepSeek-V3/R1 ship theirs, and its dequantized
twin: the same model in float32 weights equal to fp8 x scale, which transformers runs as the oracle of the fp8
copy's tokens (`fp8_checkpoint` describes the format)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path

QUANTIZED = ("_proj.weight", "_proj_with_mqa.weight")
"""The linears quantized, as DeepSeek-V3 does: every `*_proj` (attention, kv_a_proj_with_mqa, MLP, experts); not the
embeddings, norms, routers (`mlp.gate`) or lm_head."""


def quantize_blocks(w, block: tuple[int, int]):
    """w [rows, cols] float -> (fp8 e4m3 [rows, cols], scale_inv float32 [ceil(rows / br), ceil(cols / bc)]): each
    block's absmax maps to 448, the last blocks ragged where the shape is not a multiple of the block."""
    import torch

    rows, cols = w.shape
    br, bc = block
    grid = (-(-rows // br), -(-cols // bc))
    padded = torch.zeros(grid[0] * br, grid[1] * bc)
    padded[:rows, :cols] = w.float()
    tiles = padded.view(grid[0], br, grid[1], bc)
    scale = tiles.abs().amax(dim=(1, 3)) / 448.0  # [gr, gc]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (tiles / scale[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q.view(grid[0] * br, grid[1] * bc)[:rows, :cols].contiguous(), scale


def dequantize_blocks(q, scale, block: tuple[int, int]):
    """fp8 [rows, cols] x its block's scale -> float32 [rows, cols] (what a loader must reproduce exactly)."""
    rows, cols = q.shape
    br, bc = block
    full = scale.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
    return q.float() * full


def make_fp8_pair(src_dir: str | Path, fp8_dir: str | Path, twin_dir: str | Path, *,
                  block: tuple[int, int] = (128, 128), not_converted: Sequence[str] = ()) -> tuple[Path, Path]:
    """Writes fp8_dir (src's `*_proj` weights as float8_e4m3fn + `weight_scale_inv` per block, config.json with the
    quantization_config) and twin_dir (the same weights dequantized to float32, no quantization_config), both with
    src's tokenizer and generation config; modules in not_converted stay as src stores them."""
    import torch
    from safetensors.torch import load_file, save_file

    from pdserve.server.model.fp8_checkpoint import Fp8Blocks

    src, fp8, twin = Path(src_dir), Path(fp8_dir), Path(twin_dir)
    scheme = Fp8Blocks(block, tuple(not_converted))
    quantized: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for path in sorted(src.glob("*.safetensors")):
        for name, w in load_file(path).items():
            if name.endswith(QUANTIZED) and w.ndim == 2 and scheme.converts(name.rsplit(".", 1)[0]):
                q, scale = quantize_blocks(w, block)
                quantized[name], quantized[name + "_scale_inv"] = q, scale
                dequantized[name] = dequantize_blocks(q, scale, block)
            else:
                quantized[name] = dequantized[name] = w
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    quant = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(block), "activation_scheme": "dynamic"}
    if not_converted:
        quant["modules_to_not_convert"] = list(not_converted)
    for out, tensors, cfg in ((fp8, quantized, dict(config, quantization_config=quant)), (twin, dequantized, config)):
        out.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
        for extra in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            if (src / extra).exists():
                shutil.copy(src / extra, out / extra)
    return fp8, twin
