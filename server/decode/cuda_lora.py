"""The decode tier's LoRA deltas on CUDA as two Triton kernels (punica's BGMV: batched gather matrix-vector; the
CPU runs the same sums as two dense matmuls over the used slots, `lora.bgmv_dense`).

For M rows x [M, in] (a step's tokens), each with its adapter's device slot [M], and one fused module's stacks
A [slots, in, R], B [slots, R, out] (R = k x --max-lora-rank, `lora.LoraAdapter.pack`):

1. `shrink` (a program per (row, tile of R, slice of `in`)): v[m] = x[m] @ A[slot[m]], accumulated in fp32 and
   the slices' sums added atomically into v [M, R] f32 (split-K, as punica's shrink: a decode batch has few rows,
   so one program per row would leave most of a GPU idle while each walked all of `in`);
2. `expand` (a program per (row, tile of out)): out[m] = y[m] + v[m] @ B[slot[m]], y the base matmul's output.

A row in slot 0 (the base model) reads neither A nor B: `shrink` returns at once, `expand` copies y, so its
delta is exactly zero and a base-only batch costs one copy. Each adapter row reads its own A and B once (decode
rows are one token each, so a matrix-vector product per row is all there is to do; no tensor cores: R is 8-192).

On the CPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1) in the tests, and
`benchmarks/gpu.py`'s kernels stage checks them against the torch path on the device.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

BLOCK_K = 64
"""Input columns one iteration of `shrink` reads."""
SPLIT_K = 256
"""Input columns one `shrink` program sums (its slice of `in`)."""
BLOCK_N = 64
"""Output columns one `expand` program writes."""

Bgmv = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""(x [B, S, in], y [B, S, out], slot [B] int64, A [slots, in, R], B [slots, R, out]) -> y + each row's delta."""


