"""The decode tier's LoRA BGMV Triton kernels (`cuda_lora`) for `benchmarks/gpu.py` (inside its `kernels` stage),
correctness before speed:

1. checks (group "lora-kernel"): `cuda_lora.bgmv` against the torch path (`bgmv_torch` in fp32) for bf16, fp16
   and fp32 adapters, decode rows mixing 4 adapters and the base model (whose rows must come out exactly y) and
   a local prefill's row of many tokens;
2. timing: one Llama-3-8B-shape layer's four fused matmuls (wqkv, wo, w_gate_up, w_down; bf16) at batch 16, base
   only against the same step with every row's adapter delta (4 adapters of rank 16 on q/k/v/o/gate/up/down, 4
   rows each), through the kernels and through the path taken without them (`lora.bgmv_dense`, the CPU's: two
   dense matmuls over the used slots): the base step's time / the mixed step's time, target >= 1 / 1.3 (issue 41:
   a batch mixing 4 adapters at most 1.3x the base-only batch).
"""

from __future__ import annotations

import torch

LAYER = dict(d=4096, qkv=6144, I=14336)
"""Llama-3-8B: hidden 4096, q + k + v = 4096 + 2 x 1024, intermediate 14336."""
TINY_LAYER = dict(d=64, qkv=96, I=128)
"""The dry run's (Triton's interpreter runs a program at a time: 128 `expand` programs a step, not 240)."""
RANK = 16
ADAPTERS = 4


def _modules(shape: dict) -> dict[str, tuple[int, int, int]]:
    """Each fused matmul: (in, out, projections fused) as `lora.FUSED` packs them."""
    d, qkv, inter = shape["d"], shape["qkv"], shape["I"]
    return {"wqkv": (d, qkv, 3), "wo": (d, d, 1), "w_gate_up": (d, 2 * inter, 2), "w_down": (inter, d, 1)}


def _stacks(fan_in: int, out: int, rank: int, dtype: torch.dtype, device, seed: int):
    """A [1 + ADAPTERS, in, rank], B [1 + ADAPTERS, rank, out]: slot 0 zeros, as `LoraSlots` keeps them."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    a = torch.randn(1 + ADAPTERS, fan_in, rank, generator=g) / fan_in**0.5
    b = torch.randn(1 + ADAPTERS, rank, out, generator=g) / rank**0.5
    a[0], b[0] = 0, 0
    return a.to(device, dtype), b.to(device, dtype)


def lora_checks(device, dtypes: tuple[torch.dtype, ...], check_type) -> list:
    from pdserve.server.decode import cuda_lora

    checks = []
    for dtype in dtypes:
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        for rows, tokens in ((16, 1), (1, 9)):
            name = f"LoRA BGMV kernels vs the torch path: {str(dtype)[6:]}, {rows} rows x {tokens} tokens"
            try:
                a, b = _stacks(160, 200, 3 * RANK, dtype, device, seed=rows)
                g = torch.Generator(device="cpu").manual_seed(tokens)
                x = torch.randn(rows, tokens, 160, generator=g).to(device, dtype)
                y = torch.randn(rows, tokens, 200, generator=g).to(device, dtype)
                slot = (torch.arange(rows) % (1 + ADAPTERS)).to(device)  # the base and 4 adapters mixed
                if rows == 1:
                    slot += 2
                got = cuda_lora.bgmv(x, y, slot, a, b)
                want = cuda_lora.bgmv_torch(x.float(), y.float(), slot, a.float(), b.float())
                err = ((got.float() - want).abs().max() / want.abs().max()).item()
                base = slot == 0
                exact = bool(torch.equal(got[base], y[base]))
                checks.append(check_type(name, err < tol and exact, f"max error {err:.2e} of the largest output "
                                         f"(tolerance {tol:g}); base rows exactly y: {exact}", err, "lora-kernel"))
            except Exception as e:  # noqa: BLE001 - reported, the run goes on
                checks.append(check_type(name, False, f"raised {e!r}", group="lora-kernel"))
    return checks


def lora_rows(device, out, dry_run: bool, row_type, timed, sync) -> None:
    """Base-only vs a batch of 16 mixing 4 adapters: one layer's fused matmuls, kernels and torch path."""
    from pdserve.server.decode import cuda_lora
    from pdserve.server.decode.lora import bgmv_dense, slot_mask

    shape = TINY_LAYER if dry_run else LAYER
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    reps, runs = (1, 1) if dry_run else (50, 3)
    if not out.allows("LoRA BGMV batch 16", 1 if dry_run else 15):
        return
    batch = 16
    g = torch.Generator(device="cpu").manual_seed(0)
    layer = {}
    for i, (name, (fan_in, fan_out, k)) in enumerate(_modules(shape).items()):
        w = (torch.randn(fan_out, fan_in, generator=g) / fan_in**0.5).to(device, dtype)
        layer[name] = (w, *_stacks(fan_in, fan_out, k * RANK, dtype, device, seed=i),
                       torch.randn(batch, 1, fan_in, generator=g).to(device, dtype))
    slot = (torch.arange(batch) % ADAPTERS + 1).to(device)  # 4 rows per adapter, no base row
    mask = slot_mask(slot, 1)
    in_first = {name: a.transpose(0, 1).contiguous() for name, (_, a, _, _) in layer.items()}  # LoraSlots' layout

    def step(bgmv) -> None:
        for name, (w, a, b, x) in layer.items():
            y = torch.nn.functional.linear(x, w)
            if bgmv is cuda_lora.bgmv:
                bgmv(x, y, slot, a, b)
            elif bgmv is not None:
                bgmv_dense(x, y, mask, in_first[name], b)

    with torch.inference_mode():
        base = timed(lambda: step(None), reps, sync, runs)
        kernel = timed(lambda: step(cuda_lora.bgmv), reps, sync, runs)
        dense = timed(lambda: step(bgmv_dense), reps, sync, runs)
    what = f"batch {batch}, {ADAPTERS} adapters of rank {RANK}, one layer's fused matmuls"
    out.row(row_type("lora bgmv", f"{what}: us, mixed through the kernels vs base only", kernel * 1e6, base * 1e6,
                     "us"),
            row_type("lora bgmv", f"{what}: base time / mixed time through the kernels (target: mixed <= 1.3x)",
                     base / kernel, 1.0, "x", target=1 / 1.3, needs=("lora-kernel",)),
            row_type("lora bgmv", f"{what}: us, mixed through the dense path (no kernels) vs the kernels",
                     dense * 1e6, kernel * 1e6, "us"),
            row_type("lora bgmv", f"{what}: base time / mixed time through the dense path", base / dense, 1.0, "x"))
