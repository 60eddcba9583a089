"""The decode tier's mixture-of-experts step on CUDA as two Triton kernels (the CPU runs the same math as a
grouped loop: `moe.MoeMlp`).

1. `align`: the step's token copies (each token's top k) sorted by expert, each expert's run padded to whole
   blocks of BLOCK_M rows, and the expert of each block; on the device, with no host synchronisation (the
   number of blocks is a bound from the shapes alone: min(E, T k) experts can be chosen, each adding less
   than one block of padding), so a step's routing never waits on the host.
2. `gate_up` (a program per (block, tile of the intermediate)): the block's rows gathered from the tokens,
   times its expert's gate and up rows, accumulated in fp32, the activation (SiLU or tanh-GELU) of the gate
   times the up, into an intermediate [blocks x BLOCK_M, I].
3. `down` (a program per (block, tile of the hidden size)): the intermediate times its expert's down
   projection, times each copy's routing weight, into one fp32 row per copy [T k, d]; the k copies of each
   token are then summed in fp32 and cast, as the grouped loop sums them.
Each expert a step chose has its weights read once per block of its rows (one block at decode batches);
blocks past the chosen experts' end at once, and no unchosen expert is read. int8/fp8 expert weights (per
output channel scales, `quant.quantize`) are read as their bytes and converted in registers, the scale
applied to the fp32 accumulator.

On the CPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1) in the tests.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

BLOCK_N = 64
"""Output columns one program computes."""
BLOCK_K = 64
"""Input columns one iteration of a program reads."""


@dataclass(frozen=True)
class StackedExperts:
    """One layer's expert weights as the kernels read them, stacked over the experts; each expert's `Linear`
    holds a view of its slice (the memory is not doubled)."""

    gate_up: torch.Tensor  # [E, 2 I, d] compute dtype, int8 or float8_e4m3fn: gate rows, then up rows
    down: torch.Tensor  # [E, d, I]
    gate_up_scale: torch.Tensor | None  # [E, 2 I, 1] float32 when quantized
    down_scale: torch.Tensor | None  # [E, d, 1]


def stack_experts(gate_up: list, down: list) -> StackedExperts:
    """The experts' `Linear`s (gate|up fused, down) stacked; each Linear's weight (and scale) then becomes a
    view of the stack, its own tensor freed."""
    from torch import nn

    def stack(linears: list, name: str) -> torch.Tensor | None:
        if getattr(linears[0], name) is None:
            return None
        stacked = torch.stack([getattr(m, name) for m in linears])  # [E, out, in | 1]
        for e, m in enumerate(linears):
            setattr(m, name, nn.Buffer(stacked[e]))
        return stacked

    if any(m.packed for m in (*gate_up, *down)):
        raise ValueError("prepacked (oneDNN) expert weights cannot be stacked for the CUDA kernel")
    return StackedExperts(stack(gate_up, "weight"), stack(down, "weight"), stack(gate_up, "scale"),
                          stack(down, "scale"))


def num_blocks(copies: int, num_experts: int, block_m: int) -> int:
    """The most blocks `align` can fill: each chosen expert (at most min(E, copies)) pads its run by < block_m."""
    return (copies + min(num_experts, copies) * (block_m - 1)) // block_m


def block_m_for(copies: int, num_experts: int) -> int:
    """Rows per block: 16 (tl.dot's least) up to 64, about the copies an expert gets."""
    per_expert = -(-copies // num_experts)
    return min(64, max(16, 1 << (per_expert - 1).bit_length()))


def align(experts: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """experts [T, k] -> (copies [P] int32: the copy (t k + j) each padded row holds, T k for a pad row;
    block experts [P / block_m] int32: each block's expert, num_experts past the last chosen one).
    P = num_blocks(T k, E, block_m) x block_m."""
    flat = experts.flatten()  # [T k]
    n = flat.numel()
    device = flat.device
    order = flat.argsort(stable=True)  # [T k] copies sorted by expert
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    ends = padded.cumsum(0)  # [E]
    sorted_experts = flat[order]  # [T k]
    rank = torch.arange(n, device=device) - (counts.cumsum(0) - counts)[sorted_experts]  # place in its expert's run
    blocks = num_blocks(n, num_experts, block_m)
    copies = torch.full((blocks * block_m,), n, dtype=torch.int32, device=device)
    copies[(ends - padded)[sorted_experts] + rank] = order.to(torch.int32)
    starts = torch.arange(blocks, device=device) * block_m
    block_experts = torch.searchsorted(ends, starts, right=True).to(torch.int32)  # [blocks]
    return copies, block_experts


@functools.cache
def _kernels():
    """The Triton kernels, made on first use (so a test can choose the interpreter before they are)."""
    import triton
    import triton.language as tl

    @triton.jit
    def gate_up(
        X, W, WS, COPIES, BLOCK_EXPERTS, H,
        stride_x, stride_we, stride_wn, stride_se, stride_h,
        num_copies, I, K,
        E: tl.constexpr, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        QUANT: tl.constexpr, IEEE: tl.constexpr, GELU: tl.constexpr,
    ):
        blk = tl.program_id(0)
        e = tl.load(BLOCK_EXPERTS + blk)
        if e >= E:  # past the chosen experts' runs
            return
        r = blk * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] padded rows
        copy = tl.load(COPIES + r)
        row_ok = copy < num_copies
        token = copy // TOP_K
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] intermediate columns
        n_ok = n < I
        w_gate = W + e.to(tl.int64) * stride_we + n[None, :] * stride_wn  # [1, BLOCK_N] row starts
        w_up = w_gate + I * stride_wn
        gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < K
            x = tl.load(X + token[:, None].to(tl.int64) * stride_x + k[None, :],
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
            w_ok = k_ok[:, None] & n_ok[None, :]
            wg = tl.load(w_gate + k[:, None], mask=w_ok, other=0.0).to(x.dtype)  # [BLOCK_K, BLOCK_N]
            wu = tl.load(w_up + k[:, None], mask=w_ok, other=0.0).to(x.dtype)
            if IEEE:
                gate += tl.dot(x, wg, input_precision="ieee")
                up += tl.dot(x, wu, input_precision="ieee")
            else:
                gate += tl.dot(x, wg)
                up += tl.dot(x, wu)
        if QUANT:
            scales = WS + e.to(tl.int64) * stride_se + n
            gate *= tl.load(scales, mask=n_ok, other=0.0)[None, :]
            up *= tl.load(scales + I, mask=n_ok, other=0.0)[None, :]
        if GELU:  # tanh-GELU, tanh from exp: 1 - 2 / (e^2y + 1)
            y = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
            act = 0.5 * gate * (2.0 - 2.0 / (tl.exp(2.0 * y) + 1.0))
        else:  # SiLU
            act = gate / (1.0 + tl.exp(-gate))
        out = H + r[:, None].to(tl.int64) * stride_h + n[None, :]
        tl.store(out, (act * up).to(H.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])

    @triton.jit
    def down(
        H, W, WS, COPIES, BLOCK_EXPERTS, ROUTE_W, Y,
        stride_h, stride_we, stride_wn, stride_se, stride_y,
        num_copies, N, I,
        E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        QUANT: tl.constexpr, IEEE: tl.constexpr,
    ):
        blk = tl.program_id(0)
        e = tl.load(BLOCK_EXPERTS + blk)
        if e >= E:
            return
        r = blk * BLOCK_M + tl.arange(0, BLOCK_M)
        copy = tl.load(COPIES + r)
        row_ok = copy < num_copies
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] hidden columns
        n_ok = n < N
        w_rows = W + e.to(tl.int64) * stride_we + n[None, :] * stride_wn
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, I, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < I
            h = tl.load(H + r[:, None].to(tl.int64) * stride_h + k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                        other=0.0)  # [BLOCK_M, BLOCK_K]
            w = tl.load(w_rows + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0).to(h.dtype)
            if IEEE:
                acc += tl.dot(h, w, input_precision="ieee")
            else:
                acc += tl.dot(h, w)
        if QUANT:
            acc *= tl.load(WS + e.to(tl.int64) * stride_se + n, mask=n_ok, other=0.0)[None, :]
        acc = acc.to(H.dtype.element_ty).to(tl.float32)  # the expert's output in the compute dtype, as the loop's
        weight = tl.load(ROUTE_W + copy, mask=row_ok, other=0.0)  # [BLOCK_M] f32
        out = Y + copy[:, None].to(tl.int64) * stride_y + n[None, :]
        tl.store(out, acc * weight[:, None], mask=row_ok[:, None] & n_ok[None, :])

    return gate_up, down


def fused_experts(
    x: torch.Tensor,  # [T, d] the tokens (the MLP norm's output), compute dtype
    weights: torch.Tensor,  # [T, k] f32 routing weights (`moe.route`)
    experts: torch.Tensor,  # [T, k] int64 chosen experts
    stacked: StackedExperts,
    act: str,  # "silu" or a tanh-GELU name
) -> torch.Tensor:
    """sum over each token's k experts of weight * down(act(gate(x)) * up(x)) -> [T, d] in x's dtype."""
    T, d = x.shape
    k = experts.shape[1]
    E, two_i, _ = stacked.gate_up.shape
    I = two_i // 2
    if x.stride(-1) != 1:
        x = x.contiguous()
    copies = T * k
    block_m = block_m_for(copies, E)
    rows, block_experts = align(experts, E, block_m)
    blocks = block_experts.shape[0]
    h = torch.empty(rows.shape[0], I, dtype=x.dtype, device=x.device)  # [P, I]
    y = torch.empty(copies, d, dtype=torch.float32, device=x.device)  # [T k, d]
    quant = stacked.gate_up_scale is not None
    gate_up, down = _kernels()
    ieee = x.dtype == torch.float32
    su = stacked.gate_up_scale if quant else x  # any pointer when unused
    sd = stacked.down_scale if quant else x
    gate_up[(blocks, -(-I // BLOCK_N))](
        x, stacked.gate_up, su, rows, block_experts, h,
        x.stride(0), stacked.gate_up.stride(0), stacked.gate_up.stride(1), su.stride(0) if quant else 0, h.stride(0),
        copies, I, d,
        E=E, TOP_K=k, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, QUANT=quant, IEEE=ieee, GELU=act != "silu",
    )
    down[(blocks, -(-d // BLOCK_N))](
        h, stacked.down, sd, rows, block_experts, weights.contiguous().view(-1), y,
        h.stride(0), stacked.down.stride(0), stacked.down.stride(1), sd.stride(0) if quant else 0, y.stride(0),
        copies, d, I,
        E=E, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, QUANT=quant, IEEE=ieee,
    )
    return y.view(T, k, d).sum(1).to(x.dtype)


def runs(weight_format: str | None, dtype: torch.dtype, device: torch.device) -> tuple[bool, str]:
    """Whether the fused kernels run here for the format and compute dtype, and agree with the grouped loop on
    a small random MoE (tried once at start-up) -> (ok, why not)."""
    from pdserve.server.decode.moe import MoeMlp
    from pdserve.server.decode.quant import quantize
    from pdserve.server.model.config import MoeConfig

    try:
        torch.manual_seed(0)
        mlp = MoeMlp(MoeConfig(num_experts=4, top_k=2, intermediate_size=64, renormalize=True), 128, "silu", dtype,
                     device)
        for buffer in mlp.buffers():
            buffer.normal_(0.0, 0.1)
        if weight_format is not None:
            quantize(mlp, weight_format)  # type: ignore[arg-type]
        x = torch.randn(5, 128, device=device).to(dtype)
        with torch.inference_mode():
            want = mlp(x).float()
            mlp.fuse()
            got = mlp(x).float()
    except Exception as e:  # noqa: BLE001 - any failure (a Triton compile error included): not this kernel
        return False, f"raised {e!r}"
    err = ((got - want).abs().max() / want.abs().max().clamp(min=1e-6)).item()
    return err < 0.03, f"max error {err:.2e} of the largest output against the grouped loop"