@functools.cache
def _kernels():
    """The Triton kernels, made on first use (a test chooses the interpreter before)."""
    import triton
    import triton.language as tl

    @triton.jit
    def shrink(X, A, SLOT, V, K, R, stride_x, stride_as, stride_ak, stride_v,
               BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, SPLIT_K: tl.constexpr):
        """V[m, r tile] += X[m, k slice] @ A[SLOT[m], k slice, r tile] in fp32 (V zeroed); nothing for slot 0."""
        m = tl.program_id(0).to(tl.int64)
        s = tl.load(SLOT + m).to(tl.int64)
        if s != 0:
            r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
            first = tl.program_id(2) * SPLIT_K
            acc = tl.zeros([BLOCK_R], tl.float32)
            for start in range(first, first + SPLIT_K, BLOCK_K):
                k = start + tl.arange(0, BLOCK_K)
                x = tl.load(X + m * stride_x + k, mask=k < K, other=0.0).to(tl.float32)  # [BLOCK_K]
                a = tl.load(A + s * stride_as + k[:, None] * stride_ak + r[None, :],
                            mask=(k[:, None] < K) & (r[None, :] < R), other=0.0).to(tl.float32)  # [BLOCK_K, BLOCK_R]
                acc += tl.sum(x[:, None] * a, 0)
            tl.atomic_add(V + m * stride_v + r, acc, mask=r < R)

    @triton.jit
    def expand(V, B, Y, SLOT, OUT, N, R, stride_v, stride_bs, stride_br, stride_y, stride_out,
               BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
        """OUT[m, n tile] = Y[m, n tile] + V[m] @ B[SLOT[m], :, n tile]; Y's values for slot 0."""
        m = tl.program_id(0).to(tl.int64)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        s = tl.load(SLOT + m).to(tl.int64)
        y = tl.load(Y + m * stride_y + n, mask=n < N, other=0.0)
        if s != 0:
            acc = tl.zeros([BLOCK_N], tl.float32)
            for start in range(0, R, BLOCK_R):
                r = start + tl.arange(0, BLOCK_R)
                v = tl.load(V + m * stride_v + r, mask=r < R, other=0.0)  # [BLOCK_R] f32
                b = tl.load(B + s * stride_bs + r[:, None] * stride_br + n[None, :],
                            mask=(r[:, None] < R) & (n[None, :] < N), other=0.0).to(tl.float32)  # [BLOCK_R, BLOCK_N]
                acc += tl.sum(v[:, None] * b, 0)
            y = (y.to(tl.float32) + acc).to(y.dtype)
        tl.store(OUT + m * stride_out + n, y, mask=n < N)

    return shrink, expand


def _block_r(rank: int) -> int:
    """Rank columns one program holds: the fused rank rounded up to a power of two, 16 to 64."""
    return min(64, max(16, 1 << (rank - 1).bit_length()))


def bgmv(x: torch.Tensor, y: torch.Tensor, slot: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """y [B, S, out] (the base matmul of x [B, S, in]) plus each row's adapter delta (x @ A[slot]) @ B[slot], in a
    new tensor of y's dtype; every token of row i reads slot[i]. A [slots, in, R], B [slots, R, out] with unit
    stride in their last dimension (a layer's stacks of `LoraSlots.stacks`, A's viewed slot-first)."""
    B_, S, K = x.shape
    N, R = y.shape[-1], a.shape[-1]
    rows = x.reshape(B_ * S, K)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    base = y.reshape(B_ * S, N)
    if base.stride(-1) != 1:
        base = base.contiguous()
    if a.stride(-1) != 1 or b.stride(-1) != 1:
        raise ValueError("bgmv: the adapters' stacks must have unit stride in their last dimension")
    slots = slot.repeat_interleave(S) if S > 1 else slot  # [M]
    M = B_ * S
    block_r = _block_r(R)
    v = torch.zeros(M, R, dtype=torch.float32, device=x.device)
    out = torch.empty(M, N, dtype=y.dtype, device=y.device)
    shrink, expand = _kernels()
    shrink[(M, -(-R // block_r), -(-K // SPLIT_K))](rows, a, slots, v, K, R, rows.stride(0), a.stride(0),
                                                    a.stride(1), v.stride(0), BLOCK_K=BLOCK_K, BLOCK_R=block_r,
                                                    SPLIT_K=SPLIT_K)
    expand[(M, -(-N // BLOCK_N))](v, b, base, slots, out, N, R, v.stride(0), b.stride(0), b.stride(1),
                                  base.stride(0), out.stride(0), BLOCK_N=BLOCK_N, BLOCK_R=block_r)
    return out.reshape(y.shape)


def bgmv_torch(x: torch.Tensor, y: torch.Tensor, slot: torch.Tensor, a: torch.Tensor, b: torch.Tensor
               ) -> torch.Tensor:
    """The same sums by two `bmm`s over each row's gathered A and B: the kernels' reference."""
    delta = torch.bmm(torch.bmm(x.to(a.dtype), a[slot]), b[slot])  # [B, S, out]
    return y + delta.to(y.dtype)


def runs(dtype: torch.dtype, device: torch.device) -> tuple[bool, str]:
    """Whether the kernels run on device for adapters in dtype and agree with `bgmv_torch` on a small batch mixing
    two adapters and the base model; (False, why) otherwise."""
    try:
        g = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(3, 1, 96, generator=g).to(device, dtype)
        y = torch.randn(3, 1, 80, generator=g).to(device, dtype)
        a = (torch.randn(3, 96, 24, generator=g) / 10).to(device, dtype)
        b = (torch.randn(3, 24, 80, generator=g) / 10).to(device, dtype)
        a[0], b[0] = 0, 0
        slot = torch.tensor([2, 0, 1], device=device)
        got, want = bgmv(x, y, slot, a, b).float(), bgmv_torch(x, y, slot, a, b).float()
    except Exception as e:  # noqa: BLE001 - any failure (a Triton compile error included): not this kernel
        return False, f"{type(e).__name__}: {e}"
    err = ((got - want).abs().max() / want.abs().max()).item()
    if not err <= 0.02 or not torch.equal(got[1], y[1].float()):
        return False, f"disagrees with the torch path (max relative error {err:.3g})"
    return True, f"agrees with the torch path (max relative error {err:.1e})"


@functools.cache
def pick(dtype: torch.dtype, device: torch.device) -> tuple[Bgmv | None, str]:
    """(the kernels, why) for adapters in dtype on device where they run (CUDA with triton installed), else
    (None, why not): the torch path. Tried once per (dtype, device)."""
    if device.type != "cuda":
        return None, f"{device.type} runs the torch path"
    from pdserve.server.decode.cuda_attention import have_triton

    if not have_triton():
        return None, "triton is not installed (pip install triton)"
    ok, why = runs(dtype, device)
    return (bgmv if ok else None), why
